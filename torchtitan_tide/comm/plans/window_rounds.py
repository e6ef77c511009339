"""TIDE on NCCL windows: where every byte sits in a rank's window, and each round as ops.

Pure Python (no torch, no ``torch.distributed``): the window transport
(``transports/windows/transport.py``) runs these ops on CUDA streams or on the CPU stand-in, and the
tests replay every rank's ops against a checker of reads, writes and signals
(``tests/comm/_window_replay.py``). Decisions: docs/design/2026-12-04-windows.md.

Window of one rank of a process group laid out as ``num_nodes x local_world_size``
(identical offsets on every rank; byte offsets, areas 256-byte aligned):

- ``rail``: two halves (parity of the all-gather count) of ``num_nodes`` entries; entry ``m``
  holds the packed shards (``plan.packed_entry``) of rank ``(m, l)``, ``l`` this rank's local
  index. Written by this rank (its own entry) and by its rail peers (same local index, other
  nodes); read by the placement and by the fan-out puts.
- ``local``: two halves (parity of the round count: all-gathers and TIDE-RS rounds). In an
  all-gather, ``(L - 1) x num_nodes`` entries: local peer at offset ``o = (l' - l) mod L``
  writes its entries ``(m, l')`` at slot ``(o - 1) * num_nodes + m``. In a TIDE-RS round, the
  staging rows ``t`` (``plan.rs_schedule``): at the same place (Slot-Reuse) or after the
  all-gather part. Written only by local peers (and this rank's own RS row).
- ``send``: ``rows`` staging rows of TIDE-RS slices this rank packs before putting them (a
  put reads registered memory of its own rank; NCCL refuses anything else).
- ``arena`` (``[tide] ag_in_place_groups`` > 0, any ``L``, more than one node): the
  unsharded parameters of the groups all-gathered in place, ranges handed out by
  ``window_arena``.

Rounds, as ops on four streams (``main``: the caller's, TIDE's stream; ``put``: every
cross-node put and the rail waits; ``fan``: every node-local put and signal, the fan-out;
``place``: placement copies and the waits on local peers), and TIDE-RS phase 2's ``ring``.
Every signal to a local peer is issued on ``fan``, to a rail peer on ``put``, so a peer's
signals arrive in the order issued; the fan-out of a wave runs beside the next wave's
cross-node put. The op lists are the schedule: the transport runs them, the replay tests
check them, the simulator times them (docs/design/2026-12-07-zero-copy-nxl.md).

- All-gather in place (:func:`ag_in_place_ops`, any ``N x L``): every shard straight into
  the parameters' unsharded storage, which lives in the window's ``arena`` (``window_arena``)
  from the all-gather until FSDP2 reshards the group: the own shards to the node's ranks, the
  node blocks of the parameters this local index moves (:func:`cross_node_segments`) across
  nodes one contiguous range per parameter and run of nodes, each arrival forwarded to the
  node arena to arena; no pack, no placement. Reuse of an arena range waits for credits
  (``window_arena``'s docstring) from every rank that writes into it (:func:`in_place_writers`).
- All-gather (:func:`ag_round_ops`, the placement path: no arena, or the arena full): pack the
  own entry (the cast FSDP2's copy-in does), fan it out to the local peers, place it; then per
  cross-node exchange (recursive doubling among rail peers, the direct exchange when
  ``num_nodes`` is no power of two) and per wave of at most ``pacing`` entries: put the wave's
  runs into the rail peer's entries, wait for its wave, fan the arrived runs out to the local
  peers (``fan``, beside the next wave's put); on ``place`` the arrived runs and the local
  peers' forwarded runs are placed while ``put`` moves the next wave (pipelined).
- TIDE-RS round (:func:`rs_round_ops`, on ``fan``): pack this round's slices (own slice into
  the own row), put each peer's row, a bare signal to every local peer not put to, wait one
  signal from every local peer, sum the rows.
- TIDE-RS phase 2 (:func:`ring_step_ops`, on ``ring``): the cross-node partials; before each
  piece the ring waits for ``put`` (the NIC rule: an all-gather issued before it goes first).

Reuse without credits: a peer writes half ``h`` of this rank's area again two rounds of that
area later, after it waited for a signal this rank issued in the round between, which this
rank issued after every read of half ``h`` (the round's last ops join ``put``, ``fan`` and
``place`` into ``main``, the next round forks from ``main``). Every pair of local peers signals each
other in every round; every pair of rail peers exchanges in every all-gather (recursive
doubling: the same partners each round; direct exchange: all pairs).
"""

