"""The step model: one training step of a comm mode as ops on streams (the engine's
:class:`Op`), from the FSDP groups, the inputs and the cluster.

Per group, in FSDP2's order: the forward all-gather issued as the previous group's
forward starts (prefetch one ahead, FSDP2's run-ahead), the group's forward after its
all-gather; the backward re-gather of groups resharded after forward, issued as the next
group's backward starts; each group's reduce-scatter after its backward; the optimizer
and grad-norm clip after the last reduce-scatter; the trainer's per-step host time last.

Every mode is charged the same way: each part of a collective once, at the rate of its
own engine measured alone (``inputs.transport_gibps``, ``sm_ns``, ``layout_ns``), slowed
and slowing compute as measured for its engine (``inputs.engines``, op kinds of
``interference.ENGINES``): the fp32 -> bf16 cast of every all-gather and FSDP2's copy-in
(``sm_ag``, on FSDP2's copy-in stream ``ag_in``, or TIDE's stream), NCCL's kernels
(``nccl`` / ``nccl_symk`` on the communicator's stream ``nccl``), the copy engine
(``ce``), one-sided puts across nodes (``nic``), TIDE-RS's accumulate kernels
(``sm_rs``). FSDP2's copy-out and chunk_cat run on the compute stream (layout).

TIDE runs the schedule of ``torchtitan_tide.comm.schedule`` (``TideModel.schedule``,
default: the one the code runs, ``schedule.CURRENT``, read at each call): serial (pack,
cross-node, node-local, placement one after the other on TIDE's stream ``tide``) or
pipelined (puts in waves on ``tide_put``, each wave's fan-out and placement on ``tide``
overlapping the next wave's puts). TIDE-RS phase 1 runs on ``tide`` under ``slot_reuse`` (else ``rs_local``), phase 2
on ``rs_net``, at most ``[tide] rs_inflight`` partials ahead. symm_mem's hierarchical
collectives (NCCL >= 2.30.7) run their two phases pipelined inside one collective: the
longer phase (an upper bound on the baseline). Links: ``network`` (alpha-beta, NIC cap,
NV18).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torchtitan_tide.comm import schedule as tide_schedule
from torchtitan_tide.comm.memory_plan import GroupShape, group_shard_numel
from torchtitan_tide.comm.options import RS_WIRE_ITEMSIZE
from torchtitan_tide.comm.schedule import TideSchedule
from torchtitan_tide.simulator.cluster import GIB, Cluster
from torchtitan_tide.simulator.engine import (
    COMPUTE,
    Op,
    Span,
    idle_and_comm,
    intersect_length,
    simulate,
    summarize,
)
from torchtitan_tide.simulator.inputs import (
    MODES,
    RESULTS,
    GroupCompute,
    Inputs,
    SimulateError,
    Workload,
    build_inputs,
)
from torchtitan_tide.simulator.interference import CE, NCCL, NCCL_SYMK, NIC, SM_AG, SM_RS
from torchtitan_tide.simulator.network import (
    NET_STEP_US,
    NVLINK_STEP_US,
    Layout,
    ag_waves,
    cross_node_steps,
    message_ms,
    node_local_gibps,
    ring_ms,
)

__all__ = ["Layout", "TideModel", "build_ops", "simulate_config", "simulate_step"]

CROSS_NODE = ("p2p", "one_sided")
SM_AG_PATH = {"fsdp2": f"{SM_AG}:fsdp2", "symm_mem": f"{SM_AG}:symm_mem"}


@dataclass(frozen=True)
class TideModel:
    """How the model runs TIDE: ``[tide]`` keys of the config, the cross-node options and
    the schedule. ``rs_wire_bytes``: bytes per element of TIDE-RS's cross-node partials
    (4: fp32; 2: bf16); ``cross_node``: ``p2p`` (NCCL send/recv kernels on SMs) or
    ``one_sided`` (``[tide] cross_node_transport = "nccl_one_sided"``: puts, no SM;
    TIDE-AG takes it for the layouts ``schedule`` says); ``ag_pacing``: entries per wave
    of the pipelined schedule's puts (0: one wave per step). Modeled at scale, not
    measured."""

    rs_inflight: int = 2
    rs_rows: int = 2
    on_tide_stream: bool = True
    rs_wire_bytes: int = 4
    cross_node: str = "p2p"
    ag_pacing: int = 0
    schedule: TideSchedule = field(default_factory=lambda: tide_schedule.CURRENT)

    def __post_init__(self) -> None:
        if self.cross_node not in CROSS_NODE:
            raise SimulateError(f"cross_node {self.cross_node!r}: choose from {CROSS_NODE}")
        if self.rs_wire_bytes not in (2, 4):
            raise SimulateError(f"rs_wire_bytes {self.rs_wire_bytes}: 2 (bf16) or 4 (fp32)")


def tide_model_of(
    tide: Any,
    rs_wire_bytes: int | None = None,
    cross_node: str | None = None,
    schedule: TideSchedule | None = None,
) -> TideModel:
    """The :class:`TideModel` of a config's validated ``[tide]`` section: the node-local
    RS phase runs on TIDE-AG's stream under ``slot_reuse``; ``rs_wire_bytes`` (None: the
    config's ``rs_wire_dtype``); ``cross_node`` (None: the config's
    ``cross_node_transport``, where ``nccl_one_sided`` is ``one_sided`` and ``auto`` is
    ``p2p``: one-sided needs host RMA the simulator cannot see); ``schedule`` (None: the
    one the code runs)."""
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
        ag_pacing=int(getattr(tide, "ag_pacing", 0)),
        schedule=schedule or tide_schedule.CURRENT,
    )


def accumulate_bytes(shard: int, lay: Layout, tide: TideModel, grad_bytes: int) -> tuple[int, int]:
    """(phase 1, phase 2) bytes read + written by TIDE-RS's accumulate kernels for one
    group and rank (``plan.rs_schedule``): phase 1 sums, for each of the N chunks, the L
    bf16 rows in windows of ``rs_rows`` into fp32 (each window after the first reads the
    fp32 target again); phase 2 adds each of the N-1 received partials (wire dtype) into
    the fp32 output (read and write)."""
    windows = math.ceil(lay.local / min(tide.rs_rows, lay.local))
    per_chunk = lay.local * grad_bytes + 4 * windows + 4 * (windows - 1)
    return lay.nodes * shard * per_chunk, (lay.nodes - 1) * shard * (tide.rs_wire_bytes + 8)


def _gib_ms(nbytes: float, gibps: float) -> float:
    return 1e3 * nbytes / (gibps * GIB) if nbytes > 0 and gibps > 0 else 0.0


class _Builder:
    """The ops of one step of one mode, added in issue order."""

    def __init__(self, inputs: Inputs, mode: str, lay: Layout, cluster: Cluster, dtypes: Any,
                 tide: TideModel) -> None:  # fmt: skip
        self.inputs, self.mode, self.lay, self.cluster = inputs, mode, lay, cluster
        self.dtypes, self.tide = dtypes, tide
        self.net = cluster.net_gibps
        self.rate = inputs.transport_gibps.get(mode, {})
        self.ops: list[Op] = []
        self.compute_slow = {e: f for e, (f, _) in inputs.engines.items() if ":" not in e}

    def add(self, name, stream, ms, kind, after=(), issued_with=(), group="", stretch=None):
        """One op; compute ops slow beside every engine, an engine's op beside compute."""
        if stream == COMPUTE:
            slow = self.compute_slow if kind == "compute" else {}
        else:
            g = self.inputs.engines.get(kind, (0.0, 0.0))[1] if stretch is None else stretch
            slow = {"compute": g}
        self.ops.append(Op(name, stream, max(0.0, ms), kind, tuple(after), tuple(issued_with),
                           slow, group))  # fmt: skip
        return name

    def sm_ag(self, name, stream, ms, issued_with, group, after=()):
        """An all-gather path's SM kernels, slowed as its own path measured."""
        key = SM_AG_PATH.get(self.mode, SM_AG)
        stretch = self.inputs.engines.get(key, self.inputs.engines.get(SM_AG, (0.0, 0.0)))[1]
        return self.add(name, stream, ms, SM_AG, after, issued_with, group, stretch)

    # ---- all-gather
    def gather(self, g: GroupShape, tag: str, issued_with: Sequence[str]) -> str:
        """The all-gather of ``g``; returns the op its consumer waits for."""
        s = group_shard_numel(g, self.lay.world)
        b = s * self.dtypes.param_bytes
        name = f"{g.name}.{tag}.ag"
        sm = self.inputs.sm_ns.get(self.mode, {})
        cast = sm.get("cast", 0.0) * s / 1e6
        if self.mode in ("tide", "tide_ag"):
            pack = self.sm_ag(f"{name}_pack", "tide", cast, issued_with, g.name)
            return self.tide_gather(name, s, b, pack, g.name)
        copy_in = self.inputs.layout_ns.get(self.mode, {}).get("copy_in", 0.0) * s / 1e6
        ready = self.sm_ag(f"{name}_in", "ag_in", cast + copy_in, issued_with, g.name)
        lay, hier = self.lay, self.cluster.hierarchical_ag
        if self.mode == "symm_mem" and lay.nodes > 1 and hier:  # NCCL >= 2.30.7
            cross = message_ms((lay.nodes - 1) * b, self.net, lay.nodes - 1, NET_STEP_US)
            local = message_ms((lay.local - 1) * lay.nodes * b,
                               node_local_gibps(self.rate["ag"]), 1, NVLINK_STEP_US)  # fmt: skip
            return self.add(name, "nccl", max(cross, local), CE, [ready], group=g.name)
        if self.mode == "symm_mem" and lay.nodes == 1:  # zero-CTA: the copy engine
            ms = message_ms((lay.world - 1) * b, node_local_gibps(self.rate["ag"]), 1,
                            NVLINK_STEP_US)  # fmt: skip
            return self.add(name, "nccl", ms, CE, [ready], group=g.name)
        ring = self.inputs.transport_gibps["fsdp2"]["ag"]  # symm_mem 2.28.9 across nodes too
        return self.add(name, "nccl", ring_ms(b, lay, ring, self.net), NCCL, [ready],
                        group=g.name)  # fmt: skip

    def cross_kind(self) -> str:
        """TIDE-AG's cross-node engine: one-sided puts (no SM) or NCCL send/recv kernels."""
        schedule, lay = self.tide.schedule, self.lay
        one_sided = self.tide.cross_node == "one_sided"
        return NIC if one_sided and (schedule.ag_one_sided_any_layout or lay.local == 1) else NCCL

    def tide_gather(self, name: str, s: int, b: float, pack: str, group: str) -> str:
        """TIDE-AG after its pack, as ``self.tide.schedule`` says."""
        lay, schedule = self.lay, self.tide.schedule
        local_gibps = node_local_gibps(self.rate["ag"])
        copy = self.inputs.copy_gibps
        if lay.nodes == 1:
            ms = message_ms((lay.local - 1) * b, local_gibps, 1, NVLINK_STEP_US)
            return self.add(name, "tide", ms, CE, [pack], group=group)
        kind = self.cross_kind()
        place = schedule.ag_place_after_one_sided and kind == NIC
        if not schedule.ag_waves_pipelined:
            steps = cross_node_steps(lay.nodes)
            cross = message_ms((lay.nodes - 1) * b, self.net, steps, NET_STEP_US)
            last = self.add(f"{name}_net", "tide", cross, kind, [pack], group=group)
            if lay.local > 1:
                ms = message_ms((lay.local - 1) * lay.nodes * b, local_gibps, 1, NVLINK_STEP_US)
                last = self.add(f"{name}_local", "tide", ms, CE, [last], group=group)
            if place:
                last = self.add(f"{name}_place", "tide", _gib_ms(lay.world * b, copy), CE,
                                [last], group=group)  # fmt: skip
            return self.add(name, "tide", 0.0, CE, [last], group=group)
        # pipelined: wave k's puts on the put stream; its fan-out and placement on TIDE's
        # stream, overlapping wave k+1's puts (the own entry goes first, no put)
        last, put = pack, pack
        for k, entries in enumerate([1, *ag_waves(lay.nodes, self.tide.ag_pacing)]):
            arrived = pack
            if k:
                put = self.add(f"{name}_put{k}", "tide_put", message_ms(
                    entries * b, self.net, 1, NET_STEP_US), kind, [put], group=group)  # fmt: skip
                arrived = put
            fan = message_ms((lay.local - 1) * entries * b, local_gibps, 1 if lay.local > 1 else 0,
                             NVLINK_STEP_US)  # fmt: skip
            last = self.add(f"{name}_fan{k}", "tide", fan, CE, [arrived, last], group=group)
            if place:
                ms = _gib_ms(lay.local * entries * b, copy)
                last = self.add(f"{name}_place{k}", "tide", ms, CE, [last], group=group)
        return self.add(name, "tide", 0.0, CE, [last], group=group)

    def consume(self, g: GroupShape, ag: str | None, tag: str) -> list[str]:
        """What ``g``'s compute waits for: its all-gather, then the copy-out on the
        compute stream (queued at the consumer's pre-forward / pre-backward)."""
        if ag is None:
            return []
        copy_out = self.inputs.layout_ns.get(self.mode, {}).get("copy_out", 0.0) * g.numel / 1e6
        if not copy_out:
            return [ag]
        return [self.add(f"{g.name}.{tag}.copy_out", COMPUTE, copy_out, "layout", [ag],
                         group=g.name)]  # fmt: skip

    # ---- reduce-scatter
    def reduce_stock(self, g: GroupShape, src: str) -> str:
        """NCCL's reduce-scatter on the communicator's stream: the ring, or symm_mem's
        symmetric kernel (one node; its divide after it), NCCL's ring across nodes on NCCL
        2.28.9, the hierarchical symmetric kernel on NCCL >= 2.30.7 (its two phases
        pipelined inside the collective: the longer, an upper bound)."""
        lay = self.lay
        s = group_shard_numel(g, lay.world)
        b = s * self.dtypes.reduce_bytes
        divide = self.inputs.sm_ns.get(self.mode, {}).get("divide", 0.0) * s / 1e6
        ring = self.inputs.transport_gibps["fsdp2"]["rs"]
        if self.mode != "symm_mem":
            ms, kind = ring_ms(b, lay, ring, self.net), NCCL
        elif lay.nodes == 1:
            ms, kind = ring_ms(b, lay, self.rate["rs"], self.net) + divide, NCCL_SYMK
        elif self.cluster.hierarchical_rs:
            cross = message_ms((lay.nodes - 1) * b, self.net, lay.nodes - 1, NET_STEP_US)
            local = message_ms((lay.local - 1) * lay.nodes * b, ring, 1, NVLINK_STEP_US)
            ms, kind = max(cross, local) + divide, NCCL_SYMK
        else:
            ms, kind = ring_ms(b, lay, ring, self.net) + divide, NCCL
        return self.add(f"{g.name}.rs", "nccl", ms, kind, [src], group=g.name)

    def reduce_tide(self, g: GroupShape, src: str, rs_net: list[str]) -> str:
        """TIDE-RS: phase 1 ([pack,] pushes, then the accumulate kernels the stream
        waits for), phase 2 (partials over the network, then their accumulate kernels)."""
        lay, tide = self.lay, self.tide
        s = group_shard_numel(g, lay.world)
        stream = "tide" if tide.on_tide_stream else "rs_local"
        acc1, acc2 = accumulate_bytes(s, lay, tide, self.dtypes.grad)
        window = [rs_net[-tide.rs_inflight]] if len(rs_net) >= tide.rs_inflight else []
        sent = (lay.local - 1) * lay.nodes * s * self.dtypes.grad
        after = [src, *window]
        if tide.schedule.rs_pack and sent:
            after = [self.add(f"{g.name}.rs_pack", stream, _gib_ms(sent, self.inputs.copy_gibps),
                              CE, after, group=g.name)]  # fmt: skip
        push = message_ms(sent, node_local_gibps(self.rate["rs"]), 1 if sent else 0,
                          NVLINK_STEP_US)  # fmt: skip
        self.add(f"{g.name}.rs", stream, push, CE, after, group=g.name)
        local = self.add(f"{g.name}.rs_acc", stream, self.accumulate_ms(acc1), SM_RS, group=g.name)
        if lay.nodes == 1:
            return local
        kind = NIC if tide.cross_node == "one_sided" else NCCL
        cross = message_ms((lay.nodes - 1) * s * tide.rs_wire_bytes, self.net, lay.nodes - 1,
                           NET_STEP_US)  # fmt: skip
        self.add(f"{g.name}.rs_net", "rs_net", cross, kind, [local], group=g.name)
        rs_net.append(self.add(f"{g.name}.rs_net_acc", "rs_net", self.accumulate_ms(acc2), SM_RS,
                               group=g.name))  # fmt: skip
        return rs_net[-1]

    def accumulate_ms(self, nbytes: float) -> float:
        return _gib_ms(nbytes, self.inputs.accumulate_gibps)


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
    bld = _Builder(inputs, mode, lay, cluster, dtypes, tide)
    names = [g.name for g in groups]
    comp = {g.name: inputs.compute.get(g.name, GroupCompute(0.0, 0.0)) for g in groups}

    def gather(g: GroupShape, tag: str, issued_with: Sequence[str]) -> str | None:
        return bld.gather(g, tag, issued_with) if comm else None

    # forward: group i+1's all-gather is issued as group i's forward starts
    pending = {groups[0].name: gather(groups[0], "fwd", [])}
    for i, g in enumerate(groups):
        after = bld.consume(g, pending[g.name], "fwd")
        fwd = bld.add(f"{g.name}.fwd", COMPUTE, comp[g.name].fwd_ms, "compute", after,
                      group=g.name)  # fmt: skip
        if i + 1 < len(groups):
            pending[names[i + 1]] = gather(groups[i + 1], "fwd", [fwd])
    bld.add("root.fwd_rest", COMPUTE, inputs.root_fwd_ms, "compute", group="root")
    loss = bld.add("root.bwd_rest", COMPUTE, inputs.root_bwd_ms, "compute", group="root")
    # backward, reverse order: group j-1's re-gather is issued as group j's backward
    # starts (queued on the stream before j's reduce-scatter); groups kept unsharded
    # after forward wait for their forward gather only
    order = list(reversed(groups))
    bwd_ag: dict[str, str | None] = {g.name: None for g in groups}
    if order[0].reshard_after_forward:
        bwd_ag[order[0].name] = gather(order[0], "bwd", [loss])
    rs_done: list[str] = []
    rs_net: list[str] = []
    for k, g in enumerate(order):
        after = bld.consume(g, bwd_ag[g.name], "bwd") if g.reshard_after_forward else []
        bwd = bld.add(f"{g.name}.bwd", COMPUTE, comp[g.name].bwd_ms, "compute", after,
                      group=g.name)  # fmt: skip
        if k + 1 < len(order) and order[k + 1].reshard_after_forward:
            bwd_ag[order[k + 1].name] = gather(order[k + 1], "bwd", [bwd])
        if not comm:
            continue
        chunk = inputs.layout_ns.get(mode, {}).get("chunk_cat", 0.0) * g.numel / 1e6
        src = bld.add(f"{g.name}.chunk_cat", COMPUTE, chunk, "layout", [bwd], group=g.name) \
            if chunk else bwd  # fmt: skip
        if mode == "tide":
            rs_done.append(bld.reduce_tide(g, src, rs_net))
        else:
            rs_done.append(bld.reduce_stock(g, src))
    shard = sum(group_shard_numel(g, lay.world) if comm else g.numel for g in groups)
    bld.add("optimizer", COMPUTE, inputs.optimizer_ms_per_shard_elem * shard, "optimizer",
            rs_done)  # fmt: skip
    bld.add("host", COMPUTE, inputs.host_ms, "host")
    return bld.ops


