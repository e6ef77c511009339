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
``interference.ENGINES``; concurrent engines' fractions add up), its bytes over a shared
link (one NIC per GPU, NVLink, HBM for local copies). FSDP2's copy-out and chunk_cat run
on the compute stream (layout kernels, slowed beside the engines as compute is).

TIDE is not modeled by hand: ``plans.Timeline`` runs the op plans the code runs
(``comm/plans/window_rounds.py`` on NCCL windows; the plans of ``comm/plans/plan.py`` as the
copy-engine and send/recv transports run them) for the layout, and each op is charged here by what
it is (:meth:`_Builder.charge`). Which transport runs is what ``[tide] ag_transport`` and
``cross_node_transport`` take on the cluster's NCCL (:func:`tide_run`, ``auto`` as
``comm/plans/topology.choose_transport`` decides it). Where the local ranks of a node run
different plans (in place at ``N x L``), the step is built for each of them
(``Timeline.classes``): every rank its own compute stream and its own GPU's links, each
rank's work after its own compute; the figures are those of the rank whose step ends
last (``engine.slowest_device``). symm_mem's hierarchical collectives (NCCL
>= 2.30.7) run their two phases pipelined inside one collective: the longer phase (an
upper bound on the baseline). Links: ``network``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchtitan_tide.comm.options import RS_WIRE_ITEMSIZE
from torchtitan_tide.comm.plans.memory_plan import GroupShape, group_shard_numel
from torchtitan_tide.comm.plans.plan import WorldLayout
from torchtitan_tide.simulator.cluster import GIB, Cluster, nccl_tuple
from torchtitan_tide.simulator.engine import (
    COMPUTE,
    Op,
    Span,
    base_name,
    device_spans,
    idle_and_comm,
    intersect_length,
    merge,
    on_device,
    other_spans,
    simulate,
    slowest_device,
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
from torchtitan_tide.simulator.interference import (
    CE,
    CE_LOCAL,
    NCCL,
    NCCL_SYMK,
    NIC,
    SM_AG,
)
from torchtitan_tide.simulator.network import (
    NCCL_BASE_US,
    NET_STEP_US,
    NVLINK_STEP_US,
    Layout,
    message_ms,
    nic_gibps,
    node_local_gibps,
    nvlink_gibps,
    ring_ms,
)
from torchtitan_tide.simulator.plans import (
    TideModel,
    TideRun,
    Timeline,
    Work,
    in_place_at,
)

__all__ = ["Layout", "TideModel", "build_ops", "simulate_config", "simulate_step", "tide_run"]

# one-sided puts and host RMA (comm/transports/windows/connect.py's probe)
WINDOWS_NCCL = (2, 29, 0)
SM_AG_PATH = {"fsdp2": f"{SM_AG}:fsdp2", "symm_mem": f"{SM_AG}:symm_mem"}


def tide_model_of(
    tide: Any,
    rs_wire_bytes: int | None = None,
    cross_node: str | None = None,
    transport: str | None = None,
    in_place_groups: int | None = None,
) -> TideModel:
    """The :class:`TideModel` of a config's validated ``[tide]`` section, with the wire
    (``rs_wire_bytes``), ``cross_node_transport`` (``cross_node``), ``ag_transport``
    (``transport``) and ``ag_in_place_groups`` (``in_place_groups``) replaced where given."""
    if in_place_groups is None:
        in_place_groups = int(getattr(tide, "ag_in_place_groups", 4))
    if rs_wire_bytes is None:
        rs_wire_bytes = RS_WIRE_ITEMSIZE[getattr(tide, "rs_wire_dtype", "float32")]
    return TideModel(
        ag_transport=transport or getattr(tide, "ag_transport", "auto"),
        cross_node_transport=cross_node or getattr(tide, "cross_node_transport", "auto"),
        rs_inflight=int(tide.rs_inflight),
        rs_rows=int(tide.rs_rows),
        slot_reuse=bool(tide.slot_reuse),
        rs_wire_bytes=rs_wire_bytes,
        ag_pacing=int(getattr(tide, "ag_pacing", 0)),
        ag_in_place_groups=in_place_groups,
    )


def tide_run(model: TideModel, cluster: Cluster, lay: Layout, dtypes: Any) -> TideRun:
    """What the code runs for ``model`` on ``cluster`` at ``lay`` (``topology.choose_transport``
    and ``install``'s phase-2 choice, without torch): NCCL windows where forced, or under
    ``auto`` across nodes unless ``cross_node_transport = "p2p"``, where the cluster's NCCL
    has one-sided puts (>= 2.29; host RMA between the nodes assumed, as on IB / RoCE); else
    the copy engine between the GPUs of a node (one GPU per rank, CUDA P2P) with send/recv
    across nodes; else send/recv. TIDE-RS phase 2 runs on NCCL's one-sided ring wherever the
    windows could (auto) and send/recv otherwise. A forced option that cannot run is a
    :class:`SimulateError` naming it, as the code's is a ``ValueError``."""
    windows_ok = nccl_tuple(cluster.nccl_version) >= WINDOWS_NCCL
    multi = lay.nodes > 1
    forced, cross = model.ag_transport, model.cross_node_transport
    why = f"NCCL {cluster.nccl_version} has no one-sided puts (NCCL >= 2.29)"
    if forced == "nccl_windows":
        if not windows_ok:
            raise SimulateError(f"[tide] ag_transport = 'nccl_windows' cannot run: {why}")
        if multi and cross == "p2p":
            raise SimulateError("[tide] ag_transport = 'nccl_windows' with cross_node_transport "
                                "= 'p2p': set one of them to 'auto'")  # fmt: skip
        transport = "windows"
    elif forced == "copy_engine":
        transport = "copy_engine"
    elif forced in ("nccl_p2p", "gloo"):
        transport = "p2p"
    elif multi and cross != "p2p" and windows_ok:
        transport = "windows"
    else:
        transport = "copy_engine" if lay.local > 1 else "p2p"
    if multi and cross == "nccl_one_sided" and not windows_ok:
        raise SimulateError(f"[tide] cross_node_transport = 'nccl_one_sided' cannot run: {why}")
    return TideRun(transport, multi and cross != "p2p" and windows_ok, model,
                   dtypes.param_bytes, dtypes.grad)  # fmt: skip


class _Replay:
    """A :class:`plans.Timeline`'s answers recorded in call order: a step of the same
    groups, layout and run issues the same calls (names are deterministic), so the plan
    work is built once per (groups, layout, run, mode) and replayed for every variant
    charged differently (inputs, cluster rates)."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline, self.answers, self.next = timeline, [], 0

    def call(self, method: str, *args) -> tuple[list[Work], tuple[str, ...]]:
        if self.next < len(self.answers):
            key, answer = self.answers[self.next]
            if key != (method, args):
                raise SimulateError(f"plan replay out of order: {key} != {(method, args)}")
        else:
            answer = getattr(self.timeline, method)(*args)
            self.answers.append(((method, args), answer))
        self.next += 1
        return answer


_TIMELINES: dict[tuple, _Replay] = {}


def _timeline(groups: tuple, lay: Layout, run: TideRun, mode: str) -> _Replay:
    key = (groups, lay, run, mode)
    replay = _TIMELINES.get(key)
    if replay is None:
        if len(_TIMELINES) >= 32:
            _TIMELINES.pop(next(iter(_TIMELINES)))
        replay = _TIMELINES[key] = _Replay(Timeline(WorldLayout(lay.world, lay.local), run,
                                                    groups))  # fmt: skip
    replay.next = 0
    return replay


def _gib_ms(nbytes: float, gibps: float) -> float:
    return 1e3 * nbytes / (gibps * GIB) if nbytes > 0 and gibps > 0 else 0.0


class _Builder:
    """The ops of one step of one mode, added in issue order."""

    def __init__(self, inputs: Inputs, mode: str, lay: Layout, cluster: Cluster, dtypes: Any,
                 tide: TideModel, groups: Sequence[GroupShape]) -> None:  # fmt: skip
        self.inputs, self.mode, self.lay, self.cluster = inputs, mode, lay, cluster
        self.dtypes, self.tide = dtypes, tide
        self.nic = nic_gibps(cluster.net_gibps)
        self.rate = inputs.transport_gibps.get(mode, {})
        self.ops: list[Op] = []
        self.compute_slow = {e: f for e, (f, _) in inputs.engines.items() if ":" not in e}
        self.timeline = None
        self.devices: tuple[int, ...] = (0,)  # the local ranks simulated, each its own GPU
        if mode in ("tide", "tide_ag") and lay.world > 1:
            run = tide_run(tide, cluster, lay, dtypes)
            self.timeline = _timeline(tuple(groups), lay, run, mode)
            self.devices = self.timeline.timeline.classes

    def add(self, name, stream, ms, kind, after=(), issued_with=(), group="", stretch=None,
            link="", flow="", priority=0, device=0):  # fmt: skip
        """One op of local rank ``device`` (``name``, ``stream`` and ``link`` as rank 0
        names them; ``after`` and ``issued_with`` of the rank's own); compute and layout
        kernels slow beside every engine, an engine's op beside compute. Returns its name."""
        return self._append(on_device(name, device), on_device(stream, device), ms, kind, after,
                            issued_with, group, stretch, on_device(link, device) if link else "",
                            flow, priority, device)  # fmt: skip

    def _append(self, name, stream, ms, kind, after, issued_with, group, stretch, link, flow,
                priority, device):  # fmt: skip
        if base_name(stream) == COMPUTE:
            slow = self.compute_slow if kind in ("compute", "layout") else {}
        else:
            g = self.inputs.engines.get(kind, (0.0, 0.0))[1] if stretch is None else stretch
            slow = {"compute": g}
        self.ops.append(Op(name, stream, max(0.0, ms), kind, tuple(after), tuple(issued_with),
                           slow, group, link=link, flow=flow, priority=priority,
                           device=device))  # fmt: skip
        return name

    def _sm_ag_stretch(self) -> float:
        """How much an all-gather path's SM kernels stretch beside compute: as its own
        path measured."""
        key = SM_AG_PATH.get(self.mode, SM_AG)
        return self.inputs.engines.get(key, self.inputs.engines.get(SM_AG, (0.0, 0.0)))[1]

    def sm_ag(self, name, stream, ms, issued_with, group, after=()):
        """An all-gather path's SM kernels (local rank 0), slowed as its own path measured."""
        return self.add(name, stream, ms, SM_AG, after, issued_with, group, self._sm_ag_stretch())

    # ---- TIDE's work, charged by what it is (plans.Work)
    def charge(self, works: Sequence[Work]) -> None:
        """Each :class:`plans.Work` as an op: its time alone on its link and engine."""
        ins, tide_rates = self.inputs, self.inputs.transport_gibps["tide"]
        nvlink = node_local_gibps(ins.transport_gibps["symm_mem"]["ag"])  # NCCL's CE copy
        for w in works:
            ms, kind = 0.0, w.engine or "issue"
            if w.what in ("Cast", "PackOwn"):  # bf16 out: the cast of nbytes / 2 elements
                ms = ins.sm_ns.get("tide", {}).get("cast", 0.0) * (w.nbytes / 2) / 1e6
            elif w.what == "Accumulate":
                ms = _gib_ms(w.nbytes, ins.accumulate_gibps)
            elif w.what == "SendRecv":
                rate = self.nic if base_name(w.link) == "nic" else nvlink
                ms = (NCCL_BASE_US + NET_STEP_US) / 1e3 + _gib_ms(w.nbytes, rate)
            elif w.what == "Put":
                rate, step = (
                    (self.nic, NET_STEP_US) if w.engine == NIC else (nvlink, NVLINK_STEP_US)
                )
                ms = w.count * step / 1e3 + _gib_ms(w.nbytes, rate)
            elif w.what in ("Pull", "Push"):  # the copy engine's measured batch (own + peer)
                batch = 2 * tide_rates["ag" if w.what == "Pull" else "rs"]
                ms = NVLINK_STEP_US / 1e3 + max(_gib_ms(w.nbytes, batch),
                                                _gib_ms(w.link_bytes, nvlink_gibps()))  # fmt: skip
            elif w.engine == CE_LOCAL:
                ms = w.count * NVLINK_STEP_US / 1e3 + _gib_ms(w.nbytes, ins.copy_gibps)
            elif w.what not in ("Issue", "Signal"):
                raise SimulateError(f"no charge for {w.what!r} ({w.name})")
            stretch = self._sm_ag_stretch() if kind == SM_AG else None
            self._append(w.name, w.stream, ms, kind, w.after, w.issued_with, w.group, stretch,
                         w.link, w.flow, w.priority, w.device)  # fmt: skip

    # ---- all-gather
    def gather(self, g: GroupShape, tag: str,
               issued_with: dict[int, list[str]]) -> dict[int, tuple[str, ...]]:  # fmt: skip
        """The all-gather of ``g`` issued as each simulated local rank's ``issued_with``
        starts; returns, per local rank, the ops its consumer waits for."""
        s = group_shard_numel(g, self.lay.world)
        b = s * self.dtypes.param_bytes
        name = f"{g.name}.{tag}.ag"
        if self.timeline is not None:  # rank 0's names: the timeline names each rank's
            works, done = self.timeline.call("all_gather", g, tag, tuple(issued_with[0]))
            self.charge(works)
            return dict(zip(self.devices, done))
        issued_with = issued_with[0]
        sm = self.inputs.sm_ns.get(self.mode, {})
        cast = sm.get("cast", 0.0) * s / 1e6
        copy_in = self.inputs.layout_ns.get(self.mode, {}).get("copy_in", 0.0) * s / 1e6
        ready = self.sm_ag(f"{name}_in", "ag_in", cast + copy_in, issued_with, g.name)
        lay, hier = self.lay, self.cluster.hierarchical_ag
        net = {"link": "nic", "flow": "nccl"} if lay.nodes > 1 else {}
        if self.mode == "symm_mem" and lay.nodes > 1 and hier:  # NCCL >= 2.30.7
            cross = message_ms((lay.nodes - 1) * b, self.nic, lay.nodes - 1, NET_STEP_US)
            local = message_ms((lay.local - 1) * lay.nodes * b,
                               node_local_gibps(self.rate["ag"]), 1, NVLINK_STEP_US)  # fmt: skip
            return {0: (self.add(name, "nccl", max(cross, local), CE, [ready], group=g.name,
                                 **net),)}  # fmt: skip
        if self.mode == "symm_mem" and lay.nodes == 1:  # zero-CTA: the copy engine
            ms = message_ms((lay.world - 1) * b, node_local_gibps(self.rate["ag"]), 1,
                            NVLINK_STEP_US)  # fmt: skip
            return {0: (self.add(name, "nccl", ms, CE, [ready], group=g.name),)}
        ring = self.inputs.transport_gibps["fsdp2"]["ag"]  # symm_mem 2.28.9 across nodes too
        return {0: (self.add(name, "nccl", ring_ms(b, lay, ring, self.nic), NCCL, [ready],
                             group=g.name, **net),)}  # fmt: skip

    def consume(self, g: GroupShape, ag: dict[int, tuple[str, ...]] | None, tag: str,
                device: int = 0) -> list[str]:  # fmt: skip
        """What local rank ``device``'s compute of ``g`` waits for: its all-gather, then
        the copy-out on the compute stream (queued at the consumer's pre-forward /
        pre-backward)."""
        if ag is None:
            return []
        copy_out = self.inputs.layout_ns.get(self.mode, {}).get("copy_out", 0.0) * g.numel / 1e6
        if not copy_out:
            return list(ag[device])
        return [self.add(f"{g.name}.{tag}.copy_out", COMPUTE, copy_out, "layout", ag[device],
                         group=g.name, device=device)]  # fmt: skip

    # ---- reduce-scatter
    def reduce_stock(self, g: GroupShape, src: str, device: int = 0) -> tuple[str, ...]:
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
            ms, kind = ring_ms(b, lay, ring, self.nic), NCCL
        elif lay.nodes == 1:
            ms, kind = ring_ms(b, lay, self.rate["rs"], self.nic) + divide, NCCL_SYMK
        elif self.cluster.hierarchical_rs:
            cross = message_ms((lay.nodes - 1) * b, self.nic, lay.nodes - 1, NET_STEP_US)
            local = message_ms((lay.local - 1) * lay.nodes * b, ring, 1, NVLINK_STEP_US)
            ms, kind = max(cross, local) + divide, NCCL_SYMK
        else:
            ms, kind = ring_ms(b, lay, ring, self.nic) + divide, NCCL
        net = {"link": "nic", "flow": "nccl"} if lay.nodes > 1 else {}
        return (self.add(f"{g.name}.rs", "nccl", ms, kind, [src], group=g.name, device=device,
                         **net),)  # fmt: skip

    def reduce_tide(self, g: GroupShape, src: dict[int, str]) -> dict[int, tuple[str, ...]]:
        """TIDE-RS as the code runs it (``plans.Timeline.reduce``), per simulated local
        rank."""
        works, done = self.timeline.call("reduce", g, (src[0],))
        self.charge(works)
        return dict(zip(self.devices, done))


def build_ops(
    groups: Sequence[GroupShape],
    inputs: Inputs,
    mode: str,
    lay: Layout,
    cluster: Cluster,
    dtypes: Any,
    tide: TideModel | None = None,
) -> list[Op]:
    """The ops of one step of ``mode`` (see the module docstring), in issue order."""
    if mode not in MODES:
        raise SimulateError(f"mode {mode!r}: choose from {MODES}")
    tide = tide or TideModel()
    comm = lay.world > 1
    bld = _Builder(inputs, mode, lay, cluster, dtypes, tide, groups)
    devs = bld.devices
    names = [g.name for g in groups]
    comp = {g.name: inputs.compute.get(g.name, GroupCompute(0.0, 0.0)) for g in groups}
    Marks = dict[int, tuple[str, ...]]  # per simulated local rank

    def gather(g: GroupShape, tag: str, issued_with: dict[int, list[str]]) -> Marks | None:
        return bld.gather(g, tag, issued_with) if comm else None

    def compute(name: str, ms: float, kind: str, after: dict[int, list[str]] | None = None,
                group: str = "") -> dict[int, str]:  # fmt: skip
        """The same op on every simulated rank's compute stream (its own after)."""
        return {d: bld.add(name, COMPUTE, ms, kind, (after or {}).get(d, ()), group=group,
                           device=d) for d in devs}  # fmt: skip

    # forward: group i+1's all-gather is issued as group i's forward starts
    pending = {groups[0].name: gather(groups[0], "fwd", {d: [] for d in devs})}
    for i, g in enumerate(groups):
        after = {d: bld.consume(g, pending[g.name], "fwd", d) for d in devs}
        fwd = compute(f"{g.name}.fwd", comp[g.name].fwd_ms, "compute", after, g.name)
        if i + 1 < len(groups):
            pending[names[i + 1]] = gather(groups[i + 1], "fwd", {d: [fwd[d]] for d in devs})
    compute("root.fwd_rest", inputs.root_fwd_ms, "compute", group="root")
    loss = compute("root.bwd_rest", inputs.root_bwd_ms, "compute", group="root")
    # backward, reverse order: group j-1's re-gather is issued as group j's backward
    # starts (queued on the stream before j's reduce-scatter); groups kept unsharded
    # after forward wait for their forward gather only
    order = list(reversed(groups))
    bwd_ag: dict[str, Marks | None] = {g.name: None for g in groups}
    if order[0].reshard_after_forward:
        bwd_ag[order[0].name] = gather(order[0], "bwd", {d: [loss[d]] for d in devs})
    rs_done: dict[int, list[str]] = {d: [] for d in devs}
    for k, g in enumerate(order):
        after = {d: bld.consume(g, bwd_ag[g.name], "bwd", d) if g.reshard_after_forward else []
                 for d in devs}  # fmt: skip
        bwd = compute(f"{g.name}.bwd", comp[g.name].bwd_ms, "compute", after, g.name)
        if k + 1 < len(order) and order[k + 1].reshard_after_forward:
            bwd_ag[order[k + 1].name] = gather(order[k + 1], "bwd", {d: [bwd[d]] for d in devs})
        if not comm:
            continue
        chunk = inputs.layout_ns.get(mode, {}).get("chunk_cat", 0.0) * g.numel / 1e6
        src = compute(f"{g.name}.chunk_cat", chunk, "layout", {d: [bwd[d]] for d in devs},
                      g.name) if chunk else bwd  # fmt: skip
        if mode == "tide":
            done = bld.reduce_tide(g, src)
        else:
            done = {d: bld.reduce_stock(g, src[d], d) for d in devs}
        for d in devs:
            rs_done[d] += done[d]
    shard = sum(group_shard_numel(g, lay.world) if comm else g.numel for g in groups)
    compute("optimizer", inputs.optimizer_ms_per_shard_elem * shard, "optimizer", rs_done)
    compute("host", inputs.host_ms, "host")
    return bld.ops


def breakdown(spans: Sequence[Span], beside: Sequence[Span] = ()) -> dict[str, float]:
    """The step split into compute (alone), SM time taken from compute, layout copies,
    optimizer, host, and communication the compute stream waited on, in the forward (up
    to the first backward op), the backward (to the last compute op) and the tail (these
    add up to the step); besides, off the compute stream: ``bd_local_copies_ms`` (device
    ms of local HBM copies: TIDE's placement and packing) and ``bd_nic_busy_ms`` (the
    NIC carrying bytes). ``spans``: one local rank's (``engine.device_spans``); ``beside``:
    the other ranks', whose communication it may wait for (exposure)."""
    on_compute = [s for s in spans if base_name(s.op.stream) == COMPUTE]
    work = [s for s in on_compute if s.op.kind == "compute"]
    backward = next((s for s in on_compute if base_name(s.op.name) == "root.bwd_rest"), None)
    bwd_start = backward.start_ms if backward else 0.0
    last = max((s.end_ms for s in work), default=0.0)
    idle, comm = idle_and_comm(spans, beside)

    def exposed(lo: float, hi: float) -> float:
        return intersect_length([(max(a, lo), min(b, hi)) for a, b in idle if b > lo and a < hi],
                                comm)  # fmt: skip

    step = max((s.end_ms for s in spans), default=0.0)
    nic = [(s.start_ms, s.end_ms) for s in spans if base_name(s.op.link) == "nic"]
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
        "bd_local_copies_ms": sum(s.end_ms - s.start_ms for s in spans if s.op.kind == CE_LOCAL),
        "bd_nic_busy_ms": sum(b - a for a, b in merge(nic)),
    }


def simulate_step(
    groups, inputs, mode, lay, cluster, dtypes, tide: TideModel | None = None
) -> tuple[dict, list[Span]]:
    """(summary figures and breakdown, spans) of one simulated step: the figures of the
    local rank that sets the step (``slowest_local_rank``: the one whose compute stream
    ends last), the spans of every simulated local rank."""
    spans = simulate(build_ops(groups, inputs, mode, lay, cluster, dtypes, tide))
    rank = slowest_device(spans)
    mine, others = device_spans(spans, rank), other_spans(spans, rank)
    return {**summarize(mine, others), **breakdown(mine, others),
            "slowest_local_rank": rank}, spans  # fmt: skip


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
    transport: str | None = None,
    workload: Workload | None = None,
    in_place_groups: int | None = None,
) -> dict[str, Any]:
    """Rows (one per mode), spans per mode, the inputs and the config model of ``config``
    at ``gpus``. ``rs_wire_bytes`` / ``cross_node`` / ``transport`` / ``in_place_groups``:
    ``[tide] rs_wire_dtype`` / ``cross_node_transport`` / ``ag_transport`` /
    ``ag_in_place_groups`` other than the config's.
    Each row carries what the report needs: the cluster's NCCL, what TIDE runs there
    (transport, phase 2, in place), every input's source (``sources``)."""
    from torchtitan_tide.fsdp_groups import load_config_model

    cm = cm or load_config_model(config)
    inputs = inputs or build_inputs(cm, results_dir, trace, mfu, world1=gpus == 1,
                                    workload=workload)  # fmt: skip
    lay = layout_for(cm, gpus, cluster)
    tide = tide_model_of(cm.tide, rs_wire_bytes, cross_node, transport, in_place_groups)
    rows, spans = [], {}
    for mode in modes:
        fig, sp = simulate_step(cm.groups, inputs, mode, lay, cluster, cm.dtypes, tide)
        rows.append({"config": cm.path.stem, "gpus": gpus, "nodes": lay.nodes, "mode": mode,
                     "nccl": cluster.nccl_version, "rs_wire_bytes": tide.rs_wire_bytes,
                     **_tide_columns(mode, tide, cluster, lay, cm.dtypes),
                     "mode_note": _note(mode, cluster, lay),
                     **{f"sim_{k}": v for k, v in fig.items()}})  # fmt: skip
        spans[mode] = sp
    base = next((r for r in rows if r["mode"] == "fsdp2"), None)
    for row in rows:
        if base:
            row["sim_speedup_vs_fsdp2"] = base["sim_step_ms"] / row["sim_step_ms"]
    return {"rows": rows, "spans": spans, "inputs": inputs, "cm": cm, "sources": inputs.sources,
            "rs_wire_bytes": tide.rs_wire_bytes}  # fmt: skip


