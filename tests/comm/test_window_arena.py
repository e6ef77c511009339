"""TIDE-AG in place at any layout N nodes x L ranks: the arena allocator
(``comm/plans/window_arena.py``) and the in-place rounds (``window_rounds.ag_in_place_ops``) of
every rank over a forward / backward-like sequence of unshards, reshards and TIDE-RS rounds,
replayed against the checker of reads, writes and signals (``_window_replay.py``). The replay
models what ``transports/windows/transport.py`` issues: the own shards cast on ``main`` (after
the own release events), the puts and waits (node-local on ``fan``, cross-node on ``put``), the
compute stream reading every parameter and poisoning the range at reshard, the credits sent
on the credit stream to every writer; an all-gather that finds the arena full takes the
placement path (``ag_round_ops`` on the same window), and TIDE-RS rounds share its local
area. Pure Python."""

from __future__ import annotations

import pytest
from _window_replay import Replay, ReplayError

from torchtitan_tide.comm.plans import window_rounds
from torchtitan_tide.comm.plans.plan import (
    ParamSpec,
    WorldLayout,
    build_group_plan,
    build_rs_plan,
    packed_entry,
)
from torchtitan_tide.comm.plans.window_arena import ARENA_ALIGN, WindowArena, aligned
from torchtitan_tide.comm.plans.window_rounds import (
    SEGMENT_ALIGN,
    Fork,
    PackOwn,
    Place,
    Put,
    Signal,
    Wait,
    ag_in_place_ops,
    ag_round_ops,
    cross_node_segments,
    in_place_writers,
    rs_round_ops,
    window_layout,
)

# padded shard numels per parameter (bf16), groups of different sizes
GROUPS = {"embed": [96], "block0": [40, 8, 3], "block1": [40, 8, 3], "norm": [5, 1]}
ITEMSIZE = 2
FORWARD = ["embed", "block0", "block1", "norm"]


def test_first_fit_coalesces_and_keeps_the_larger_credit():
    arena = WindowArena(1024, 4 * ARENA_ALIGN)
    a, b, c = arena.take(10), arena.take(ARENA_ALIGN + 1), arena.take(ARENA_ALIGN)
    assert (a.start, b.start, c.start) == (1024, 1024 + 256, 1024 + 768)
    assert (a.nbytes, b.nbytes, a.credit, a.events) == (256, 512, 0, ())
    assert arena.take(1) is None and arena.in_use == 4 * ARENA_ALIGN
    assert arena.give(b.start, ARENA_ALIGN + 1, "ev-b", "s0") == 1
    assert arena.give(a.start, 10, "ev-a", "s0") == 2
    # a and b merged: the larger release number, the latest event per stream
    merged = arena.take(3 * ARENA_ALIGN)
    assert (merged.start, merged.credit, merged.events) == (1024, 2, ("ev-a",))
    assert arena.take(1) is None
    arena.give(merged.start, 3 * ARENA_ALIGN, "ev-m", "s0")  # covers ev-a (same stream)
    arena.give(c.start, ARENA_ALIGN, "ev-c", "s1")
    whole = arena.take(4 * ARENA_ALIGN)
    assert whole.credit == 4 and sorted(whole.events) == ["ev-c", "ev-m"]
    assert arena.in_use == 4 * ARENA_ALIGN


def test_a_split_range_keeps_its_credit():
    arena = WindowArena(0, 2 * ARENA_ALIGN)
    whole = arena.take(2 * ARENA_ALIGN)
    arena.give(whole.start, whole.nbytes, "ev", "s")
    first, second = arena.take(1), arena.take(1)
    assert (first.credit, second.credit) == (1, 1)
    assert (first.start, second.start) == (0, ARENA_ALIGN)


def test_untake_restores_the_range_as_it_was():
    """A bind refused before any write gives its range back as it was taken: not a release
    (no new credit number), its credit and events kept, merged with its neighbours."""
    arena = WindowArena(0, 4 * ARENA_ALIGN)
    first = arena.take(2 * ARENA_ALIGN)
    arena.give(first.start, first.nbytes, "ev", "s")
    taken = arena.take(ARENA_ALIGN)
    assert (taken.credit, taken.events) == (1, ("ev",))
    arena.untake(taken)
    assert arena.in_use == 0 and arena.releases == 1
    again = arena.take(4 * ARENA_ALIGN)
    assert (again.start, again.credit, again.events) == (0, 1, ("ev",))