def breakdown(spans: Sequence[Span]) -> dict[str, float]:
    """The step split into compute (alone), SM time taken from compute, layout copies,
    optimizer, host, and communication the compute stream waited on, in the forward (up
    to the first backward op), the backward (to the last compute op) and the tail."""
    by_name = {s.op.name: s for s in spans}
    on_compute = [s for s in spans if s.op.stream == COMPUTE]
    work = [s for s in on_compute if s.op.kind == "compute"]
    backward = by_name.get("root.bwd_rest")
    bwd_start = backward.start_ms if backward else 0.0
    last = max((s.end_ms for s in work), default=0.0)
    idle, comm = idle_and_comm(spans)

    def exposed(lo: float, hi: float) -> float:
        return intersect_length([(max(a, lo), min(b, hi)) for a, b in idle if b > lo and a < hi],
                                comm)  # fmt: skip

    step = max((s.end_ms for s in spans), default=0.0)
    return {
        "bd_compute_ms": sum(s.op.duration_ms for s in work),
        "bd_sm_taken_ms": sum(s.lost_ms for s in work),
        "bd_layout_ms": sum(s.end_ms - s.start_ms for s in on_compute if s.op.kind == "layout"),
        "bd_optimizer_ms": sum(
            s.end_ms - s.start_ms for s in on_compute if s.op.kind == "optimizer"
        ),
        "bd_host_ms": sum(s.end_ms - s.start_ms for s in on_compute if s.op.kind == "host"),
        "bd_exposed_fwd_ms": exposed(0.0, bwd_start),
        "bd_exposed_bwd_ms": exposed(bwd_start, last),
        "bd_exposed_tail_ms": exposed(last, step),
    }


