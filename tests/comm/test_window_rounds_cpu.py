"""The window protocol's rounds (``comm/window_rounds.py``) for every rank of N nodes x L,
replayed against a checker of reads, writes and signals (``_window_replay.py``): offsets,
parities, recursive doubling and the direct exchange (N no power of two), pacing, groups of
different sizes, TIDE-RS rounds sharing the all-gather area (Slot-Reuse) or not. Pure
Python: these are the ops the GPU transport runs."""

from __future__ import annotations

import dataclasses

import pytest
from _window_replay import Replay, ReplayError

from torchtitan_tide.comm.plan import (
    ParamSpec,
    WorldLayout,
    build_group_plan,
    build_rs_plan,
    packed_entry,
)
from torchtitan_tide.comm.window_rounds import (
    Fork,
    PackOwn,
    Signal,
    ag_round_ops,
    entry_runs,
    paced_pieces,
    ring_layout,
    ring_step_ops,
    rs_round_ops,
    window_layout,
)

# Three FSDP groups of different sizes: padded shard numels per parameter (bf16).
GROUPS = {
    "embed": [24],
    "block": [8, 16, 5, 3],
    "norm": [1, 7],
}
ITEMSIZE = 2


def _rs_numels(shards: list[int], world: int) -> list[int]:
    # unsharded gradient numels: the last rank's shard partly padding
    return [max(1, s * world - (i % 3)) for i, s in enumerate(shards)]


def programs_for(layout: WorldLayout, events: list[tuple[str, str]], pacing: int, rows: int,
                 slot_reuse: bool = True, one_half: bool = False):  # fmt: skip
    """Every rank's ops for ``events`` (("ag" | "rs", group name)), and the window bytes.
    ``one_half``: both parities of every area at the same bytes (a broken layout)."""
    world = layout.world_size
    packings = {
        name: packed_entry(
            build_group_plan([ParamSpec(f"{name}.{i}", s, "torch.bfloat16")
                              for i, s in enumerate(shards)], layout, 0).params,
            [ITEMSIZE] * len(shards),
        )
        for name, shards in GROUPS.items()
    }
    entry = max(p.entry_bytes for p in packings.values())
    row_bytes = max(sum(s) for s in GROUPS.values()) * ITEMSIZE
    wl = window_layout(layout.num_nodes, layout.local_world_size, entry,
                       min(rows, layout.local_world_size) * row_bytes, slot_reuse)  # fmt: skip
    if one_half:
        wl = dataclasses.replace(wl, rail_half_bytes=0, local_half_bytes=0)
    programs = []
    for rank in range(world):
        ops, ag_index, round_index = [], 0, 0
        for kind, name in events:
            shards = GROUPS[name]
            if kind == "ag":
                specs = [ParamSpec(f"{name}.{i}", s, "torch.bfloat16") for i, s in enumerate(shards)]
                plan = build_group_plan(specs, layout, rank, pull_local=True, pacing=pacing)
                ops += ag_round_ops(wl, plan, packings[name], ag_index, round_index, pacing)
                ag_index += 1
                round_index += 1
                continue
            rs = build_rs_plan(layout, rank, rows, _rs_numels(shards, world), shards)
            for chunk in rs.chunks:
                for rnd, pushes in zip(chunk.rounds, chunk.pushes):
                    ops += rs_round_ops(wl, layout, rank, rnd, pushes, rs.shard_numel, ITEMSIZE,
                                        round_index)  # fmt: skip
                    round_index += 1
        programs.append(ops)
    return programs, wl.total_bytes


# A backward-like order: all-gathers, then reduces interleaved with prefetched all-gathers.
EVENTS = [("ag", "embed"), ("ag", "block"), ("ag", "norm"), ("ag", "block"), ("rs", "norm"),
          ("ag", "embed"), ("rs", "block"), ("rs", "embed"), ("ag", "block")]  # fmt: skip
LAYOUTS = [(2, 1), (3, 1), (4, 1), (5, 1), (8, 1), (1, 2), (1, 4), (2, 2), (3, 2), (2, 4),
           (4, 2), (5, 2), (6, 2), (7, 2), (8, 2), (3, 3)]  # fmt: skip


@pytest.mark.parametrize("nodes,lws", LAYOUTS)
def test_rounds_replay_without_race_or_deadlock(nodes, lws):
    layout = WorldLayout(nodes * lws, lws)
    for pacing in (0, 1, 2, 3):
        for rows in sorted({1, 2, lws}):
            programs, nbytes = programs_for(layout, EVENTS, pacing, rows)
            assert Replay(programs, nbytes).run() > 0


@pytest.mark.parametrize("nodes,lws", [(2, 2), (3, 2), (4, 2)])
def test_rs_rows_after_the_ag_area_without_slot_reuse(nodes, lws):
    programs, nbytes = programs_for(WorldLayout(nodes * lws, lws), EVENTS, 1, 2, slot_reuse=False)
    Replay(programs, nbytes).run()