from __future__ import annotations

from dataclasses import dataclass

from .plan import GroupPlan, PackedEntry, RSRound, RSSlice, WorldLayout, entry_runs

__all__ = [
    "RS_PIECE_BYTES",
    "SEGMENT_ALIGN",
    "Accumulate",
    "Fork",
    "Op",
    "PackOwn",
    "PackSlices",
    "Place",
    "Put",
    "RingLayout",
    "Signal",
    "Wait",
    "WindowLayout",
    "ag_in_place_ops",
    "ag_round_ops",
    "cross_node_segments",
    "in_place_writers",
    "paced_pieces",
    "ring_layout",
    "ring_step_ops",
    "rs_round_ops",
    "window_layout",
]  # fmt: skip

AREA_ALIGN = 256  # bytes: every area starts on this boundary
# The streams of a round: the caller's (TIDE's), cross-node puts and rail waits, node-local
# puts and signals (the fan-out), placement copies and the waits they need; TIDE-RS phase 2's
# ring (its puts, waits and credits).
MAIN, PUT, FAN, PLACE, RING = "main", "put", "fan", "place", "ring"
# TIDE-RS phase 2 puts a partial in pieces of at most this many bytes (about 84 us at
# 400 Gb/s): an all-gather issued after them waits behind at most one piece on the NIC.
RS_PIECE_BYTES = 4 << 20


