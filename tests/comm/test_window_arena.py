"""TIDE-AG in place at one rank per node: the arena allocator (``comm/window_arena.py``) and
the in-place rounds (``window_rounds.ag_in_place_ops``) of every rank over a forward /
backward-like sequence of unshards and reshards, replayed against the checker of reads,
writes and signals (``_window_replay.py``). The replay models what ``transport/windows.py``
issues: the own shards cast on ``main`` (after the own release events), the puts and waits,
the compute stream reading every parameter and poisoning the range at reshard, and the
credits sent on the credit stream to every writer. Pure Python."""

from __future__ import annotations

import pytest
from _window_replay import Replay, ReplayError

from torchtitan_tide.comm.plan import ParamSpec, WorldLayout, build_group_plan
from torchtitan_tide.comm.window_arena import ARENA_ALIGN, WindowArena, aligned
from torchtitan_tide.comm.window_rounds import (
    Fork,
    PackOwn,
    Place,
    Put,
    Signal,
    Wait,
    ag_in_place_ops,
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


def _schedule(prefetch: bool) -> list[tuple[str, str]]:
    """("unshard" | "reshard", group) of a forward then backward in FSDP2's order."""
    events = []
    for order in (FORWARD, FORWARD[::-1]):
        held = []
        for name in order:
            events.append(("unshard", name))
            held.append(name)
            if len(held) > (2 if prefetch else 1):
                events.append(("reshard", held.pop(0)))
        events += [("reshard", name) for name in held]
    return events


def in_place_programs(nodes: int, arena_groups: int, prefetch: bool, steps: int = 2,
                      credits: bool = True, poison: bool = True):  # fmt: skip
    """Every rank's ops for ``steps`` forward/backward passes; ``arena_groups``: the arena
    holds that many of the largest groups. Returns the programs, the window bytes and how
    many all-gathers went in place (the rest found the arena full: the placement path,
    replayed by test_window_rounds_cpu)."""
    layout = WorldLayout(nodes, 1)
    sizes = {name: [aligned(s * nodes * ITEMSIZE) for s in shards]
             for name, shards in GROUPS.items()}  # fmt: skip
    arena_bytes = sum(sorted((sum(v) for v in sizes.values()), reverse=True)[:arena_groups])
    programs, in_place = [], 0
    for rank in range(nodes):
        arena = WindowArena(0, arena_bytes)
        ops, seen, ag_index, held = [], {}, 0, {}
        for _ in range(steps):
            for kind, name in _schedule(prefetch):
                shards = GROUPS[name]
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
                offsets = [sum(sizes[name][:i]) for i in range(len(shards))]
                taken = arena.take(sum(sizes[name]))
                if taken is None:
                    continue
                plan = build_group_plan([ParamSpec(f"{name}.{i}", s, "torch.bfloat16")
                                         for i, s in enumerate(shards)], layout, rank,
                                        pull_local=True)  # fmt: skip
                shard_bytes = tuple(s * ITEMSIZE for s in shards)
                if taken.events:
                    ops.append(Fork("compute", "main"))
                ops += [PackOwn("main", taken.start + off + rank * n, n, ("ag", ag_index, rank, i))
                        for i, (off, n) in enumerate(zip(offsets, shard_bytes))]  # fmt: skip
                credit = taken.credit if credits else 0
                round_ops, seen = ag_in_place_ops(plan, tuple(offsets), shard_bytes, taken.start,
                                                  credit, seen, ag_index)  # fmt: skip
                ops += round_ops + [Fork("main", "compute")]
                for i, (off, n) in enumerate(zip(offsets, shard_bytes)):  # compute reads all
                    entries = tuple((taken.start + off + r * n, r, ("ag", ag_index, r, i))
                                    for r in range(nodes))  # fmt: skip
                    ops.append(Place("compute", entries, n))
                writers = tuple(sorted({ex.recv_peer for ex in plan.exchanges}))
                held[name] = (taken.start, taken.nbytes, writers)
                ag_index += 1
        programs.append(ops)
        in_place = ag_index
    return programs, max(arena_bytes, ARENA_ALIGN), in_place


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 6, 7, 8])
def test_in_place_rounds_replay_without_race_or_deadlock(nodes):
    for arena_groups in (1, 2, 4):
        for prefetch in (False, True):
            programs, nbytes, in_place = in_place_programs(nodes, arena_groups, prefetch)
            assert in_place > 0
            # the credits of the last releases are sent and never needed
            assert Replay(programs, nbytes).run(all_waited=False) > 0


def test_puts_and_waits_match_for_every_pair():
    """Per all-gather, what each rank waits for from a peer is what that peer puts to it, and
    every rank receives every other rank's shard of every parameter exactly once."""
    shards = GROUPS["block0"]
    for nodes in range(2, 9):
        layout = WorldLayout(nodes, 1)
        puts, waits, received = {}, {}, {}
        for rank in range(nodes):
            plan = build_group_plan([ParamSpec(f"p{i}", s, "torch.bfloat16")
                                     for i, s in enumerate(shards)], layout, rank,
                                    pull_local=True)  # fmt: skip
            ops, _ = ag_in_place_ops(plan, (0, 256, 512), tuple(2 * s for s in shards), 0, 0,
                                     {}, 0)  # fmt: skip
            for op in ops:
                if isinstance(op, Wait):
                    waits[(op.peer, rank)] = waits.get((op.peer, rank), 0) + op.count
                elif isinstance(op, Put):
                    puts[(rank, op.peer)] = puts.get((rank, op.peer), 0) + 1
                    received.setdefault(op.peer, []).extend(op.tags)
        assert puts == waits, (nodes, puts, waits)
        for rank in range(nodes):
            expected = sorted(("ag", 0, r, i) for r in range(nodes) if r != rank
                              for i in range(len(shards)))  # fmt: skip
            assert sorted(received[rank]) == expected, (nodes, rank)


def test_replay_finds_missing_credits():
    """Without waiting for the peer's release, a put can overwrite a range the peer still
    reads (its compute) or poisons: the checker must see the race."""
    programs, nbytes, _ = in_place_programs(4, 1, prefetch=False, credits=False)
    with pytest.raises(ReplayError, match="race"):
        Replay(programs, nbytes).run(all_waited=False)
