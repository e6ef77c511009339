"""The window protocol's rounds (``comm/plans/window_rounds.py``) for every rank of N nodes x L,
replayed against a checker of reads, writes and signals (``_window_replay.py``): offsets,
parities, recursive doubling and the direct exchange (N no power of two), pacing, groups of
different sizes, TIDE-RS rounds sharing the all-gather area (Slot-Reuse) or not. Pure
Python: these are the ops the GPU transport runs."""

from __future__ import annotations

import dataclasses

import pytest
from _window_replay import Replay, ReplayError

from torchtitan_tide.comm.plans.plan import (
    ParamSpec,
    WorldLayout,
    build_group_plan,
    build_rs_plan,
    entry_runs,
    packed_entry,
)
from torchtitan_tide.comm.plans.window_rounds import (
    Fork,
    PackOwn,
    Signal,
    ag_round_ops,
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


def ring_programs(layout: WorldLayout, slots: int, reduces: int, credits: bool = True,
                  piece_bytes: int = 1 << 20):  # fmt: skip
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
            ops += [PackOwn("main", src, nbytes, ("p2", g, rank)), Fork("main", "ring")]
            step = ring_step_ops(rl, layout, rank, g, src, nbytes, piece_bytes=piece_bytes)
            if not credits:
                step = [op for op in step if getattr(op, "comm", "") != "credit"]
            ops += step + [Fork("ring", "main")]
        programs.append(ops)
    return programs, rl.total_bytes


@pytest.mark.parametrize("nodes,lws", [(2, 1), (3, 1), (4, 2), (5, 1), (8, 1), (3, 2)])
def test_phase2_ring_replays_for_any_node_count(nodes, lws):
    for slots in (1, 2, 3):
        for piece_bytes in (1 << 20, 24):  # one piece per partial, or three (64 B partials)
            programs, nbytes = ring_programs(WorldLayout(nodes * lws, lws), slots, reduces=3,
                                             piece_bytes=piece_bytes)  # fmt: skip
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


def _ag_then_reduce_programs(nodes: int, lws: int, yield_to_ag: bool):
    """Every rank's host order of a backward: an in-place all-gather (the next layer's
    prefetch) issued, then the current layer's phase-2 steps (partials of 3 pieces)."""
    from torchtitan_tide.comm.plans.window_arena import aligned
    from torchtitan_tide.comm.plans.window_rounds import Put, ag_in_place_ops

    layout = WorldLayout(nodes * lws, lws)
    shards = [512, 256]  # every local index moves bytes across nodes (256-byte cuts)
    shard_bytes = tuple(ITEMSIZE * s for s in shards)
    offsets = (0, aligned(layout.world_size * shard_bytes[0]))
    rl = ring_layout(2, 64, wire=False)
    base = 1024  # the arena after the ring's regions
    programs = []
    for rank in range(layout.world_size):
        plan = build_group_plan([ParamSpec(f"p{i}", s, "torch.bfloat16")
                                 for i, s in enumerate(shards)], layout, rank, pull_local=True)  # fmt: skip
        ops = [PackOwn("main", base + off + rank * n, n, ("ag", 0, rank, i))
               for i, (off, n) in enumerate(zip(offsets, shard_bytes))]  # fmt: skip
        ag_ops, _ = ag_in_place_ops(plan, offsets, shard_bytes, base, 0, {}, 0)
        ops += ag_ops
        for g in range(nodes - 1):
            src = rl.send(g % 2)
            ops += [PackOwn("rs", src, 64, ("p2", g, rank)), Fork("rs", "ring")]
            step = ring_step_ops(rl, layout, rank, g, src, 64, piece_bytes=24)
            if not yield_to_ag:
                step = [op for op in step if not (isinstance(op, Fork) and op.src == "put")]
            ops += step + [Fork("ring", "rs")]
        programs.append(ops)
    return programs, base + offsets[1] + layout.world_size * shard_bytes[1], Put


@pytest.mark.parametrize("nodes,lws", [(2, 1), (4, 1), (2, 2), (3, 2), (4, 4)])
def test_phase2_yields_the_nic_to_an_earlier_all_gather(nodes, lws):
    """The NIC rule, replayed: every phase-2 piece a rank puts is ordered after every
    cross-node put of the all-gather it issued before (the next layer waits on that one);
    pieces are at most ``piece_bytes``; without the rule's stream wait the order is not
    guaranteed (the check fails)."""
    for yield_to_ag, expect in ((True, True), (False, False)):
        programs, nbytes, put_type = _ag_then_reduce_programs(nodes, lws, yield_to_ag)
        replay = Replay(programs, nbytes)
        replay.run(all_waited=False)
        ordered = True
        for rank in range(nodes * lws):
            ag = [(r, st, i) for r, st, i, op, _ in replay.ran
                  if r == rank and isinstance(op, put_type) and st == "put"]  # fmt: skip
            ring = [(r, st, i, op) for r, st, i, op, _ in replay.ran
                    if r == rank and isinstance(op, put_type) and st == "ring"]  # fmt: skip
            assert ag and ring, (rank, len(ag), len(ring))
            assert all(op.nbytes <= 24 for *_, op in ring)
            ordered &= all(replay.happened_before(a, (r, st, i))
                           for a in ag for r, st, i, _ in ring)  # fmt: skip
        assert ordered == expect, (nodes, lws, yield_to_ag)


def test_every_stream_the_window_transports_run_on_is_registered():
    """Each CUDA stream the window transports name has a priority in ``streams`` (a name
    missing there raised only on a GPU: found on the H200 at 5e22c7e, ``tide_fan``)."""
    from torchtitan_tide.comm.base import streams
    from torchtitan_tide.comm.transports.windows import ring, transport

    names = {*transport._STREAMS.values(), ring.AG_PUT_STREAM, "tide_one_sided_rs",
             "tide_credit"}  # fmt: skip
    assert names <= set(streams._PRIORITIES), names - set(streams._PRIORITIES)