def _align(nbytes: int) -> int:
    return -(-nbytes // AREA_ALIGN) * AREA_ALIGN


@dataclass(frozen=True)
class WindowLayout:
    """Byte offsets of one rank's window (module docstring). ``entry_bytes``: the largest
    group's packed entry; ``rs_area_bytes``: TIDE-RS rows of one round (the rows of the
    largest reduce, or one row of gradients FSDP accumulated in fp32), also the size of
    the send area; ``rs_shares_ag``: Slot-Reuse (RS rows over the all-gather part of the
    local area)."""

    num_nodes: int
    local_world_size: int
    entry_bytes: int
    rs_area_bytes: int
    rs_shares_ag: bool
    rail_base: int
    rail_half_bytes: int
    local_base: int
    local_half_bytes: int
    rs_offset: int  # of the RS rows inside a local half
    send_base: int
    total_bytes: int
    arena_base: int = 0  # the in-place all-gather's arena (``window_arena``), at the end
    arena_bytes: int = 0

    def rail(self, half: int, node: int, entry_bytes: int) -> int:
        """Byte offset of rail entry ``node`` of ``half`` for a group of ``entry_bytes``."""
        return self.rail_base + half * self.rail_half_bytes + node * entry_bytes

    def local_entry(self, half: int, src_local: int, dst_local: int, node: int,
                    entry_bytes: int) -> int:  # fmt: skip
        """Byte offset, in the window of local index ``dst_local``, of the entry of rank
        ``(node, src_local)`` that ``src_local`` forwards there."""
        offset = (src_local - dst_local) % self.local_world_size
        if offset == 0:
            raise ValueError("a rank forwards no entry to itself")
        slot = (offset - 1) * self.num_nodes + node
        return self.local_base + half * self.local_half_bytes + slot * entry_bytes

    def rs_row(self, half: int, row: int, row_bytes: int) -> int:
        """Byte offset of TIDE-RS staging row ``row`` of local ``half`` for a reduce of
        ``row_bytes`` per row (rows are contiguous: one ``[rows, numel]`` tensor)."""
        return self.local_base + half * self.local_half_bytes + self.rs_offset + row * row_bytes

    def send_row(self, index: int, row_bytes: int) -> int:
        """Byte offset of send row ``index`` (the packed slices for one peer)."""
        return self.send_base + index * row_bytes


def window_layout(
    num_nodes: int, local_world_size: int, entry_bytes: int, rs_area_bytes: int,
    slot_reuse: bool = True, arena_bytes: int = 0,
) -> WindowLayout:  # fmt: skip
    """The window of a process group laid out ``num_nodes x local_world_size``
    (``rs_area_bytes`` 0: no TIDE-RS; ``memory_plan.rs_staging_bytes`` sizes it;
    ``arena_bytes`` 0: no in-place all-gather)."""
    if num_nodes < 1 or local_world_size < 1:
        raise ValueError(f"layout {num_nodes} x {local_world_size}")
    rail_half = _align(num_nodes * entry_bytes)
    ag_local = (local_world_size - 1) * num_nodes * entry_bytes
    if slot_reuse:
        local_half, rs_offset = _align(max(ag_local, rs_area_bytes)), 0
    else:
        local_half, rs_offset = _align(_align(ag_local) + rs_area_bytes), _align(ag_local)
    local_base = 2 * rail_half
    send_base = local_base + 2 * local_half
    arena_base = _align(send_base + rs_area_bytes)
    total = arena_base + _align(arena_bytes)
    return WindowLayout(
        num_nodes, local_world_size, entry_bytes, rs_area_bytes, slot_reuse,
        0, rail_half, local_base, local_half, rs_offset, send_base, total, arena_base,
        _align(arena_bytes),
    )  # fmt: skip


# ---------------------------------------------------------------- ops


@dataclass(frozen=True)
class PackOwn:
    """Cast this rank's shards into its packed entry at ``dst`` (``main``). ``tag``: what
    the bytes now hold (the replay checks every read against it)."""

    stream: str
    dst: int
    nbytes: int
    tag: tuple


@dataclass(frozen=True)
class PackSlices:
    """Copy gradient slices into the own window (``main``): ``slices[i]`` goes to byte
    ``dsts[i]`` (each row's slices at ``row start + dst_offset * itemsize``); ``rows``:
    ``(row start, row bytes, tag)`` of every row written."""

    stream: str
    slices: tuple[RSSlice, ...]
    dsts: tuple[int, ...]
    rows: tuple[tuple[int, int, tuple], ...]


@dataclass(frozen=True)
class Put:
    """``nbytes`` from own byte ``src`` into ``peer``'s window at ``dst``, then one signal
    to ``peer`` (group ranks). ``tags``: what the bytes hold, one tag per piece (an entry, a
    row, a shard or part of one); ``piece_bytes``: each piece's bytes (empty: equal pieces)."""

    stream: str
    src: int
    nbytes: int
    peer: int
    dst: int
    tags: tuple[tuple, ...]
    comm: str = "slots"
    piece_bytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Signal:
    """One signal to ``peer``, no data."""

    stream: str
    peer: int
    comm: str = "slots"


@dataclass(frozen=True)
class Wait:
    """The stream waits for ``count`` more signals from ``peer`` (on communicator
    ``comm``: each communicator counts its own signals)."""

    stream: str
    peer: int
    count: int
    comm: str = "slots"


@dataclass(frozen=True)
class Place:
    """Copy entries of the own window into the parameters' storage: ``(src byte, source
    rank, tag)`` each (the entry of that rank's shards, packed)."""

    stream: str
    entries: tuple[tuple[int, int, tuple], ...]
    entry_bytes: int


@dataclass(frozen=True)
class Accumulate:
    """Sum rows ``[start, start + count * row_bytes)`` of the own window into the fp32
    target (``main``); ``tags``: what each row must hold."""

    stream: str
    start: int
    count: int
    row_bytes: int
    tags: tuple[tuple, ...]


@dataclass(frozen=True)
class Fork:
    """``dst`` waits for everything issued on ``src`` so far (an event)."""

    src: str
    dst: str


Op = PackOwn | PackSlices | Put | Signal | Wait | Place | Accumulate | Fork


def paced_pieces(runs: list[tuple[int, int]], pacing: int) -> list[list[tuple[int, int]]]:
    """Waves of puts: ``pacing`` <= 0 -> one wave of the runs; else single entries,
    ``pacing`` per wave (both sides of an exchange split a step the same way)."""
    if pacing <= 0:
        return [runs] if runs else []
    singles = [(m + i, 1) for m, k in runs for i in range(k)]
    return [singles[i : i + pacing] for i in range(0, len(singles), pacing)]


def _forwarded_waves(plan: GroupPlan, pacing: int) -> list[tuple[int, list, list]]:
    """Per cross-node exchange wave: ``(rail peer, send pieces, recv pieces)``."""
    layout = plan.layout
    out = []
    for ex in plan.exchanges:
        if ex.phase != "cross_node":
            raise ValueError("the window all-gather takes a plan of cross-node exchanges only")
        sends = paced_pieces(entry_runs([layout.node_of(r) for r in ex.send_ranks]), pacing)
        recvs = paced_pieces(entry_runs([layout.node_of(r) for r in ex.recv_ranks]), pacing)
        if ex.send_peer != ex.recv_peer and len(sends) != len(recvs):
            raise AssertionError("direct exchange: send and receive waves differ")
        for wave in range(max(len(sends), len(recvs))):
            out.append((
                ex.send_peer, ex.recv_peer,
                sends[wave] if wave < len(sends) else [],
                recvs[wave] if wave < len(recvs) else [],
            ))  # fmt: skip
    return out


def ag_round_ops(
    wl: WindowLayout, plan: GroupPlan, packing: PackedEntry, ag_index: int, round_index: int,
    pacing: int,
) -> list[Op]:  # fmt: skip
    """One all-gather of ``plan`` (cross-node exchanges only: ``build_group_plan(...,
    pull_local=True)``) as this rank's ops. ``ag_index``: all-gathers before it on this
    window (rail parity); ``round_index``: rounds before it (local parity)."""
    layout: WorldLayout = plan.layout
    rank, lws = plan.rank, layout.local_world_size
    node, local = layout.node_of(rank), layout.local_of(rank)
    entry = packing.entry_bytes
    if entry > wl.entry_bytes:
        raise AssertionError(f"entry of {entry} B > the window's {wl.entry_bytes} B")
    rail_half, local_half = ag_index % 2, round_index % 2
    peers = [layout.rank_of(node, lp) for lp in range(lws) if lp != local]

    def tag(source_rank: int) -> tuple:
        return ("ag", ag_index, source_rank)

    def run_tags(first: int, count: int) -> tuple[tuple, ...]:
        return tuple(tag(layout.rank_of(m, local)) for m in range(first, first + count))

    def fan_out(first: int, count: int) -> list[Op]:
        return [
            Put(FAN, wl.rail(rail_half, first, entry), count * entry, peer,
                wl.local_entry(local_half, local, layout.local_of(peer), first, entry),
                run_tags(first, count))
            for peer in peers
        ]

    def arrivals(first: int, count: int) -> list[Op]:
        """Waits for the local peers' forwards of nodes ``first .. first + count - 1`` (one
        signal each) and their placement, on ``place``."""
        ops: list[Op] = []
        for peer in peers:
            lp = layout.local_of(peer)
            ops.append(Wait(PLACE, peer, 1))
            ops.append(Place(PLACE, tuple(
                (wl.local_entry(local_half, lp, local, m, entry), layout.rank_of(m, lp),
                 tag(layout.rank_of(m, lp)))
                for m in range(first, first + count)
            ), entry))  # fmt: skip
        return ops

    ops: list[Op] = [PackOwn(MAIN, wl.rail(rail_half, node, entry), entry, tag(rank)),
                     Fork(MAIN, PUT), Fork(MAIN, FAN), Fork(MAIN, PLACE)]  # fmt: skip
    ops += fan_out(node, 1)
    ops.append(Place(PLACE, ((wl.rail(rail_half, node, entry), rank, tag(rank)),), entry))
    ops += arrivals(node, 1)
    for send_peer, recv_peer, sends, recvs in _forwarded_waves(plan, pacing):
        for first, count in sends:
            ops.append(Put(PUT, wl.rail(rail_half, first, entry), count * entry, send_peer,
                           wl.rail(rail_half, first, entry), run_tags(first, count)))  # fmt: skip
        if recvs:
            ops.append(Wait(PUT, recv_peer, len(recvs)))
            if peers:  # forwarded on ``fan`` while ``put`` moves the next wave
                ops.append(Fork(PUT, FAN))
        for first, count in recvs:
            ops += fan_out(first, count)
        if recvs:
            ops.append(Fork(PUT, PLACE))
            ops.append(Place(PLACE, tuple(
                (wl.rail(rail_half, m, entry), layout.rank_of(m, local),
                 tag(layout.rank_of(m, local)))
                for first, count in recvs for m in range(first, first + count)
            ), entry))  # fmt: skip
        for first, count in recvs:
            ops += arrivals(first, count)
    ops += [Fork(PUT, MAIN), Fork(FAN, MAIN), Fork(PLACE, MAIN)]
    return ops


SEGMENT_ALIGN = 256  # bytes: where a node block is cut between two local indices


def cross_node_segments(shard_bytes: tuple[int, ...], lws: int) -> list[tuple[tuple[int, int, int], ...]]:
    """Which bytes of the node blocks each local index moves across nodes in place: per local
    index ``l``, ``(parameter, first byte, end byte)`` ranges of the parameter's node block
    (its ``lws`` consecutive shards, ``lws * shard_bytes[i]`` bytes). The node blocks of the
    group's parameters, laid end to end, are cut into ``lws`` runs of equal bytes (each cut
    moved down to a multiple of :data:`SEGMENT_ALIGN` inside its block): balanced NIC bytes
    per rank whatever the shard sizes (a cut at shard boundaries left one local index with
    1.29x the mean for Qwen3's expert shards), and a parameter a rank owns whole is ONE
    contiguous range across any run of nodes (FSDP2's layout: the ranks of a node, and of
    consecutive nodes, are consecutive), so its cross-node puts and its forwards are one each
    per run of nodes; at most two cut parameters per rank take one range per node."""
    blocks = [lws * n for n in shard_bytes]
    total = sum(blocks)
    owned: list[list[tuple[int, int, int]]] = [[] for _ in range(lws)]
    starts, cum = [], 0
    for block in blocks:
        starts.append(cum)
        cum += block
    # the global cut of local index k (k = 1 .. lws - 1), aligned inside the block it falls in
    cuts = [0]
    for k in range(1, lws):
        at = k * total // lws
        i = max((j for j, b in enumerate(blocks) if b and starts[j] <= at), default=0)
        inside = min(at - starts[i], blocks[i]) // SEGMENT_ALIGN * SEGMENT_ALIGN
        cuts.append(max(cuts[-1], starts[i] + inside))
    cuts.append(total)
    for i, block in enumerate(blocks):
        for index in range(lws):
            first = max(cuts[index], starts[i]) - starts[i]
            end = min(cuts[index + 1], starts[i] + block) - starts[i]
            if first < end:
                owned[index].append((i, first, end))
    return [tuple(o) for o in owned]


def _block_pieces(segments: tuple[tuple[int, int, int], ...], node_runs: list[tuple[int, int]],
                  block_bytes: tuple[int, ...]) -> list[tuple[int, int, int]]:  # fmt: skip
    """The contiguous ranges of ``segments`` over ``node_runs`` as ``(parameter, first byte,
    bytes)`` in the parameter's storage: a whole node block over a run of nodes is one range,
    a part of it one range per node."""
    pieces = []
    for i, a, b in segments:
        block = block_bytes[i]
        for first, count in node_runs:
            if (a, b) == (0, block):
                pieces.append((i, first * block, count * block))
            else:
                pieces += [(i, m * block + a, b - a) for m in range(first, first + count)]
    return pieces


def _paced(pieces: list, pacing: int) -> list[list]:
    """Waves of at most ``pacing`` puts (``pacing`` <= 0: one wave)."""
    if pacing <= 0:
        return [pieces] if pieces else []
    return [pieces[i : i + pacing] for i in range(0, len(pieces), pacing)]


def in_place_writers(layout: WorldLayout, rank: int, exchanges: tuple) -> tuple[int, ...]:
    """Group ranks that put into ``rank``'s arena in an in-place all-gather: its local peers
    and the rail peers it receives from (they wait for its credits before they write)."""
    node, local = layout.node_of(rank), layout.local_of(rank)
    local_peers = {layout.rank_of(node, lp) for lp in range(layout.local_world_size) if lp != local}
    return tuple(sorted(local_peers | {ex.recv_peer for ex in exchanges}))


def ag_in_place_ops(
    plan: GroupPlan, param_offsets: tuple[int, ...], shard_bytes: tuple[int, ...],
    start: int, credit: int, credits_seen: dict[int, int], ag_index: int, pacing: int = 0,
) -> tuple[list[Op], dict[int, int]]:  # fmt: skip
    """One all-gather of ``plan`` (cross-node exchanges only) straight into the parameters'
    storage at arena byte ``start``, at any layout ``N x L``: parameter ``i`` at ``start +
    param_offsets[i]``, group rank ``r``'s shard of it ``shard_bytes[i]`` bytes at ``r *
    shard_bytes[i]`` from there (FSDP2's all-gather output layout). The own shards are already
    there (cast by the caller on ``main``). No pack, no placement copy:

    1. ``fan``: the own shard of every parameter put to each local peer, same offsets;
    2. ``put``: once the local peers' shards arrived (the node block is whole), per
       cross-node exchange (recursive doubling among rail peers, the direct exchange when
       ``N`` is no power of two) and wave of at most ``pacing`` puts: the shards this local
       index moves (:func:`cross_node_segments`) over the runs of nodes it holds, one put per
       contiguous range, into the rail peer's arena; then a wait for the peer's wave;
    3. ``fan``: each arrived range forwarded to every local peer, arena to arena, while
       ``put`` goes on with the next wave (its own stream: the fan-out and the network
       overlap); at the end, a wait for what the local peers forwarded.

    Signals to a local peer go on ``fan`` only, to a rail peer on ``put`` only (each peer
    sees a rank's signals in issue order). ``credit``: the release number the range waits
    for (``window_arena``), waited per peer before the first put to it; ``credits_seen``:
    credits already waited for per peer. Returns the ops and the new ``credits_seen``."""
    layout: WorldLayout = plan.layout
    rank, lws = plan.rank, layout.local_world_size
    node, local = layout.node_of(rank), layout.local_of(rank)
    seen = dict(credits_seen)
    live = tuple(i for i, n in enumerate(shard_bytes) if n)
    segments = cross_node_segments(shard_bytes, lws)
    block_bytes = tuple(lws * n for n in shard_bytes)
    local_peers = [layout.rank_of(node, lp) for lp in range(lws) if lp != local]

    def put(stream: str, peer: int, i: int, first: int, nbytes: int) -> Put:
        """A put of bytes ``[first, first + nbytes)`` of parameter ``i``, tagged per shard it
        covers (a cut range covers parts of shards: ``piece_bytes``)."""
        at = start + param_offsets[i] + first
        tags, pieces, byte = [], [], first
        while byte < first + nbytes:
            shard = byte // shard_bytes[i]
            end = min((shard + 1) * shard_bytes[i], first + nbytes)
            tags.append(("ag", ag_index, shard, i))
            pieces.append(end - byte)
            byte = end
        return Put(stream, at, nbytes, peer, at, tuple(tags), piece_bytes=tuple(pieces))

    def credited(stream: str, peer: int) -> list[Op]:
        if credit <= seen.get(peer, 0):
            return []
        wait = Wait(stream, peer, credit - seen.get(peer, 0), "ag_credit")
        seen[peer] = credit
        return [wait]

    ops: list[Op] = [Fork(MAIN, PUT)]
    if local_peers:
        ops.append(Fork(MAIN, FAN))
    for peer in local_peers:  # 1. the own shards to the node
        ops += credited(FAN, peer)
        ops += [put(FAN, peer, i, rank * shard_bytes[i], shard_bytes[i]) for i in live]
    if live:  # the node block must be whole before its shards cross nodes
        ops += [Wait(PUT, peer, len(live)) for peer in local_peers]
    forwarded = {lp: 0 for lp in range(lws) if lp != local}  # puts each local index forwards
    for ex in plan.exchanges:
        if ex.phase != "cross_node":
            raise ValueError("the window all-gather takes a plan of cross-node exchanges only")
        send_runs = entry_runs([layout.node_of(r) for r in ex.send_ranks])
        recv_runs = entry_runs([layout.node_of(r) for r in ex.recv_ranks])
        sends = _paced(_block_pieces(segments[local], send_runs, block_bytes), pacing)
        recvs = _paced(_block_pieces(segments[local], recv_runs, block_bytes), pacing)
        if ex.send_peer != ex.recv_peer and len(sends) != len(recvs):
            raise AssertionError("direct exchange: send and receive waves differ")
        for lp in forwarded:
            forwarded[lp] += len(_block_pieces(segments[lp], recv_runs, block_bytes))
        for wave in range(max(len(sends), len(recvs))):
            if wave < len(sends):
                ops += credited(PUT, ex.send_peer)
                ops += [put(PUT, ex.send_peer, *piece) for piece in sends[wave]]
            if wave < len(recvs):
                ops.append(Wait(PUT, ex.recv_peer, len(recvs[wave])))
                if local_peers:  # 3. forwarded to the node while ``put`` goes on
                    ops.append(Fork(PUT, FAN))
                    ops += [put(FAN, peer, *piece) for piece in recvs[wave]
                            for peer in local_peers]  # fmt: skip
    for lp, count in forwarded.items():
        if count:
            ops.append(Wait(FAN, layout.rank_of(node, lp), count))
    ops.append(Fork(PUT, MAIN))
    if local_peers:
        ops.append(Fork(FAN, MAIN))
    return ops, seen


def rs_round_ops(
    wl: WindowLayout, layout: WorldLayout, rank: int, rnd: RSRound, pushes: tuple[RSSlice, ...],
    row_numel: int, itemsize: int, round_index: int,
) -> list[Op]:  # fmt: skip
    """One node-local TIDE-RS round (``plan.rs_schedule``) as this rank's ops: the pack of
    its ``pushes`` (the own slice into its own row, the others into send rows), one put per
    peer's row, bare signals to the local peers it does not put to, one wait per local peer,
    then the sum of the ``len(rnd.recvs)`` received rows (``row_numel`` elements of
    ``itemsize`` bytes) into the target."""
    node, local, lws = layout.node_of(rank), layout.local_of(rank), layout.local_world_size
    half = round_index % 2
    row_bytes = row_numel * itemsize
    if max(len(rnd.recvs), len(rnd.sends)) * row_bytes > wl.rs_area_bytes:
        raise AssertionError(
            f"TIDE-RS round of {len(rnd.recvs)} x {row_bytes} B > the window's "
            f"{wl.rs_area_bytes} B of rows"
        )
    send_index = {peer: i for i, (peer, _) in enumerate(p for p in rnd.sends if p[0] != local)}
    row_of = dict(rnd.sends)

    def tag(src_local: int, dst_local: int) -> tuple:
        return ("rs", round_index, layout.rank_of(node, src_local),
                layout.rank_of(rnd.chunk_node, dst_local))  # fmt: skip

    def row_start(peer: int) -> int:
        if peer == local:
            return wl.rs_row(half, row_of[peer], row_bytes)
        return wl.send_row(send_index[peer], row_bytes)

    dsts = tuple(row_start(p.peer) + p.dst_offset * itemsize for p in pushes)
    rows = tuple((row_start(peer), row_bytes, tag(local, peer)) for peer, _ in rnd.sends)
    ops: list[Op] = [PackSlices(MAIN, tuple(pushes), dsts, rows), Fork(MAIN, FAN)]
    sent_to = set()
    for peer, row in rnd.sends:
        if peer == local:
            continue
        sent_to.add(peer)
        ops.append(Put(FAN, wl.send_row(send_index[peer], row_bytes), row_bytes,
                       layout.rank_of(node, peer), wl.rs_row(half, row, row_bytes),
                       (tag(local, peer),)))  # fmt: skip
    for lp in range(lws):
        if lp != local and lp not in sent_to:
            ops.append(Signal(FAN, layout.rank_of(node, lp)))
    for lp in range(lws):
        if lp != local:
            ops.append(Wait(FAN, layout.rank_of(node, lp), 1))
    ops.append(Fork(FAN, MAIN))
    recv_tags = [None] * len(rnd.recvs)
    for peer, row in rnd.recvs:
        recv_tags[row] = tag(peer, local)
    ops.append(Accumulate(MAIN, wl.rs_row(half, 0, row_bytes), len(rnd.recvs), row_bytes,
                          tuple(recv_tags)))  # fmt: skip
    return ops


# ---------------------------------------------------------------- TIDE-RS phase 2
#
# The cross-node partials (reduce_scatter: one per other node's chunk) over puts into a
# ring of ``slots`` receive regions that does not grow with the node count. Every rank runs
# the same steps in the same order (each reduce with a cross-node phase: steps 1 .. N - 1),
# so step ``g`` (counted over the whole run) lands in region ``g % slots`` of its receiver.
# A sender reuses a region only after the receiver says it summed what it held: after the
# sum of step ``g`` the receiver signals the rank that will put into that region at step
# ``g + slots`` (its sender then). Those credits travel on a communicator of their own
# (``comm = "credit"``), so each communicator's signals from a peer are of one kind and
# waited in the order they were sent. Window of phase 2: ``slots`` send regions (the fp32
# partial ring of ``reduce_scatter.RSBuffers``), ``slots`` receive regions, and one wire
# region where partials are rounded to a narrower wire dtype.


@dataclass(frozen=True)
class RingLayout:
    """Phase 2's window: ``slots`` send regions, ``slots`` receive regions, ``wire`` (0 or 1)
    wire region, each ``region_bytes`` (256-byte aligned)."""

    slots: int
    region_bytes: int
    wire: int

    def send(self, k: int) -> int:
        return k * self.region_bytes

    def recv(self, k: int) -> int:
        return (self.slots + k) * self.region_bytes

    @property
    def wire_start(self) -> int:
        if not self.wire:
            raise ValueError("this ring has no wire region (the wire dtype is fp32)")
        return 2 * self.slots * self.region_bytes

    @property
    def total_bytes(self) -> int:
        return (2 * self.slots + self.wire) * self.region_bytes


def ring_layout(slots: int, shard_bytes: int, wire: bool) -> RingLayout:
    """The phase-2 window for partials of at most ``shard_bytes`` (fp32)."""
    if slots < 1:
        raise ValueError(f"a ring needs at least one slot, got {slots}")
    return RingLayout(slots, _align(max(shard_bytes, 1)), int(wire))


def ring_step_ops(
    rl: RingLayout, layout: WorldLayout, rank: int, step_index: int, src: int, nbytes: int,
    piece_bytes: int = RS_PIECE_BYTES,
) -> list[Op]:  # fmt: skip
    """Phase-2 step ``step_index`` (counted over the run) of ``rank`` as ops on the ``ring``
    stream: wait for the receiver's credit (from the second lap of the ring on), put the
    ``nbytes`` partial at own byte ``src`` into the receiver's region in pieces of at most
    ``piece_bytes``, wait for this rank's partial (as many pieces), sum it (``Accumulate``
    of one row), credit the rank that puts into that region next (``slots`` steps later).

    The NIC rule (one NIC per GPU carries TIDE-AG's cross-node puts and phase 2's): before
    each piece the ring waits for everything issued so far on TIDE-AG's ``put`` stream
    (``Fork(PUT, RING)``): an all-gather issued before the piece goes first (the next layer
    waits on it, the gradient does not), and one issued after waits behind at most the piece
    in flight. Every rank puts pieces of one size, so every receiver waits for as many."""
    num_nodes = layout.num_nodes
    if num_nodes < 2:
        raise ValueError("phase 2 needs more than one node")
    if piece_bytes < 1:
        raise ValueError(f"phase-2 pieces of {piece_bytes} B")
    steps = num_nodes - 1
    node, local = layout.node_of(rank), layout.local_of(rank)

    def offset(g: int) -> int:
        return g % steps + 1

    s = offset(step_index)
    send_peer = layout.rank_of((node + s) % num_nodes, local)
    recv_peer = layout.rank_of((node - s) % num_nodes, local)
    later = step_index + rl.slots
    next_sender = layout.rank_of((node - offset(later)) % num_nodes, local)
    region = step_index % rl.slots
    if nbytes > rl.region_bytes:
        raise AssertionError(f"partial of {nbytes} B > region of {rl.region_bytes} B")
    ops: list[Op] = []
    if step_index >= rl.slots:
        ops.append(Wait(RING, send_peer, 1, comm="credit"))
    pieces = range(0, nbytes, piece_bytes) if nbytes else range(1)
    for at in pieces:
        ops += [Fork(PUT, RING),
                Put(RING, src + at, min(piece_bytes, nbytes - at), send_peer, rl.recv(region) + at,
                    (("p2", step_index, rank),), "data")]  # fmt: skip
    ops += [
        Wait(RING, recv_peer, len(pieces), comm="data"),
        Accumulate(RING, rl.recv(region), 1, nbytes, (("p2", step_index, recv_peer),)),
        Signal(RING, next_sender, comm="credit"),
    ]
    return ops