def test_layout_offsets_and_sizes():
    wl = window_layout(4, 2, entry_bytes=1000, rs_area_bytes=6000)
    assert wl.rail_half_bytes == 4096 and wl.rail(1, 3, 1000) == 4096 + 3000
    # (L - 1) x N entries = 4000 B vs 6000 B of rows: the larger, shared (Slot-Reuse)
    assert wl.local_half_bytes == 6144 and wl.local_base == 8192
    assert wl.local_entry(1, src_local=1, dst_local=0, node=2, entry_bytes=1000) == (
        8192 + 6144 + 2 * 1000
    )
    assert wl.rs_row(0, 1, 3000) == 8192 + 3000 and wl.send_row(1, 3000) == 8192 + 2 * 6144 + 3000
    assert wl.total_bytes == 8192 + 2 * 6144 + 6144
    with pytest.raises(ValueError, match="no entry to itself"):
        wl.local_entry(0, 1, 1, 0, 1000)
    apart = window_layout(4, 2, 1000, 6000, slot_reuse=False)
    assert apart.rs_offset == 4096 and apart.local_half_bytes == 4096 + 6144


def test_runs_and_waves():
    assert entry_runs([3, 0, 1, 5]) == [(0, 2), (3, 1), (5, 1)]
    assert paced_pieces([(0, 4)], 0) == [[(0, 4)]]
    assert paced_pieces([(0, 4)], 3) == [[(0, 1), (1, 1), (2, 1)], [(3, 1)]]
    assert paced_pieces([], 2) == []


def _broken(programs, drop):
    return [[op for op in ops if not drop(op)] for ops in programs]


def test_replay_finds_a_missing_join():
    """Without the placement stream joining back, the next round's fan-out puts can overwrite
    entries a peer still places: the checker must see the race."""
    programs, nbytes = programs_for(WorldLayout(4, 2), EVENTS, 0, 2)
    bad = _broken(programs, lambda op: isinstance(op, Fork) and op.src == "place")
    with pytest.raises(ReplayError, match="race"):
        Replay(bad, nbytes).run()


def test_replay_finds_missing_bare_signals():
    """TIDE-RS rounds where not every local pair signals: waits hang (or race)."""
    programs, nbytes = programs_for(WorldLayout(4, 4), EVENTS, 0, 2)
    bad = _broken(programs, lambda op: isinstance(op, Signal))
    with pytest.raises(ReplayError, match="deadlock|race"):
        Replay(bad, nbytes).run()


def test_replay_finds_one_half_only():
    """Both parities on the same bytes: a peer one round ahead overwrites what this rank still
    reads. The checker must see the race."""
    programs, nbytes = programs_for(WorldLayout(4, 2), EVENTS, 0, 2, one_half=True)
    with pytest.raises(ReplayError, match="race"):
        Replay(programs, nbytes).run()


def ring_programs(layout: WorldLayout, slots: int, reduces: int, credits: bool = True):
    """Every rank's phase-2 ops over ``reduces`` reduces (N - 1 steps each); phase 1 writes
    each partial into send slot ``g % slots`` before its step, and waits for the step before
    writing that slot again (``RSBuffers``' events)."""
    nbytes = 64
    rl = ring_layout(slots, nbytes, wire=False)
    programs = []
    for rank in range(layout.world_size):
        ops = []
        for g in range(reduces * (layout.num_nodes - 1)):
            src = rl.send(g % slots)
            ops += [PackOwn("main", src, nbytes, ("p2", g, rank)), Fork("main", "put")]
            step = ring_step_ops(rl, layout, rank, g, src, nbytes)
            if not credits:
                step = [op for op in step if getattr(op, "comm", "") != "credit"]
            ops += step + [Fork("put", "main")]
        programs.append(ops)
    return programs, rl.total_bytes


@pytest.mark.parametrize("nodes,lws", [(2, 1), (3, 1), (4, 2), (5, 1), (8, 1), (3, 2)])
def test_phase2_ring_replays_for_any_node_count(nodes, lws):
    for slots in (1, 2, 3):
        programs, nbytes = ring_programs(WorldLayout(nodes * lws, lws), slots, reduces=3)
        # the credits for steps after the last are sent and never needed
        Replay(programs, nbytes).run(all_waited=False)


def test_phase2_ring_needs_its_credits():
    programs, nbytes = ring_programs(WorldLayout(5, 1), 1, reduces=3, credits=False)
    with pytest.raises(ReplayError, match="race"):
        Replay(programs, nbytes).run()


def test_ring_window_does_not_grow_with_nodes():
    assert ring_layout(2, 1000, wire=False).total_bytes == 4 * 1024
    assert ring_layout(2, 1000, wire=True).total_bytes == 5 * 1024
    with pytest.raises(ValueError, match="no wire region"):
        _ = ring_layout(2, 1000, wire=False).wire_start
