"""The step model: one training step of a comm mode as ops on streams (the engine's
:class:`Op`), from the FSDP groups, the inputs and the cluster.

Per group, in FSDP2's order: the forward all-gather issued as the previous group's
forward starts (prefetch one ahead, FSDP2's run-ahead), the group's forward after its
all-gather; the backward re-gather of groups resharded after forward, issued as the next
group's backward starts; each group's reduce-scatter after its backward; the optimizer
and grad-norm clip after the last reduce-scatter; the trainer's per-step host time last.

Streams: ``compute``; ``nccl`` (fsdp2 and symm_mem all-gathers and every NCCL
reduce-scatter: one NCCL communicator serializes them); ``ce`` (TIDE-AG: cross-node
phase, then node-local copy-engine phase; with ``slot_reuse`` also TIDE-RS's node-local
phase and its accumulate kernels, as ``on_tide_stream`` runs them); ``rs_local`` (that
phase without slot reuse) and ``rs_net`` (TIDE-RS's cross-node partials and their
accumulate kernels, at most ``[tide] rs_inflight`` partials in flight). fsdp2 /
symm_mem / tide_ag put their layout copies on the compute stream: the AG copy-out before
each gather's compute, chunk_cat after each backward, the AG copy-in ahead of each
gather on its stream.

Both directions of interference, by transport and as measured (inputs.interference):
compute slows beside each mode's all-gather / reduce-scatter and beside NCCL
point-to-point cross-node phases (fsdp2's all-gather figure: NCCL data-movement
kernels); collectives slow beside compute. TIDE-RS's accumulate kernels hold SMs (kind
``sm``): compute loses their share while they run. Zero-SM cross-node phases (kind
``net0``: the one-sided option) slow no compute and are slowed by compute as the one
measured zero-SM transport, TIDE-AG's copy engine, is. symm_mem's hierarchical
collectives (NCCL >= 2.30.7) run their two phases pipelined inside one collective: the
longer phase (an upper bound on the baseline), with symm_mem's measured figures (its
all-gather: the zero-CTA copy engine); TIDE-AG's phases run back to back, as the code does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchtitan_tide.comm.memory_plan import GroupShape, group_shard_numel
from torchtitan_tide.comm.options import RS_WIRE_ITEMSIZE
from torchtitan_tide.simulator.cluster import GIB, Cluster
from torchtitan_tide.simulator.engine import COMPUTE, SM, Op, Span, simulate, summarize
from torchtitan_tide.simulator.inputs import (
    MODES,
    RESULTS,
    GroupCompute,
    Inputs,
    SimulateError,
    build_inputs,
)

CROSS_NODE = ("p2p", "one_sided")
NET, NET_ZERO_SM = "net", "net0"  # cross-node phases: NCCL kernels / no SMs


@dataclass(frozen=True)
class Layout:
    """``W`` ranks as ``N`` nodes of ``L`` (the FSDP group's ranks of one node)."""

    world: int
    local: int

    @property
    def nodes(self) -> int:
        return self.world // self.local


@dataclass(frozen=True)
class TideModel:
    """How the model runs TIDE: ``[tide]`` keys of the config and two options of the
    cross-node issue. ``rs_wire_bytes``: bytes per element of TIDE-RS's cross-node
    partials (4: fp32; 2: bf16 partials); ``cross_node``: ``p2p`` (NCCL point-to-point:
    send/recv kernels on SMs) or ``one_sided`` (``[tide] cross_node_transport =
    "nccl_one_sided"``: puts through the copy engine / NCCL's RMA proxy, 0 kernels, the
    same bytes (bench_cross_node); TIDE-RS phase 2 always, TIDE-AG only for groups with
    one rank per node, as the code builds it). Both are modeled at scale, not measured."""

    rs_inflight: int = 2
    rs_rows: int = 2
    on_tide_stream: bool = True
    rs_wire_bytes: int = 4
    cross_node: str = "p2p"

    def __post_init__(self) -> None:
        if self.cross_node not in CROSS_NODE:
            raise SimulateError(f"cross_node {self.cross_node!r}: choose from {CROSS_NODE}")
        if self.rs_wire_bytes not in (2, 4):
            raise SimulateError(f"rs_wire_bytes {self.rs_wire_bytes}: 2 (bf16) or 4 (fp32)")


def tide_model_of(
    tide: Any, rs_wire_bytes: int | None = None, cross_node: str | None = None
) -> TideModel:
    """The :class:`TideModel` of a config's validated ``[tide]`` section: the node-local
    RS phase runs on TIDE-AG's stream under ``slot_reuse`` (the copy engine is the
    node-local transport of a node's GPUs); ``rs_wire_bytes`` (None: the config's
    ``rs_wire_dtype``); ``cross_node`` (None: the config's ``cross_node_transport``, where
    ``nccl_one_sided`` is ``one_sided`` and ``auto`` is ``p2p``: one-sided needs host RMA
    the simulator cannot see)."""
    if rs_wire_bytes is None:
        rs_wire_bytes = RS_WIRE_ITEMSIZE[getattr(tide, "rs_wire_dtype", "float32")]
    if cross_node is None:
        chosen = getattr(tide, "cross_node_transport", "p2p")
        cross_node = "one_sided" if chosen == "nccl_one_sided" else "p2p"
    return TideModel(
        rs_inflight=int(tide.rs_inflight),
        rs_rows=int(tide.rs_rows),
        on_tide_stream=bool(tide.slot_reuse),
        rs_wire_bytes=rs_wire_bytes,
        cross_node=cross_node,
    )


def stock_ms(shard_bytes: float, lay: Layout, bus_gibps: float, net_gibps: float) -> float:
    """NCCL ring: ``(W-1) * shard`` bytes per rank at the bus bandwidth; across nodes at
    most ``L * net`` (each ring crosses the network once per node, on its own NIC)."""
    bw = bus_gibps if lay.nodes == 1 else min(bus_gibps, lay.local * net_gibps)
    return 1e3 * (lay.world - 1) * shard_bytes / (bw * GIB)


def hierarchical_ms(
    shard_bytes: float, lay: Layout, local_gibps: float, net_gibps: float
) -> tuple[float, float]:
    """(cross-node, node-local) ms of a hierarchical gather: ``(N-1) * shard`` over the
    network, then ``(L-1) * N * shard`` over NVLink."""
    cross = 1e3 * (lay.nodes - 1) * shard_bytes / (net_gibps * GIB)
    local = 1e3 * (lay.local - 1) * lay.nodes * shard_bytes / (local_gibps * GIB)
    return cross, local


def accumulate_bytes(shard: int, lay: Layout, tide: TideModel, grad_bytes: int) -> tuple[int, int]:
    """(phase 1, phase 2) bytes read + written by TIDE-RS's accumulate kernels for one
    group and rank (``plan.rs_schedule``): phase 1 sums, for each of the N chunks, the L
    bf16 rows in windows of ``rs_rows`` into fp32 (each window after the first reads the
    fp32 target again); phase 2 adds each of the N-1 received partials (wire dtype) into
    the fp32 output (read and write)."""
    windows = math.ceil(lay.local / min(tide.rs_rows, lay.local))
    per_chunk = lay.local * grad_bytes + 4 * windows + 4 * (windows - 1)
    return lay.nodes * shard * per_chunk, (lay.nodes - 1) * shard * (tide.rs_wire_bytes + 8)


@dataclass(frozen=True)
class ModeFigures:
    """What one mode's ops run at: ``bw`` (GiB/s per phase ``ag``/``rs``), ``gemm``
    (compute slowdown fraction beside each comm kind), ``comm`` (collective slowdown
    fraction beside compute, per ``ag``/``rs``/``net``/``net0``), ``layout_ns``; ``note``: how
    the figures were chosen (symm_mem's NCCL generation)."""

    bw: dict[str, float]
    gemm: dict[str, float]
    comm: dict[str, float]
    layout_ns: dict[str, float]
    note: str = ""


def mode_figures(inputs: Inputs, mode: str, cluster: Cluster) -> ModeFigures:
    """The figures of ``mode`` on ``cluster``. NCCL point-to-point cross-node phases
    (kind ``net``) take fsdp2's all-gather figures in both directions (NCCL data-movement
    kernels); zero-SM cross-node phases (kind ``net0``) slow no compute and are slowed
    by compute as the one measured zero-SM transport is (TIDE-AG's copy engine).
    symm_mem on NCCL >= 2.30.7 (``cluster.hierarchical_rs``): the optimized symmetric
    reduce-scatter at the ring kernel's measured bandwidth with the better of the
    measured symmetric / ring interference (a modeled upper bound on the baseline: the
    release notes give no figures)."""
    bw = dict(inputs.bandwidth_gibps.get(mode, {}))
    gemm = dict(inputs.interference.get(mode, {}))
    comm = dict(inputs.comm_slowdown.get(mode, {}))
    stock_gemm = inputs.interference.get("fsdp2", {})
    stock_comm = inputs.comm_slowdown.get("fsdp2", {})
    gemm[NET] = stock_gemm.get("ag", 0.0)
    comm[NET] = stock_comm.get("ag", 0.0)
    comm[NET_ZERO_SM] = inputs.comm_slowdown.get("tide", {}).get("ag", 0.0)  # copy engine
    note = ""
    if mode == "symm_mem" and cluster.hierarchical_rs:
        bw["rs"] = inputs.bandwidth_gibps["fsdp2"]["rs"]
        gemm["rs"] = min(gemm.get("rs", 0.0), stock_gemm.get("rs", 0.0))
        comm["rs"] = min(comm.get("rs", 0.0), stock_comm.get("rs", 0.0))
        note = f"NCCL {cluster.nccl_version}: hierarchical symmetric RS at the ring's bandwidth"
    return ModeFigures(bw, gemm, comm, dict(inputs.layout_ns.get(mode, {})), note)


def build_ops(
    groups: Sequence[GroupShape],
    inputs: Inputs,
    mode: str,
    lay: Layout,
    cluster: Cluster,
    dtypes: Any,
    tide: TideModel = TideModel(),
) -> list[Op]:
    """The ops of one step of ``mode`` (see the module docstring), in issue order."""
    if mode not in MODES:
        raise SimulateError(f"mode {mode!r}: choose from {MODES}")
    comm = lay.world > 1
    fig = mode_figures(inputs, mode, cluster)
    net = cluster.net_gibps
    names = [g.name for g in groups]
    ops: list[Op] = []
    comp = {g.name: inputs.compute.get(g.name, GroupCompute(0.0, 0.0)) for g in groups}
    zero_sm_net = NET_ZERO_SM if tide.cross_node == "one_sided" else NET
    # one-sided TIDE-AG only with one rank per node (docs/2026-12-02-one-sided.md)
    ag_net = zero_sm_net if lay.local == 1 else NET

    def add(name, stream, ms, kind, after=(), issued_with=(), group=""):
        if stream == COMPUTE:
            slow = fig.gemm if kind == "compute" else {}
        elif kind in ("ag", "rs", NET, NET_ZERO_SM):
            slow = {"compute": fig.comm.get(kind, 0.0)}
        else:  # the accumulate kernels: their SM share is charged to compute instead
            slow = {}
        share = inputs.accumulate_sm_share if kind == SM else 0.0
        ops.append(Op(name, stream, max(0.0, ms), kind, tuple(after), tuple(issued_with),
                      slow, group, share))  # fmt: skip
        return name

    def gather(g: GroupShape, tag: str, issued_with: Sequence[str]) -> str | None:
        """The all-gather of ``g`` (its copy-in on the gather's stream, ahead of it);
        returns the op its consumer waits for."""
        if not comm:
            return None
        s = group_shard_numel(g, lay.world)
        b = s * dtypes.param_bytes
        copy_in = fig.layout_ns.get("copy_in", 0.0) * s / 1e6
        name = f"{g.name}.{tag}.ag"
        symm_hier = mode == "symm_mem" and cluster.hierarchical_ag and lay.nodes > 1
        if not (mode in ("tide", "tide_ag") or symm_hier):
            ms = copy_in + stock_ms(b, lay, fig.bw["ag"], net)
            return add(name, "nccl", ms, "ag", issued_with=issued_with, group=g.name)
        cross, local = hierarchical_ms(b, lay, fig.bw["ag"], net)
        if symm_hier:  # NCCL's phases pipelined inside one collective (an upper bound)
            return add(name, "nccl", copy_in + max(cross, local), "ag", issued_with=issued_with,
                       group=g.name)  # fmt: skip
        if not cross:
            return add(name, "ce", copy_in + local, "ag", issued_with=issued_with, group=g.name)
        add(f"{name}_net", "ce", copy_in + cross, ag_net, issued_with=issued_with,
            group=g.name)  # fmt: skip
        return add(name, "ce", local, "ag", after=[f"{name}_net"], group=g.name)

    def consume(g: GroupShape, ag: str | None, tag: str) -> list[str]:
        """What ``g``'s compute waits for: its all-gather, then the copy-out on the
        compute stream (queued at the consumer's pre-forward / pre-backward)."""
        if ag is None:
            return []
        copy_out = fig.layout_ns.get("copy_out", 0.0) * g.numel / 1e6
        if not copy_out:
            return [ag]
        return [
            add(f"{g.name}.{tag}.copy_out", COMPUTE, copy_out, "layout", after=[ag], group=g.name)
        ]

    def reduce_stock(g: GroupShape, src: str) -> str:
        """NCCL's reduce-scatter on the communicator's stream: the ring, or symm_mem's
        hierarchical symmetric kernel on NCCL >= 2.30.7 (node-local and cross-node phases
        pipelined inside the collective: the longer phase, an upper bound)."""
        s = group_shard_numel(g, lay.world)
        b = s * dtypes.reduce_bytes
        if not (mode == "symm_mem" and cluster.hierarchical_rs and lay.nodes > 1):
            return add(f"{g.name}.rs", "nccl", stock_ms(b, lay, fig.bw["rs"], net), "rs",
                       after=[src], group=g.name)  # fmt: skip
        cross, local = hierarchical_ms(b, lay, fig.bw["rs"], net)
        return add(f"{g.name}.rs", "nccl", max(cross, local), "rs", after=[src], group=g.name)

    # forward: group i+1's all-gather is issued as group i's forward starts
    pending = {groups[0].name: gather(groups[0], "fwd", [])}
    for i, g in enumerate(groups):
        after = consume(g, pending[g.name], "fwd")
        fwd = add(
            f"{g.name}.fwd", COMPUTE, comp[g.name].fwd_ms, "compute", after=after, group=g.name
        )
        if i + 1 < len(groups):
            pending[names[i + 1]] = gather(groups[i + 1], "fwd", [fwd])
    add("root.fwd_rest", COMPUTE, inputs.root_fwd_ms, "compute", group="root")
    loss = add("root.bwd_rest", COMPUTE, inputs.root_bwd_ms, "compute", group="root")
    # backward, reverse order: group j-1's re-gather is issued as group j's backward
    # starts (queued on the stream before j's reduce-scatter); groups kept unsharded
    # after forward wait for their forward gather only
    order = list(reversed(groups))
    bwd_ag = {g.name: None for g in groups}
    if order[0].reshard_after_forward:
        bwd_ag[order[0].name] = gather(order[0], "bwd", [loss])
    rs_done: list[str] = []
    rs_net: list[str] = []
    local_stream = "ce" if tide.on_tide_stream else "rs_local"
    for k, g in enumerate(order):
        after = consume(g, bwd_ag[g.name], "bwd") if g.reshard_after_forward else []
        bwd = add(
            f"{g.name}.bwd", COMPUTE, comp[g.name].bwd_ms, "compute", after=after, group=g.name
        )
        if k + 1 < len(order) and order[k + 1].reshard_after_forward:
            bwd_ag[order[k + 1].name] = gather(order[k + 1], "bwd", [bwd])
        if not comm:
            continue
        s = group_shard_numel(g, lay.world)
        chunk = fig.layout_ns.get("chunk_cat", 0.0) * g.numel / 1e6
        src = (
            add(f"{g.name}.chunk_cat", COMPUTE, chunk, "layout", after=[bwd], group=g.name)
            if chunk
            else bwd
        )
        if mode != "tide":
            rs_done.append(reduce_stock(g, src))
            continue
        # TIDE-RS: phase 1 (copies, then the accumulate kernels the stream waits for),
        # phase 2 (partials over the network, then their accumulate kernels)
        acc1, acc2 = accumulate_bytes(s, lay, tide, dtypes.grad)
        window = [rs_net[-tide.rs_inflight]] if len(rs_net) >= tide.rs_inflight else []
        local_ms = 1e3 * (lay.local - 1) * lay.nodes * s * dtypes.grad / (fig.bw["rs"] * GIB)
        add(f"{g.name}.rs", local_stream, local_ms, "rs", after=[src, *window], group=g.name)
        local = add(f"{g.name}.rs_acc", local_stream, _acc_ms(acc1, inputs), SM, group=g.name)
        if lay.nodes == 1:
            rs_done.append(local)
            continue
        cross = 1e3 * (lay.nodes - 1) * s * tide.rs_wire_bytes / (net * GIB)
        add(f"{g.name}.rs_net", "rs_net", cross, zero_sm_net, after=[local], group=g.name)
        rs_net.append(add(f"{g.name}.rs_net_acc", "rs_net", _acc_ms(acc2, inputs), SM,
                          group=g.name))  # fmt: skip
        rs_done.append(rs_net[-1])
    shard = sum(group_shard_numel(g, lay.world) if comm else g.numel for g in groups)
    add(
        "optimizer", COMPUTE, inputs.optimizer_ms_per_shard_elem * shard, "optimizer", after=rs_done
    )
    add("host", COMPUTE, inputs.host_ms, "host")
    return ops


def _acc_ms(nbytes: float, inputs: Inputs) -> float:
    return 1e3 * nbytes / (inputs.accumulate_gibps * GIB) if inputs.accumulate_gibps else 0.0


def simulate_step(
    groups, inputs, mode, lay, cluster, dtypes, tide: TideModel = TideModel()
) -> tuple[dict, list[Span]]:
    """(summary figures, spans) of one simulated step."""
    spans = simulate(build_ops(groups, inputs, mode, lay, cluster, dtypes, tide))
    return summarize(spans), spans


def layout_for(cm: Any, gpus: int, cluster: Cluster) -> Layout:
    """FSDP shard degree and ranks per node of ``gpus`` (``fsdp_groups.world_for``)."""
    if gpus == 1:
        return Layout(1, 1)
    from torchtitan_tide.fsdp_groups import FsdpGroupsError, world_for

    try:
        world = world_for(cm.table, gpus, cluster.gpus_per_node, where=cm.path.name)
    except FsdpGroupsError as exc:
        raise SimulateError(str(exc)) from None
    return Layout(world.shard_degree, world.local)


def simulate_config(
    config: str,
    gpus: int,
    modes: Sequence[str],
    cluster: Cluster,
    results_dir=RESULTS,
    trace: str | None = None,
    mfu: float = 0.4,
    cm: Any = None,
    inputs: Inputs | None = None,
    rs_wire_bytes: int | None = None,
    cross_node: str | None = None,
) -> dict[str, Any]:
    """Rows (one per mode), spans per mode, the inputs and the config model of ``config``
    at ``gpus``. Each row carries what the report needs: the cluster's NCCL, the TIDE
    options and every input's source (``sources``)."""
    from torchtitan_tide.fsdp_groups import load_config_model

    cm = cm or load_config_model(config)
    inputs = inputs or build_inputs(cm, results_dir, trace, mfu, world1=gpus == 1)
    lay = layout_for(cm, gpus, cluster)
    tide = tide_model_of(cm.tide, rs_wire_bytes, cross_node)
    rows, spans = [], {}
    for mode in modes:
        fig, sp = simulate_step(cm.groups, inputs, mode, lay, cluster, cm.dtypes, tide)
        note = mode_figures(inputs, mode, cluster).note
        rows.append({"config": cm.path.stem, "gpus": gpus, "nodes": lay.nodes, "mode": mode,
                     "nccl": cluster.nccl_version, "rs_wire_bytes": tide.rs_wire_bytes,
                     "cross_node": tide.cross_node, "mode_note": note,
                     **{f"sim_{k}": v for k, v in fig.items()}})  # fmt: skip
        spans[mode] = sp
    base = next((r for r in rows if r["mode"] == "fsdp2"), None)
    for row in rows:
        if base:
            row["sim_speedup_vs_fsdp2"] = base["sim_step_ms"] / row["sim_step_ms"]
    return {"rows": rows, "spans": spans, "inputs": inputs, "cm": cm, "sources": inputs.sources,
            "rs_wire_bytes": tide.rs_wire_bytes}  # fmt: skip
