"""Links of the simulated cluster: alpha-beta per message, the per-node NIC cap, NCCL's
ring channels and NVLink (NV18) between the GPUs of a node.

Every figure here is a named physical or library figure, printed with its source
(:data:`SOURCES`); the measured rates come from ``inputs`` (2x H200).

- NVLink: an H200 has 18 NVLink-4 links (``NV18``) of 26.5625 GB/s per direction each:
  478 GB/s per direction per GPU, shared by the 7 peers of an 8-GPU node (NVSwitch). On
  the measured 2x H200 machine the one peer had all 18 links, so a node-local rate
  measured there is already an aggregate per GPU; at L ranks per node it is taken as the
  aggregate over the L-1 peers, capped by NV18.
- NIC: one NIC per GPU at the cluster file's rate (``nic_gbps_per_gpu``). A ring across
  nodes crosses the network once per node on each of its channels' NICs, so it runs at
  most ``L x NIC`` per GPU (NCCL spreads its channels over the node's NICs); TIDE's
  cross-node moves go rail to rail, one NIC per GPU.
- NCCL channels: the ring kernel measured at 2 ranks ran 24 CTAs (24 channels); NCCL
  keeps that channel count across nodes (its ring graph is the NVLink one), so the
  measured rate is the channels' rate and binds wherever it is below ``L x NIC``.
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

SOURCES = {
    "nvlink": (
        f"NV18: 18 NVLink-4 links x 26.5625 GB/s per direction = {NV18_GBPS:.0f} GB/s "
        f"({NV18_GBPS * 1e9 / GIB:.0f} GiB/s) per direction per GPU, shared by the node's "
        "peers (NVIDIA H200 SXM; nvidia-smi topo shows NV18 on the measured machine, "
        "docs/design/2026-11-29-h200-facts.md)"
    ),
    "nic": "the cluster file's nic_gbps_per_gpu (one NIC per GPU; a ring: L x NIC per GPU)",
    "latency": (
        f"NCCL's tuning model (src/graph/tuning.cc, Ring / Simple): {NCCL_BASE_US} us per "
        f"collective + {NVLINK_STEP_US} us per NVLink step + {NET_STEP_US} us per network "
        "step; one step per TIDE message"
    ),
    "channels": (
        f"NCCL's ring ran {NCCL_RING_CHANNELS} CTAs (channels) at 2 ranks "
        "(bench_collectives profile); the measured ring rate is that of its channels and "
        "binds where it is below L x NIC"
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


def ring_latency_ms(lay: Layout) -> float:
    """NCCL's modeled latency of one ring all-gather / reduce-scatter (0 at one rank)."""
    if lay.world <= 1:
        return 0.0
    net_steps = lay.nodes - 1
    nvl_steps = lay.world - 1 - net_steps
    return (NCCL_BASE_US + nvl_steps * NVLINK_STEP_US + net_steps * NET_STEP_US) / 1e3


def ring_ms(shard_bytes: float, lay: Layout, ring_gibps: float, nic_gibps: float) -> float:
    """NCCL ring all-gather / reduce-scatter: ``(W-1) * shard`` bytes per rank at the
    measured channels' rate, across nodes at most ``L * NIC``; plus NCCL's latency."""
    bw = ring_gibps if lay.nodes == 1 else min(ring_gibps, lay.local * nic_gibps)
    return ring_latency_ms(lay) + 1e3 * (lay.world - 1) * shard_bytes / (bw * GIB)


def message_ms(nbytes: float, gibps: float, steps: int, step_us: float) -> float:
    """``steps`` messages of ``nbytes`` in all at ``gibps``: alpha per step + beta."""
    if nbytes <= 0 and steps <= 0:
        return 0.0
    return steps * step_us / 1e3 + 1e3 * nbytes / (gibps * GIB)


def cross_node_steps(nodes: int) -> int:
    """Steps of TIDE's cross-node all-gather (``plan.cross_node_exchanges``): recursive
    doubling (log2 N) for a power of two, else N-1 direct steps."""
    if nodes <= 1:
        return 0
    if nodes & (nodes - 1) == 0:
        return nodes.bit_length() - 1
    return nodes - 1


def ag_waves(nodes: int, pacing: int) -> list[int]:
    """Entries (node shards) arriving per wave of TIDE-AG's cross-node phase: recursive
    doubling step k brings 2^k entries (direct exchange: 1 per step), split in waves of
    at most ``pacing`` entries (0: one wave per step)."""
    if nodes <= 1:
        return []
    if nodes & (nodes - 1) == 0:
        per_step = [2**k for k in range(nodes.bit_length() - 1)]
    else:
        per_step = [1] * (nodes - 1)
    waves = []
    for entries in per_step:
        if pacing <= 0:
            waves.append(entries)
        else:
            waves += [min(pacing, entries - i) for i in range(0, entries, pacing)]
    return waves