def test_bad_ranges_are_named():
    with pytest.raises(ValueError, match="aligned"):
        WindowArena(100, 1024)
    arena = WindowArena(0, 1024)
    taken = arena.take(256)
    with pytest.raises(ValueError, match="not in this arena"):
        arena.give(1024, 256)
    arena.give(taken.start, 256)
    with pytest.raises(ValueError, match="already free"):
        arena.give(taken.start, 256)
    assert aligned(0) == 0 and aligned(1) == ARENA_ALIGN and aligned(256) == 256
    assert WindowArena(0, 0).take(1) is None


def _schedule(prefetch: bool, reduce: bool = False) -> list[tuple[str, str]]:
    """("unshard" | "reshard" | "reduce", group) of a forward then backward in FSDP2's
    order (``reduce``: each group's TIDE-RS after its backward reshard)."""
    events = []
    for backward, order in enumerate((FORWARD, FORWARD[::-1])):
        held = []
        for name in order:
            events.append(("unshard", name))
            held.append(name)
            if len(held) > (2 if prefetch else 1):
                gone = held.pop(0)
                events.append(("reshard", gone))
                if backward and reduce:
                    events.append(("reduce", gone))
        for name in held:
            events.append(("reshard", name))
            if backward and reduce:
                events.append(("reduce", name))
    return events


def _specs(name: str) -> list[ParamSpec]:
    return [ParamSpec(f"{name}.{i}", s, "torch.bfloat16") for i, s in enumerate(GROUPS[name])]


def in_place_programs(nodes: int, arena_groups: int, prefetch: bool, steps: int = 2,
                      credits: bool = True, poison: bool = True, lws: int = 1,
                      pacing: int = 0, reduce: bool = False, rows: int = 2):  # fmt: skip
    """Every rank's ops for ``steps`` forward/backward passes at ``nodes x lws``;
    ``arena_groups``: the arena holds that many of the largest groups; an all-gather that finds
    it full places (``ag_round_ops``); ``reduce``: TIDE-RS rounds after each backward reshard.
    Returns the programs, the window bytes and how many all-gathers went in place."""
    layout = WorldLayout(nodes * lws, lws)
    world = layout.world_size
    sizes = {name: [aligned(s * world * ITEMSIZE) for s in shards]
             for name, shards in GROUPS.items()}  # fmt: skip
    arena_bytes = sum(sorted((sum(v) for v in sizes.values()), reverse=True)[:arena_groups])
    packings = {name: packed_entry(build_group_plan(_specs(name), layout, 0).params,
                                   [ITEMSIZE] * len(shards))
                for name, shards in GROUPS.items()}  # fmt: skip
    row_bytes = max(sum(s) for s in GROUPS.values()) * ITEMSIZE
    wl = window_layout(nodes, lws, max(p.entry_bytes for p in packings.values()),
                       min(rows, lws) * row_bytes if reduce else 0, True, arena_bytes)  # fmt: skip
    programs, in_place = [], 0
    for rank in range(world):
        arena = WindowArena(wl.arena_base, wl.arena_bytes)
        ops, seen, ag_index, placed, round_index, held = [], {}, 0, 0, 0, {}
        for _ in range(steps):
            for kind, name in _schedule(prefetch, reduce):
                shards = GROUPS[name]
                if kind == "reduce":
                    rs = build_rs_plan(layout, rank, rows, [s * world for s in shards], shards)
                    for chunk in rs.chunks:
                        for rnd, pushes in zip(chunk.rounds, chunk.pushes):
                            ops += rs_round_ops(wl, layout, rank, rnd, pushes, rs.shard_numel,
                                                ITEMSIZE, round_index)  # fmt: skip
                            round_index += 1
                    continue
                if kind == "reshard":
                    if name not in held:
                        continue  # went the placement path
                    start, nbytes, writers = held.pop(name)
                    if poison:
                        ops.append(PackOwn("compute", start, nbytes, ("poison",)))
                    arena.give(start, nbytes, "release", "compute")
                    ops.append(Fork("compute", "credit"))
                    if credits:
                        ops += [Signal("credit", w, "ag_credit") for w in writers]
                    continue
                plan = build_group_plan(_specs(name), layout, rank, pull_local=True,
                                        pacing=pacing)  # fmt: skip
                offsets = [sum(sizes[name][:i]) for i in range(len(shards))]
                taken = arena.take(sum(sizes[name]))
                if taken is None:  # the arena is full: the placement path
                    ops += ag_round_ops(wl, plan, packings[name], placed, round_index, pacing)
                    placed += 1
                    round_index += 1
                    continue
                shard_bytes = tuple(s * ITEMSIZE for s in shards)
                if taken.events:
                    ops.append(Fork("compute", "main"))
                ops += [PackOwn("main", taken.start + off + rank * n, n, ("ag", ag_index, rank, i))
                        for i, (off, n) in enumerate(zip(offsets, shard_bytes))]  # fmt: skip
                credit = taken.credit if credits else 0
                round_ops, seen = ag_in_place_ops(plan, tuple(offsets), shard_bytes, taken.start,
                                                  credit, seen, ag_index, pacing)  # fmt: skip
                ops += round_ops + [Fork("main", "compute")]
                for i, (off, n) in enumerate(zip(offsets, shard_bytes)):  # compute reads all
                    entries = tuple((taken.start + off + r * n, r, ("ag", ag_index, r, i))
                                    for r in range(world))  # fmt: skip
                    ops.append(Place("compute", entries, n))
                held[name] = (taken.start, taken.nbytes,
                              in_place_writers(layout, rank, plan.exchanges))
                ag_index += 1
        programs.append(ops)
        in_place = ag_index
    return programs, max(wl.total_bytes, ARENA_ALIGN), in_place


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 6, 7, 8])
def test_in_place_rounds_replay_without_race_or_deadlock(nodes):
    for arena_groups in (1, 2, 4):
        for prefetch in (False, True):
            programs, nbytes, in_place = in_place_programs(nodes, arena_groups, prefetch)
            assert in_place > 0
            # the credits of the last releases are sent and never needed
            assert Replay(programs, nbytes).run(all_waited=False) > 0


