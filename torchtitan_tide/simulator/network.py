"""Links of the simulated cluster: alpha-beta per message, the per-node NIC cap, NCCL's
ring channels and NVLink (NV18) between the GPUs of a node.

Every figure here is a named physical or library figure, printed with its source
(:data:`SOURCES`); the measured rates come from ``inputs`` (2x H200).

- NVLink: an H200 has 18 NVLink-4 links (``NV18``) of 26.5625 GB/s per direction each:
  478 GB/s per direction per GPU, shared by the 7 peers of an 8-GPU node (NVSwitch). On
  the measured 2x H200 machine the one peer had all 18 links, so a node-local rate
  measured there is already an aggregate per GPU; at L ranks per node it is taken as the
  aggregate over the L-1 peers, capped by NV18.
- NIC: one NIC per GPU at the cluster file's rate (``nic_gbps_per_gpu``), of which a
  transfer reaches what NCCL's maintainers expect of a 400 Gb/s NDR NIC: 46-48 GB/s
  (:data:`NIC_GBYTES_AT_400G`, the low end, 92% of the line rate;
  https://github.com/NVIDIA/nccl-tests/issues/290), for every mode alike. A ring across
  nodes crosses the network once per node on each of its channels' NICs, so it runs at
  ``L x`` that per GPU: NCCL spreads its channels over the node's L NICs (at 8 x 400
  Gb/s, 343 GiB/s). TIDE's cross-node moves go rail to
  rail, one NIC per GPU, which carries every cross-node byte of every stream of its GPU
  (the engine's shared link ``nic``).
- NCCL channels: the ring kernel measured at 2 ranks ran 24 CTAs (24 channels) over
  NVLink only; within one node that measured rate is the ring's. Across nodes NCCL opens
  channels per NIC and the NICs bind, not the 2-GPU channel count (issue 46, finding A:
  the 2-GPU rate, 271 GiB/s, had capped stock's ring below what it reaches there).
- Latency (alpha): NCCL's own tuning model (``src/graph/tuning.cc``, Ring / Simple):
  8.4 us per collective, 3.4 us per NVLink step, 9.6 us per network step; a ring
  all-gather or reduce-scatter of W ranks on N nodes has W-1 steps, N-1 of them across
  the network. A TIDE message (a send/recv step, a wave of puts, a batched copy) pays one
  step of its link.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_tide.simulator.cluster import GIB

NV18_GBPS = 18 * 26.5625  # GB/s per direction per GPU (NVLink 4: 26.5625 GB/s per link)
NCCL_BASE_US = 8.4  # tuning.cc baseLat, Ring / Simple
NVLINK_STEP_US = 3.4  # tuning.cc hwLat NVLINK, Ring / Simple
NET_STEP_US = 9.6  # tuning.cc hwLat NET, Ring / Simple
NCCL_RING_CHANNELS = 24  # CTAs of AllGather_RING_LL / ReduceScatter_RING_LL at 2 ranks
NIC_GBYTES_AT_400G = 46.0  # GB/s per 400 Gb/s NDR NIC (NCCL's maintainers: 46-48)
NIC_EFFICIENCY = NIC_GBYTES_AT_400G / 50.0

SOURCES = {
    "nvlink": (
        f"NV18: 18 NVLink-4 links x 26.5625 GB/s per direction = {NV18_GBPS:.0f} GB/s "
        f"({NV18_GBPS * 1e9 / GIB:.0f} GiB/s) per direction per GPU, shared by the node's "
        "peers (NVIDIA H200 SXM; nvidia-smi topo shows NV18 on the measured machine, "
        "docs/design/2026-11-29-h200-facts.md)"
    ),
    "nic": (
        f"the cluster file's nic_gbps_per_gpu, one NIC per GPU shared by every stream of the "
        f"GPU, at {100 * NIC_EFFICIENCY:.0f}% of its line rate ({NIC_GBYTES_AT_400G:.0f} GB/s per "
        "400 Gb/s NDR NIC: NCCL's maintainers expect 46-48, "
        "https://github.com/NVIDIA/nccl-tests/issues/290); NCCL's ring across nodes: L x that "
        "per GPU (343 GiB/s at 8 x 400 Gb/s)"
    ),
    "latency": (
        f"NCCL's tuning model (src/graph/tuning.cc, Ring / Simple): {NCCL_BASE_US} us per "
        f"collective + {NVLINK_STEP_US} us per NVLink step + {NET_STEP_US} us per network "
        "step; one step per TIDE message"
    ),
    "channels": (
        f"NCCL's ring ran {NCCL_RING_CHANNELS} CTAs (channels) at 2 ranks over NVLink "
        "(bench_collectives profile): its rate is the ring's within one node; across nodes "
        "NCCL runs channels on every NIC and the L NICs bind"
    ),
}


@dataclass(frozen=True)
class Layout:
    """``W`` ranks as ``N`` nodes of ``L`` (the FSDP group's ranks of one node)."""

    world: int
    local: int

    @property
    def nodes(self) -> int:
        return self.world // self.local


def nvlink_gibps() -> float:
    """NV18's per-direction bandwidth of one GPU, GiB/s."""
    return NV18_GBPS * 1e9 / GIB


def node_local_gibps(measured_gibps: float) -> float:
    """A node-local copy-engine rate per GPU for any number of peers: the measured 2-GPU
    rate (one peer on all 18 links: already the per-GPU aggregate), at most NV18."""
    return min(measured_gibps, nvlink_gibps())


def nic_gibps(line_gibps: float) -> float:
    """What one transfer reaches of a NIC of ``line_gibps`` (:data:`NIC_EFFICIENCY`)."""
    return line_gibps * NIC_EFFICIENCY


def ring_latency_ms(lay: Layout) -> float:
    """NCCL's modeled latency of one ring all-gather / reduce-scatter (0 at one rank)."""
    if lay.world <= 1:
        return 0.0
    net_steps = lay.nodes - 1
    nvl_steps = lay.world - 1 - net_steps
    return (NCCL_BASE_US + nvl_steps * NVLINK_STEP_US + net_steps * NET_STEP_US) / 1e3


def ring_gibps(lay: Layout, measured_gibps: float, nic: float) -> float:
    """Per-GPU rate of NCCL's ring: within a node the measured channels' rate; across
    nodes ``L x`` what a transfer reaches of one NIC (``nic``: :func:`nic_gibps`)."""
    return measured_gibps if lay.nodes == 1 else lay.local * nic


def ring_ms(shard_bytes: float, lay: Layout, measured_gibps: float, nic: float) -> float:
    """NCCL ring all-gather / reduce-scatter: ``(W-1) * shard`` bytes per rank at
    :func:`ring_gibps`; plus NCCL's latency."""
    bw = ring_gibps(lay, measured_gibps, nic)
    return ring_latency_ms(lay) + 1e3 * (lay.world - 1) * shard_bytes / (bw * GIB)


def message_ms(nbytes: float, gibps: float, steps: int, step_us: float) -> float:
    """``steps`` messages of ``nbytes`` in all at ``gibps``: alpha per step + beta."""
    if nbytes <= 0 and steps <= 0:
        return 0.0
    return steps * step_us / 1e3 + 1e3 * nbytes / (gibps * GIB)
