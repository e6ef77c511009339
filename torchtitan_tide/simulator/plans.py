"""TIDE's collectives as the code runs them, for the step simulator: the op plans of
``comm/plans/window_rounds.py`` and the plans of ``comm/plans/plan.py``, turned into work on streams
and links for the local ranks of node 0 of a layout ``N nodes x L``
(docs/design/2026-12-07-simulator.md).

Pure Python (no torch). Nothing here models TIDE's schedule by hand where the code has an
op plan: the NCCL-windows path calls the same pure functions the window transport runs
(``ag_in_place_ops``, ``ag_round_ops``, ``rs_round_ops``, ``ring_step_ops``) with the
modeled layout, pacing and group sizes, and charges each op by its type:

===============  ========================================================================
op               charged as
===============  ========================================================================
``PackOwn``      the cast of the own shard (SM kernel, engine ``sm_ag``)
``PackSlices``   a local HBM-to-HBM copy (copy engine, ``ce_local``, link ``hbm``)
``Put``          to a rank of another node: the NIC (``nic``, link ``nic``, FIFO per
                 communicator); to a rank of this node: NVLink (``ce``, link ``nvlink``)
``Place``        a local HBM-to-HBM copy (``ce_local``, link ``hbm``)
``Accumulate``   TIDE-RS's accumulate kernel (``sm_rs``): rows read, fp32 target
``Signal``       an event on its stream (what a peer's wait waits for); no time
``Wait``         the stream waits for the matching signals (below)
``Fork``         the destination stream waits for everything issued on the source
any other type   a :class:`~torchtitan_tide.simulator.results.SimulateError`
===============  ========================================================================

Streams: an op's stream (``window_rounds.MAIN``, ``PUT``, ``FAN``, ``PLACE``, ``RING``)
maps to the CUDA stream the transport runs it on (:data:`AG_STREAMS`; ``comm/base/streams.py``:
``main`` is TIDE's stream or the caller's, TIDE-RS phase 2's ring runs on
``tide_rs_cross``, with which ``run_beside`` keeps its side stream in order); a stream the
plan adds later gets a stream of its own (``tide_<name>``), so a plan that moves work to a
new stream is simulated so without an edit here.

Ranks: the ranks of one local index on every node run the same plan up to relabeling
(checked: same op types on the same streams at every position); the local indices of a
node may not (in place at ``L > 1`` each moves other parameters across nodes). So
:class:`Timeline` simulates every local rank ``l`` of node 0 whose plan can differ (all
``L`` where the all-gather goes in place, else rank 0 for all), each on its own streams
and links (``engine.on_device``: ``tide_fan@3``, ``nic@3``). A wait of local rank ``l``
completes when the matching signal of EVERY rank of local index ``l``'s corresponding
wait has arrived (signals counted per sender, receiver and communicator in issue order,
as NCCL counts them): the slowest node's view. A signal a rank ``(m, l')`` issues at
position ``i`` of a call is timed by local rank ``l'``'s own op at position ``i``. A
call's wait table is computed once per distinct set of op lists (types, streams, peers,
offsets, counts) and signals still pending, and reused for every later call alike. The
in-place all-gather's credits (``ag_credit`` waits before reusing an arena range) are not
modeled: every all-gather finds its range free.

Where NCCL windows do not run (NCCL < 2.29, or ``cross_node_transport = "p2p"``), the code
runs ``comm/transports/copy_engine.py`` (node-local pulls from symmetric memory after a serial
send/recv cross-node phase) or ``comm/transports/p2p.py`` (one rank per node): those transports
run the plans of ``comm/plans/plan.py`` (``GroupPlan.exchanges``, ``build_rs_plan``) without an op
list, and :class:`Timeline` runs their protocol step by step as the transport does, in
the same order, serial where the code is serial, for local rank 0 (the ranks are alike).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torchtitan_tide.comm.plans import window_rounds as wr
from torchtitan_tide.comm.plans.memory_plan import GroupShape, padded_shard_numel
from torchtitan_tide.comm.plans.plan import (
    GroupPlan,
    ParamSpec,
    RSPlan,
    WorldLayout,
    build_group_plan,
    build_rs_plan,
    packed_entry,
)
from torchtitan_tide.comm.plans.window_arena import aligned
from torchtitan_tide.simulator.engine import on_device
from torchtitan_tide.simulator.interference import CE, CE_LOCAL, NCCL, NIC, SM_AG, SM_RS
from torchtitan_tide.simulator.results import SimulateError

__all__ = [
    "AG_TRANSPORTS",
    "CROSS_NODE",
    "TRANSPORTS",
    "TideModel",
    "TideRun",
    "Timeline",
    "Work",
    "in_place_at",
]

# CUDA streams of TIDE (comm/base/streams.py) by the op streams of window_rounds the transports
# run them on (comm/transports/windows/transport.py's _STREAMS, windows/ring.py's AG_PUT_STREAM and
# phase 2's tide_rs_cross: torch modules, so named here; tests/bench/test_simulate_findings.py
# checks they agree), and those of the NCCL communicator TIDE's send/recv use
AG_STREAMS = {wr.MAIN: "tide", wr.PUT: "tide_one_sided", wr.FAN: "tide_fan",
              wr.PLACE: "tide_place"}  # fmt: skip
TIDE, ONE_SIDED, FAN, PLACE = (AG_STREAMS[k] for k in (wr.MAIN, wr.PUT, wr.FAN, wr.PLACE))
RS_CROSS, RS_LOCAL, NCCL_P2P = "tide_rs_cross", "rs_local", "nccl_p2p"
TRANSPORTS = ("windows", "copy_engine", "p2p")
NIC_LINK, NVLINK, HBM = "nic", "nvlink", "hbm"
Marker = tuple[str, ...]  # a point of a stream: every named op ended


@dataclass(frozen=True)
class Work:
    """One op of TIDE's run for the step simulator to charge: ``what`` it is (the op type of
    the plan, or of the transport's protocol: ``Cast``, ``SendRecv``, ``Pull``, ``Push``,
    ``Issue``), the interference ``engine``, the shared ``link`` it moves ``nbytes`` over
    (``link_bytes`` of them over the link where a batch mixes NVLink and local copies),
    its ``flow`` on the link (FIFO per flow), what it waits for, the local rank
    (``device``) whose GPU runs it (its name, stream and link carry the rank,
    ``engine.on_device``), and how many consecutive ops of the plan it stands for
    (``count``: each pays its latency; nobody waits for one but the last)."""

    name: str
    stream: str
    what: str
    engine: str = ""
    link: str = ""
    nbytes: float = 0.0
    link_bytes: float = 0.0
    flow: str = ""
    after: Marker = ()
    issued_with: Marker = ()
    group: str = ""
    priority: int = 0
    device: int = 0
    count: int = 1  # ops of the plan run as this one (consecutive, alike: ``_alike``)


# ops that consecutive, alike and unwaited run as one (each keeps its latency: ``count``)
MERGED = ("Put", "PackSlices", "Place")
AG_TRANSPORTS = ("auto", "nccl_windows", "copy_engine", "nccl_p2p", "gloo")  # [tide] ag_transport
CROSS_NODE = ("auto", "p2p", "nccl_one_sided")  # [tide] cross_node_transport


@dataclass(frozen=True)
class TideModel:
    """The ``[tide]`` options the code reads for its run (``ag_transport``,
    ``cross_node_transport``, ...); ``rs_wire_bytes``: bytes per element of TIDE-RS's
    cross-node partials (4: fp32; 2: bf16). What runs on a cluster: ``step.tide_run``."""

    ag_transport: str = "auto"
    cross_node_transport: str = "auto"
    rs_inflight: int = 2
    rs_rows: int = 2
    slot_reuse: bool = True
    rs_wire_bytes: int = 4
    ag_pacing: int = 0
    ag_in_place_groups: int = 4

    def __post_init__(self) -> None:
        if self.ag_transport not in AG_TRANSPORTS:
            raise SimulateError(f"[tide] ag_transport {self.ag_transport!r}: choose from "
                                f"{AG_TRANSPORTS}")  # fmt: skip
        if self.cross_node_transport not in CROSS_NODE:
            raise SimulateError(f"[tide] cross_node_transport {self.cross_node_transport!r}: "
                                f"choose from {CROSS_NODE}")  # fmt: skip
        if self.rs_wire_bytes not in (2, 4):
            raise SimulateError(f"rs_wire_bytes {self.rs_wire_bytes}: 2 (bf16) or 4 (fp32)")


@dataclass(frozen=True)
class TideRun:
    """How the code runs TIDE on the modeled layout: ``transport`` (``windows``: NCCL
    windows; ``copy_engine``; ``p2p``), TIDE-RS phase 2 ``one_sided`` (NCCL's ring of
    puts) or send/recv, the ``[tide]`` options (``model``) and the dtypes' sizes."""

    transport: str
    one_sided: bool
    model: TideModel = TideModel()
    param_bytes: int = 2
    grad_bytes: int = 2

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise SimulateError(f"TIDE transport {self.transport!r}: choose from {TRANSPORTS}")