@pytest.fixture(params=[2, 256], ids=["cut-anywhere", "cut-256"])
def segment_align(request, monkeypatch):
    """Cuts between local indices every 2 bytes (inside these small shards: ranges that end
    mid-shard) or at the transport's 256 (here mostly at block edges)."""
    monkeypatch.setattr(window_rounds, "SEGMENT_ALIGN", request.param)
    return request.param


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("lws", [2, 4])
def test_in_place_at_n_by_l_replays_with_placement_and_reduces(nodes, lws, segment_align):
    """In place at N x L, mixed with the placement path (an arena of 1 or 2 groups runs full
    whenever more are unsharded) and TIDE-RS rounds on the same window, paced and not."""
    for arena_groups, prefetch, pacing in ((1, True, 0), (2, False, 1), (4, True, 2)):
        programs, nbytes, in_place = in_place_programs(
            nodes, arena_groups, prefetch, lws=lws, pacing=pacing, reduce=True)  # fmt: skip
        assert in_place > 0
        assert Replay(programs, nbytes).run(all_waited=False) > 0


def _in_place_round(layout: WorldLayout, rank: int, pacing: int, shards: list[int]):
    plan = build_group_plan([ParamSpec(f"p{i}", s, "torch.bfloat16") for i, s in enumerate(shards)],
                            layout, rank, pull_local=True, pacing=pacing)  # fmt: skip
    shard_bytes = tuple(ITEMSIZE * s for s in shards)
    offsets = tuple(sum(aligned(layout.world_size * n) for n in shard_bytes[:i])
                    for i in range(len(shards)))  # fmt: skip
    ops, _ = ag_in_place_ops(plan, offsets, shard_bytes, 0, 0, {}, 0, pacing)
    return ops