def _tide_columns(mode: str, tide: TideModel, cluster: Cluster, lay: Layout,
                  dtypes: Any) -> dict[str, Any]:  # fmt: skip
    """What TIDE runs in a row: its transport (``windows`` / ``copy_engine`` / ``p2p``),
    TIDE-RS phase 2 across nodes (``one_sided`` / ``p2p`` / ``-``), in place or not."""
    if mode not in ("tide", "tide_ag") or lay.world == 1:
        return {"tide_transport": "-", "rs_phase2": "-", "in_place": False}
    run = tide_run(tide, cluster, lay, dtypes)
    phase2 = "-" if lay.nodes == 1 or mode == "tide_ag" else ("one_sided" if run.one_sided
                                                              else "p2p")  # fmt: skip
    in_place = (run.transport == "windows" and run.model.ag_in_place_groups > 0
                and in_place_at(WorldLayout(lay.world, lay.local)))  # fmt: skip
    return {"tide_transport": run.transport, "rs_phase2": phase2, "in_place": in_place}


def _note(mode: str, cluster: Cluster, lay: Layout) -> str:
    if mode != "symm_mem" or lay.nodes == 1:
        return ""
    if cluster.hierarchical_rs:
        return (f"NCCL {cluster.nccl_version}: hierarchical zero-SM AG and symmetric RS, "
                "phases pipelined (modeled upper bound)")  # fmt: skip
    return f"NCCL {cluster.nccl_version}: NCCL's ring kernels across nodes"