def _specs(group: GroupShape, world: int) -> list[ParamSpec]:
    return [ParamSpec(f"{group.name}.{i}", padded_shard_numel(shape, world), "torch.bfloat16")
            for i, shape in enumerate(group.param_shapes)]  # fmt: skip


def in_place_at(layout: WorldLayout) -> bool:
    """Whether the op plan delivers all-gathers in place at ``layout``: the switch is the
    plan itself (``window_rounds.ag_in_place_ops`` refuses a layout it cannot run with a
    ``ValueError``; today it runs at every ``N x L`` of more than one node), so the
    simulation follows the code."""
    if layout.num_nodes < 2:
        return False
    plan = build_group_plan([ParamSpec("probe", 1, "torch.bfloat16")], layout, 0,
                            pull_local=True)  # fmt: skip
    try:
        wr.ag_in_place_ops(plan, (0,), (2,), 0, 0, {}, 0)
    except ValueError:
        return False
    return True


_FIELDS: dict[type, tuple[str, ...]] = {}


def _signature(ops: Sequence[object]) -> tuple:
    """What the waits of a call depend on: each op's type and fields, a tuple field (tags,
    slices, entries) by its length."""
    out = []
    for op in ops:
        names = _FIELDS.get(type(op))
        if names is None:
            names = _FIELDS[type(op)] = tuple(f.name for f in dataclasses.fields(op))
        values = (getattr(op, n) for n in names)
        out.append((type(op).__name__, *(len(v) if isinstance(v, tuple) else v for v in values)))
    return tuple(out)