def simulate_step(
    groups, inputs, mode, lay, cluster, dtypes, tide: TideModel = TideModel()
) -> tuple[dict, list[Span]]:
    """(summary figures and breakdown, spans) of one simulated step."""
    spans = simulate(build_ops(groups, inputs, mode, lay, cluster, dtypes, tide))
    return {**summarize(spans), **breakdown(spans)}, spans


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
    schedule: TideSchedule | None = None,
    workload: Workload | None = None,
) -> dict[str, Any]:
    """Rows (one per mode), spans per mode, the inputs and the config model of ``config``
    at ``gpus``. Each row carries what the report needs: the cluster's NCCL, the TIDE
    options and schedule, every input's source (``sources``)."""
    from torchtitan_tide.fsdp_groups import load_config_model

    cm = cm or load_config_model(config)
    inputs = inputs or build_inputs(cm, results_dir, trace, mfu, world1=gpus == 1,
                                    workload=workload)  # fmt: skip
    lay = layout_for(cm, gpus, cluster)
    tide = tide_model_of(cm.tide, rs_wire_bytes, cross_node, schedule)
    rows, spans = [], {}
    for mode in modes:
        fig, sp = simulate_step(cm.groups, inputs, mode, lay, cluster, cm.dtypes, tide)
        rows.append({"config": cm.path.stem, "gpus": gpus, "nodes": lay.nodes, "mode": mode,
                     "nccl": cluster.nccl_version, "rs_wire_bytes": tide.rs_wire_bytes,
                     "cross_node": tide.cross_node, "schedule": tide.schedule.name,
                     "mode_note": _note(mode, cluster, lay),
                     **{f"sim_{k}": v for k, v in fig.items()}})  # fmt: skip
        spans[mode] = sp
    base = next((r for r in rows if r["mode"] == "fsdp2"), None)
    for row in rows:
        if base:
            row["sim_speedup_vs_fsdp2"] = base["sim_step_ms"] / row["sim_step_ms"]
    return {"rows": rows, "spans": spans, "inputs": inputs, "cm": cm, "sources": inputs.sources,
            "rs_wire_bytes": tide.rs_wire_bytes, "schedule": tide.schedule.name}  # fmt: skip


def _note(mode: str, cluster: Cluster, lay: Layout) -> str:
    if mode != "symm_mem" or lay.nodes == 1:
        return ""
    if cluster.hierarchical_rs:
        return (f"NCCL {cluster.nccl_version}: hierarchical zero-SM AG and symmetric RS, "
                "phases pipelined (modeled upper bound)")  # fmt: skip
    return f"NCCL {cluster.nccl_version}: NCCL's ring kernels across nodes"