@pytest.mark.parametrize("lws", [1, 2, 4, 8])
def test_puts_and_waits_match_for_every_pair(lws, segment_align):
    """Per all-gather, what each rank waits for from a peer is what that peer puts to it, and
    every rank receives every other rank's shard of every parameter exactly once; node-local
    signals go on ``fan``, cross-node ones on ``put``."""
    shards = GROUPS["block0"]
    for nodes in range(2, 9):
        layout = WorldLayout(nodes * lws, lws)
        for pacing in (0, 2):
            puts, waits, received = {}, {}, {}
            for rank in range(layout.world_size):
                for op in _in_place_round(layout, rank, pacing, shards):
                    if isinstance(op, Wait):
                        waits[(op.peer, rank)] = waits.get((op.peer, rank), 0) + op.count
                    elif isinstance(op, Put):
                        puts[(rank, op.peer)] = puts.get((rank, op.peer), 0) + 1
                        got = received.setdefault(op.peer, {})
                        sizes = op.piece_bytes or (op.nbytes // len(op.tags),) * len(op.tags)
                        for tag, size in zip(op.tags, sizes):  # a cut range: parts of shards
                            got[tag] = got.get(tag, 0) + size
                        same_node = layout.node_of(op.peer) == layout.node_of(rank)
                        assert op.stream == ("fan" if same_node else "put"), op
            assert puts == waits, (nodes, lws, pacing)
            for rank in range(layout.world_size):
                expected = {("ag", 0, r, i): ITEMSIZE * s for r in range(layout.world_size)
                            if r != rank for i, s in enumerate(shards)}  # fmt: skip
                assert received[rank] == expected, (nodes, lws, rank)


def test_copy_engine_operations_grow_with_parameters_times_peers():
    """Consecutive ranks' shards of a parameter are one range: the puts a rank issues per
    all-gather grow with parameters x peers (local + rail), not parameters x ranks."""
    # a Llama-3.1-70B block's 9 parameters (shard numels at 64 GPUs / 1000), and equal ones
    for shards in ([3670, 3670, 3670, 1049, 1049, 131, 131, 1, 1], [64] * 9):
        params = len(shards)
        for nodes, lws in ((2, 2), (2, 4), (2, 8), (4, 8), (8, 8)):
            layout = WorldLayout(nodes * lws, lws)
            puts = max(sum(isinstance(op, Put) for op in _in_place_round(layout, r, 0, shards))
                       for r in range(layout.world_size))  # fmt: skip
            rail_steps = len(build_group_plan([ParamSpec("p", 1, "torch.bfloat16")], layout, 0,
                                              pull_local=True).exchanges)  # fmt: skip
            # own shards to the node; a parameter owned whole: one put and L - 1 forwards
            # per exchange; at most two owned in part: one put and L - 1 forwards per node
            owned = max(len(runs) for runs in cross_node_segments(tuple(shards), lws))
            bound = (params * (lws - 1) + owned * rail_steps * lws + 2 * (nodes - 1) * lws)
            assert puts <= bound, (nodes, lws, puts, bound)
            assert puts < params * (layout.world_size - 1), (nodes, lws, puts)


def test_cross_node_segments_balance_bytes():
    """Every byte of every node block belongs to exactly one local index, in one contiguous
    range per parameter; the bytes each moves differ by at most one cut's alignment per cut
    (a cut at shard boundaries left Qwen3's expert shards 1.29x the mean); a parameter
    owned whole is one range."""
    for shard_bytes in ((100, 8, 8, 300, 2), (64,) * 9, (6,), (10, 0, 10),
                        (6 << 20, 6 << 20, 1 << 10, 96)):  # fmt: skip
        for lws in (1, 2, 3, 4, 8):
            segments = cross_node_segments(shard_bytes, lws)
            for i, n in enumerate(shard_bytes):
                ranges = sorted((a, b) for runs in segments for j, a, b in runs if j == i)
                covered = [b for a, b in ranges]
                assert [a for a, _ in ranges] == [0, *covered[:-1]] if n else not ranges, (
                    shard_bytes, lws, i, ranges)  # fmt: skip
                assert not n or covered[-1] == lws * n
            loads = [sum(b - a for _, a, b in runs) for runs in segments]
            assert max(loads) - min(loads) <= 2 * SEGMENT_ALIGN, (shard_bytes, lws, loads)
            assert all(len({i for i, _, _ in runs}) == len(runs) for runs in segments)


def test_replay_finds_missing_credits():
    """Without waiting for the peer's release, a put can overwrite a range the peer still
    reads (its compute) or poisons: the checker must see the race."""
    programs, nbytes, _ = in_place_programs(4, 1, prefetch=False, credits=False)
    with pytest.raises(ReplayError, match="race"):
        Replay(programs, nbytes).run(all_waited=False)
    programs, nbytes, _ = in_place_programs(2, 2, prefetch=True, credits=False, lws=2)
    with pytest.raises(ReplayError, match="race"):
        Replay(programs, nbytes).run(all_waited=False)