@dataclass
class _Round:
    """Context of one call of a plan function: where its op streams run and how its
    accumulate rows are sized."""

    streams: Mapping[str, str]
    prefix: str
    group: str
    row_itemsize: int = 2
    target_bytes: int = 8  # fp32 target bytes read + written per row element

    def stream(self, name: str) -> str:
        """The CUDA stream of an op stream of the plan; a stream the plan adds gets its own."""
        return self.streams.get(name) or f"tide_{name}"


class Timeline:
    """TIDE's work of one step for the simulated local ranks of node 0 (:attr:`classes`), in
    issue order (the order the host issues it, the same on every rank). Methods add one
    collective and return its :class:`Work` and, per simulated local rank, the
    :data:`Marker` its consumer waits for. Markers given to a method are local rank 0's
    names; local rank ``l`` waits for the same points of its own streams
    (``engine.on_device``)."""

    def __init__(self, layout: WorldLayout, run: TideRun, groups: Sequence[GroupShape]) -> None:
        self.layout, self.run = layout, run
        self.world, self.node = layout.world_size, 0
        self.works: list[Work] = []
        self._last: dict[str, Marker] = {}
        self._order: dict[str, tuple[str, int]] = {}  # op name -> (its stream, issue number)
        self._issued = 0
        self._rounds = 0
        self._names: list[dict[int, list[str]]] = []  # per call: each local rank's op names
        self._pending: dict[tuple[int, int, str], deque] = {}
        self._tables: dict[tuple, tuple] = {}
        self._plans: dict[tuple, GroupPlan] = {}
        self._rs_plans: dict[tuple, RSPlan] = {}
        self.ag_index = self.round_index = self.in_place_index = 0
        self.ring_steps = 0
        self.in_place = (run.transport == "windows" and run.model.ag_in_place_groups > 0
                         and in_place_at(layout))  # fmt: skip
        lws = layout.local_world_size
        # the local ranks simulated: all where their plans differ (in place), else rank 0
        self.classes: tuple[int, ...] = tuple(range(lws)) if self.in_place else (0,)
        self.partial_free: dict[int, list[Marker]] = {c: [] for c in self.classes}
        shards = [sum(padded_shard_numel(s, self.world) for s in g.param_shapes) for g in groups]
        entry = max((self._packing(g).entry_bytes for g in groups), default=0)
        rows = min(run.model.rs_rows, lws)
        self.wl = wr.window_layout(layout.num_nodes, lws, entry,
                                   rows * max(shards, default=0) * run.grad_bytes,
                                   run.model.slot_reuse)  # fmt: skip
        self.ring = (wr.ring_layout(run.model.rs_inflight, 4 * max(shards, default=1),
                                    run.model.rs_wire_bytes != 4)
                     if layout.num_nodes > 1 else None)  # fmt: skip

    # ------------------------------------------------------------ bookkeeping

    def _class(self, rank: int) -> int:
        """The simulated local rank whose timeline stands for group rank ``rank``."""
        return self.layout.local_of(rank) if len(self.classes) > 1 else 0

    def marker(self, stream: str, device: int = 0) -> Marker:
        return self._last.get(on_device(stream, device), ())

    def wait_on(self, stream: str, marker: Marker, device: int = 0) -> None:
        """Local rank ``device``'s ``stream`` waits for ``marker`` (an event; FSDP's or the
        transport's)."""
        key = on_device(stream, device)
        self._last[key] = self._latest((*self._last.get(key, ()), *marker))

    def _latest(self, names: Sequence[str]) -> Marker:
        """``names`` without those an op later on the same stream implies (streams are
        FIFO): a marker stays as long as the streams it spans."""
        last: dict[str, tuple[int, str]] = {}
        other = []
        for name in names:
            at = self._order.get(name)
            if at is None:  # not TIDE's (FSDP's compute stream)
                other.append(name)
            elif at[0] not in last or at[1] > last[at[0]][0]:
                last[at[0]] = (at[1], name)
        return tuple(dict.fromkeys((*other, *(name for _, name in last.values()))))

    def _reserve(self, name: str, stream: str) -> None:
        if name not in self._order:
            self._order[name] = (stream, self._issued)
            self._issued += 1

    def _add(self, work: Work) -> Marker:
        """``work`` (local rank 0's name, stream and link; ``after`` of its own rank) on
        local rank ``work.device``, after everything its stream waits for."""
        d = work.device
        name, stream = on_device(work.name, d), on_device(work.stream, d)
        after = self._latest((*self._last.get(stream, ()), *work.after))
        self._reserve(name, stream)
        self.works.append(dataclasses.replace(
            work, name=name, stream=stream, link=on_device(work.link, d) if work.link else "",
            after=after))  # fmt: skip
        self._last[stream] = (name,)
        return (name,)

    def _take(self) -> list[Work]:
        out, self.works = self.works, []
        return out

    def _plan(self, group: GroupShape, rank: int) -> GroupPlan:
        key = (group.param_shapes, rank)
        if key not in self._plans:
            # as install_groups builds it: send/recv exchanges the node-local shards too
            pull_local = self.run.transport in ("copy_engine", "windows")
            self._plans[key] = build_group_plan(_specs(group, self.world), self.layout, rank,
                                                pull_local=pull_local,
                                                pacing=self.run.model.ag_pacing)  # fmt: skip
        return self._plans[key]

    def _packing(self, group: GroupShape):
        plan = self._plan(group, 0)
        return packed_entry(plan.params, [self.run.param_bytes] * len(plan.params))

    def _rs_plan(self, group: GroupShape, rank: int) -> RSPlan:
        key = (group.param_shapes, rank)
        if key not in self._rs_plans:
            numels = [math.prod(s) if s else 1 for s in group.param_shapes]
            shards = [padded_shard_numel(s, self.world) for s in group.param_shapes]
            rows = min(self.run.model.rs_rows, self.layout.local_world_size)
            self._rs_plans[key] = build_rs_plan(self.layout, rank, rows, numels, shards)
        return self._rs_plans[key]

    # ------------------------------------------------------------ one call of a plan

    def _pending_rel(self, comms: set, k: int) -> tuple:
        """The signals not yet waited for on ``comms``, as (round - ``k``, position)."""
        return tuple(sorted((key, tuple((r - k, pos) for r, pos in queue))
                            for key, queue in self._pending.items()
                            if key[2] in comms and queue))  # fmt: skip

    def _wait_table(self, kind: str, k: int, lists: dict[int, list],
                    ops_of: Callable[[int], list]) -> dict:  # fmt: skip
        """Per (local rank, position) of the simulated ``lists`` that waits: the (call -
        ``k``, sender's simulated local rank, position) of every signal its wait consumes,
        over every rank of that local index (module docstring). Calls whose op lists and
        pending signals are alike resolve alike: computed once."""
        comms = {op.comm for ops in lists.values() for op in ops if hasattr(op, "comm")}
        before = self._pending_rel(comms, k)
        cache = (kind, tuple(_signature(lists[c]) for c in self.classes), before)
        if (hit := self._tables.get(cache)) is not None:
            table, after = hit
            for key in [key for key in self._pending if key[2] in comms]:
                del self._pending[key]
            for key, queue in after:
                self._pending[key] = deque((k + r, pos) for r, pos in queue)
            return table
        shapes = {c: [(type(op), getattr(op, "stream", None)) for op in ops]
                  for c, ops in lists.items()}  # fmt: skip
        every: dict[int, list] = {}
        for q in range(self.world):
            c = self._class(q)
            rep = self.layout.rank_of(self.node, c)
            ops = lists[c] if q == rep else ops_of(q)
            if [(type(op), getattr(op, "stream", None)) for op in ops] != shapes[c]:
                raise SimulateError(
                    f"the op plan of rank {q} is not rank {rep}'s relabeled ({kind}): the "
                    "simulator times the ranks of one local index by one plan "
                    "(docs/design/2026-12-07-simulator.md)"
                )
            every[q] = ops
        for q, ops in every.items():
            for i, op in enumerate(ops):
                if isinstance(op, (wr.Put, wr.Signal)):
                    self._pending.setdefault((q, op.peer, op.comm), deque()).append((k, i))
        table: dict[tuple[int, int], set] = {}
        for q, ops in every.items():
            for j, op in enumerate(ops):
                if not isinstance(op, wr.Wait):
                    continue
                queue = self._pending.get((op.peer, q, op.comm))
                if queue is None or len(queue) < op.count:
                    raise SimulateError(
                        f"rank {q} waits for {op.count} signal(s) from rank {op.peer} on "
                        f"{op.comm!r} that no earlier op sends ({kind})"
                    )
                for _ in range(op.count):
                    call, pos = queue.popleft()
                    table.setdefault((self._class(q), j), set()).add(
                        (call - k, self._class(op.peer), pos))  # fmt: skip
        self._pending = {key: queue for key, queue in self._pending.items() if queue}
        frozen = {at: tuple(sorted(t)) for at, t in table.items()}
        self._tables[cache] = (frozen, self._pending_rel(comms, k))
        return frozen

    def _call(self, kind: str, ops_of: Callable[[int], list], ctx: _Round) -> None:
        """Every simulated local rank's ops of one call of a plan function, as
        :class:`Work` (module table). Names are given first, so a wait may name a signal
        a peer issues later in its list (its streams run beside the waiting one)."""
        lists = {c: ops_of(self.layout.rank_of(self.node, c)) for c in self.classes}
        k = self._rounds
        self._rounds += 1
        names: dict[int, list[str]] = {}
        for c, ops in lists.items():
            names[c] = []
            last: dict[str, str | None] = {}  # stream -> its last op of this call, if nothing since
            for j, op in enumerate(ops):
                name = on_device(f"{ctx.prefix}.{j}.{type(op).__name__}", c)
                if isinstance(op, wr.Fork):
                    last[ctx.stream(op.dst)] = None
                elif isinstance(op, wr.Wait):
                    last[ctx.stream(op.stream)] = None
                else:
                    stream = ctx.stream(getattr(op, "stream", ""))
                    if isinstance(op, wr.Signal) and last.get(stream):
                        name = last[stream]  # issued right after it: the same point
                    else:
                        self._reserve(name, on_device(stream, c))
                        last[stream] = name
                names[c].append(name)
        self._names.append(names)
        table = self._wait_table(kind, k, lists, ops_of) if any(
            isinstance(op, (wr.Put, wr.Signal, wr.Wait))
            for ops in lists.values() for op in ops) else {}  # fmt: skip
        targets = {at: self._latest([self._names[k + call][sender][pos]
                                     for call, sender, pos in found])
                   for at, found in table.items()}  # fmt: skip
        waited = {name for found in targets.values() for name in found}
        waited |= {names[self._class(key[0])][pos] for key, queue in self._pending.items()
                   for call, pos in queue if call == k}  # fmt: skip
        for c, ops in lists.items():
            self._emit(c, ops, names[c], targets, waited, ctx)

    def _emit(self, c: int, ops: list, names: list[str], targets: dict, waited: set,
              ctx: _Round) -> None:  # fmt: skip
        """Local rank ``c``'s ops of one call as :class:`Work`, in order: ``names`` of its
        positions, ``targets`` of its waits, the names a wait waits for (``waited``).
        Consecutive alike ops of a stream that nobody waits for one by one run as one
        (:func:`_alike`)."""
        held: dict[str, Work] = {}  # per stream: its last op, open to the next alike

        def flush(stream: str) -> None:
            if stream in held:
                self._add(held.pop(stream))

        for j, op in enumerate(ops):
            name = f"{ctx.prefix}.{j}.{type(op).__name__}"
            if isinstance(op, wr.Fork):
                src, dst = ctx.stream(op.src), ctx.stream(op.dst)
                flush(src)
                mark = self.marker(src, c)
                if not set(mark) <= set(self.marker(dst, c)):  # else ``dst`` waits for it
                    flush(dst)
                    self.wait_on(dst, mark, c)
                continue
            stream = ctx.stream(getattr(op, "stream", ""))
            if isinstance(op, wr.Wait):
                flush(stream)
                self.wait_on(stream, targets.get((c, j), ()), c)
            elif isinstance(op, wr.Signal):
                if names[j] == on_device(name, c):  # else the point of an op before it
                    flush(stream)
                    self._add(Work(name, stream, "Signal", group=ctx.group, device=c))
            else:
                work = self._work(op, name, stream, ctx, c)
                before = held.get(stream)
                if before is not None and _alike(before, work):
                    work = dataclasses.replace(
                        work, nbytes=before.nbytes + work.nbytes,
                        link_bytes=before.link_bytes + work.link_bytes,
                        count=before.count + work.count)  # fmt: skip
                else:
                    flush(stream)
                held[stream] = work
                if names[j] in waited:  # a peer waits for this op's end: its own
                    flush(stream)
        for stream in list(held):
            flush(stream)

    def _work(self, op: object, name: str, stream: str, ctx: _Round, device: int) -> Work:
        """The charge of one op of local rank ``device``'s plan by its type (module table)."""
        if isinstance(op, wr.PackOwn):
            return Work(name, stream, "PackOwn", SM_AG, nbytes=op.nbytes, group=ctx.group,
                        device=device)  # fmt: skip
        if isinstance(op, wr.PackSlices):
            nbytes = sum(s.numel for s in op.slices) * self.run.grad_bytes
            return Work(name, stream, "PackSlices", CE_LOCAL, HBM, nbytes, nbytes, stream,
                        group=ctx.group, device=device)  # fmt: skip
        if isinstance(op, wr.Put):
            across = self.layout.node_of(op.peer) != self.node
            return Work(name, stream, "Put", NIC if across else CE, NIC_LINK if across else NVLINK,
                        op.nbytes, op.nbytes, op.comm if across else stream, group=ctx.group,
                        priority=int(getattr(op, "priority", 0)), device=device)  # fmt: skip
        if isinstance(op, wr.Place):
            nbytes = len(op.entries) * op.entry_bytes
            return Work(name, stream, "Place", CE_LOCAL, HBM, nbytes, nbytes, stream,
                        group=ctx.group, device=device)  # fmt: skip
        if isinstance(op, wr.Accumulate):
            row_numel = op.row_bytes // ctx.row_itemsize
            nbytes = op.count * op.row_bytes + ctx.target_bytes * row_numel
            return Work(name, stream, "Accumulate", SM_RS, nbytes=nbytes, group=ctx.group,
                        device=device)  # fmt: skip
        raise SimulateError(
            f"op plan: unknown op {type(op).__name__} ({op!r}); the simulator charges "
            "PackOwn, PackSlices, Put, Place, Accumulate, Signal, Wait and Fork "
            "(torchtitan_tide/simulator/plans.py): teach it the new op before simulating"
        )

    # ------------------------------------------------------------ TIDE-AG

    def all_gather(self, group: GroupShape, tag: str, issued_with: Marker,
                   after: Marker = ()) -> tuple[list[Work], tuple[Marker, ...]]:  # fmt: skip
        """One TIDE-AG of ``group`` issued as ``issued_with`` starts (FSDP2's prefetch);
        returns its work and, per simulated local rank (:attr:`classes`), the point of
        TIDE's stream the consumer waits for."""
        prefix = f"{group.name}.{tag}.ag"
        for c in self.classes:
            self._add(Work(f"{prefix}_issue", TIDE, "Issue", after=_at(after, c),
                           issued_with=_at(issued_with, c), group=group.name,
                           device=c))  # fmt: skip
        if self.run.transport == "windows":
            self._windows_gather(group, prefix)
        elif self.run.transport == "copy_engine":
            self._copy_engine_gather(group, prefix)
        else:
            self._p2p_gather(group, prefix)
        return self._take(), tuple(self.marker(TIDE, c) for c in self.classes)

    def _shard_bytes(self, group: GroupShape) -> int:
        return sum(padded_shard_numel(s, self.world) for s in group.param_shapes) * (
            self.run.param_bytes
        )

    def _windows_gather(self, group: GroupShape, prefix: str) -> None:
        ctx = _Round(AG_STREAMS, prefix, group.name)
        if self.in_place:
            # tide_all_gather casts the own shards into the arena, then the plan puts;
            # bind_in_place's offsets: every parameter's unsharded bytes aligned
            shard_bytes = tuple(padded_shard_numel(s, self.world) * self.run.param_bytes
                                for s in group.param_shapes)  # fmt: skip
            offsets, total = [], 0
            for n in shard_bytes:
                offsets.append(total)
                total += aligned(n * self.world)
            for c in self.classes:
                self._add(Work(f"{prefix}_cast", TIDE, "Cast", SM_AG, nbytes=sum(shard_bytes),
                               group=group.name, device=c))  # fmt: skip
            index = self.in_place_index
            self.in_place_index += 1

            def ops_of(q: int) -> list:
                return wr.ag_in_place_ops(self._plan(group, q), tuple(offsets), shard_bytes, 0,
                                          0, {}, index, self.run.model.ag_pacing)[0]  # fmt: skip

            self._call("ag_in_place", ops_of, ctx)
            return
        packing = self._packing(group)
        ag, rnd = self.ag_index, self.round_index
        self.ag_index += 1
        self.round_index += 1

        def ops_of(q: int) -> list:
            return wr.ag_round_ops(self.wl, self._plan(group, q), packing, ag, rnd,
                                   self.run.model.ag_pacing)  # fmt: skip

        self._call("ag_round", ops_of, ctx)

    def _exchange(self, prefix: str, stream: str, nbytes: float, group: str,
                  link: str = NIC_LINK) -> None:  # fmt: skip
        """One NCCL send/recv exchange of local rank 0 (``batch_isend_irecv`` on the
        group's communicator: its kernel on the communicator's stream after ``stream``;
        ``stream`` waits for it, as ``Work.wait`` makes the current stream wait); ``link``:
        the NIC across nodes, NVLink between ranks of a node."""
        self._add(Work(f"{prefix}_sendrecv", NCCL_P2P, "SendRecv", NCCL, link, nbytes,
                       nbytes, "nccl", after=self.marker(stream), group=group))  # fmt: skip
        self.wait_on(stream, self.marker(NCCL_P2P))

    def _copy_engine_gather(self, group: GroupShape, prefix: str) -> None:
        """``CopyEngineTransport.gather``: pack (the cast) into the own slot entry, each
        cross-node exchange of the plan as one send/recv of its entry runs, waited before
        the next (serial), the node-local barrier, ONE batch pulling every entry of every
        local index (the own node's included: local copies)."""
        plan, entry = self._plan(group, 0), self._packing(group).entry_bytes
        self._add(Work(f"{prefix}_pack", TIDE, "Cast", SM_AG, nbytes=self._shard_bytes(group),
                       group=group.name))  # fmt: skip
        for i, ex in enumerate(plan.exchanges):
            sent = len(ex.send_ranks) * entry
            self._exchange(f"{prefix}_x{i}", TIDE, sent, group.name)
        lws, nodes = self.layout.local_world_size, self.layout.num_nodes
        self._add(Work(f"{prefix}_pull", TIDE, "Pull", CE, NVLINK, lws * nodes * entry,
                       (lws - 1) * nodes * entry, TIDE, group=group.name))  # fmt: skip

    def _p2p_gather(self, group: GroupShape, prefix: str) -> None:
        """``P2PTransport.gather``: the own shard cast into its storage, then every wave of
        every exchange of the plan (across nodes, then in the node) sent straight from and
        into parameter storage, each wave waited before the next."""
        plan = self._plan(group, 0)
        self._add(Work(f"{prefix}_cast", TIDE, "Cast", SM_AG, nbytes=self._shard_bytes(group),
                       group=group.name))  # fmt: skip
        for i, ex in enumerate(plan.exchanges):
            for w, wave in enumerate(ex.send_waves):
                sent = sum(c.numel for c in wave) * self.run.param_bytes
                link = NVLINK if ex.phase == "node_local" else NIC_LINK
                self._exchange(f"{prefix}_x{i}w{w}", TIDE, sent, group.name, link)

    # ------------------------------------------------------------ TIDE-RS

    def reduce(self, group: GroupShape, after: Marker) -> tuple[list[Work], tuple[Marker, ...]]:
        """One TIDE-RS of ``group`` after ``after`` (its backward), as ``tide_reduce`` runs
        it: per chunk of the plan (the own node's first) its node-local rounds on the
        phase-1 stream, then (another node's chunk) phase 2 on ``tide_rs_cross`` after them,
        each partial in a ring of ``rs_inflight`` that phase 1 waits to reuse. Returns the
        work and, per simulated local rank, the point FSDP's post-reduce event marks."""
        run, layout = self.run, self.layout
        comm = TIDE if run.model.slot_reuse else RS_LOCAL
        prefix = f"{group.name}.rs"
        for c in self.classes:
            self._add(Work(f"{prefix}_issue", comm, "Issue", after=_at(after, c),
                           group=group.name, device=c))  # fmt: skip
        plan = self._rs_plan(group, 0)
        shard = plan.shard_numel
        inflight = run.model.rs_inflight
        for c, chunk in enumerate(plan.chunks):
            own = chunk.cross_peers is None
            for d in self.classes:
                if not own and len(self.partial_free[d]) >= inflight:
                    self.wait_on(comm, self.partial_free[d][-inflight], d)
            for r, rnd in enumerate(chunk.rounds):
                self._rs_round(group, c, r, comm, f"{prefix}.c{c}r{r}", rnd.first, shard)
            if not own:
                self._phase2(group, c, comm, f"{prefix}.c{c}", shard)
        last = RS_CROSS if layout.num_nodes > 1 else comm
        return self._take(), tuple(self.marker(last, d) for d in self.classes)

    def _rs_round(self, group: GroupShape, c: int, r: int, comm: str, prefix: str,
                  first: bool, shard: int) -> None:  # fmt: skip
        run, layout = self.run, self.layout
        target = 4 if first else 8
        if run.transport == "windows":
            rnd_index = self.round_index
            self.round_index += 1

            def ops_of(q: int) -> list:
                chunk = self._rs_plan(group, q).chunks[c]
                return wr.rs_round_ops(self.wl, layout, q, chunk.rounds[r], chunk.pushes[r],
                                       shard, run.grad_bytes, rnd_index)  # fmt: skip

            ctx = _Round({**AG_STREAMS, wr.MAIN: comm}, prefix, group.name, run.grad_bytes,
                         target)  # fmt: skip
            self._call("rs_round", ops_of, ctx)
            return
        chunk = self._rs_plan(group, 0).chunks[c]
        rnd, pushes = chunk.rounds[r], chunk.pushes[r]
        local = layout.local_of(0)
        nbytes = sum(p.numel for p in pushes) * run.grad_bytes
        remote = sum(p.numel for p in pushes if p.peer != local) * run.grad_bytes
        if run.transport == "copy_engine":  # ONE batch of pushes (own slice: a local copy)
            self._add(Work(f"{prefix}_push", comm, "Push", CE, NVLINK, nbytes, remote, comm,
                           group=group.name))  # fmt: skip
        else:  # p2p: the own slice copied locally, the others sent
            own = nbytes - remote
            if own:
                self._add(Work(f"{prefix}_own", comm, "Copy", CE_LOCAL, HBM, own, own, comm,
                               group=group.name))  # fmt: skip
            if remote:  # phase 1's peers are the node's ranks
                self._exchange(prefix, comm, remote, group.name, NVLINK)
        rows = len(rnd.recvs)
        self._add(Work(f"{prefix}_acc", comm, "Accumulate", SM_RS,
                       nbytes=rows * shard * run.grad_bytes + target * shard,
                       group=group.name))  # fmt: skip

    def _phase2(self, group: GroupShape, c: int, comm: str, prefix: str, shard: int) -> None:
        """Phase 2 of chunk ``c``: ``cross.wait_stream(comm)``, the partial rounded to the
        wire dtype (bf16: a cast kernel), then the ring step (one-sided: its puts, waits and
        credits on the ring, which first waits for TIDE-AG's put stream, the NIC rule) or
        send/recv, the received partial added into the output."""
        run = self.run
        nbytes = shard * run.model.rs_wire_bytes
        for d in self.classes:
            self.wait_on(RS_CROSS, self.marker(comm, d), d)
            if run.model.rs_wire_bytes != 4:
                self._add(Work(f"{prefix}_wire", RS_CROSS, "Cast", SM_AG, nbytes=nbytes,
                               group=group.name, device=d))  # fmt: skip
        if run.one_sided:
            step = self.ring_steps
            self.ring_steps += 1
            ring, layout = self.ring, self.layout
            src = ring.wire_start if ring.wire else ring.send(step % ring.slots)

            def ops_of(q: int) -> list:
                return wr.ring_step_ops(ring, layout, q, step, src, nbytes)

            ctx = _Round({wr.RING: RS_CROSS, wr.PUT: ONE_SIDED, wr.MAIN: RS_CROSS},
                         f"{prefix}.p2", group.name, run.model.rs_wire_bytes, 8)  # fmt: skip
            self._call("ring", ops_of, ctx)
        else:
            self._exchange(f"{prefix}.p2", RS_CROSS, nbytes, group.name)
            self._add(Work(f"{prefix}.p2_acc", RS_CROSS, "Accumulate", SM_RS,
                           nbytes=nbytes + 8 * shard, group=group.name))  # fmt: skip
        for d in self.classes:
            self.partial_free[d].append(self.marker(RS_CROSS, d))


def _alike(before: Work, work: Work) -> bool:
    """Whether ``work``, issued right after ``before`` on its stream with nothing waited
    between, runs as one op with it: same kind of op over the same link and flow (their
    times add: each op's latency, ``count``, and their bytes at the link's rate)."""
    return (before.what, before.engine, before.link, before.flow, before.priority) == (
        work.what, work.engine, work.link, work.flow, work.priority
    ) and work.what in MERGED and not work.issued_with and not work.after  # fmt: skip


def _at(marker: Marker, device: int) -> Marker:
    """Local rank 0's ``marker`` (FSDP's compute stream) as local rank ``device``'s."""
    return tuple(on_device(name, device) for name in marker)
