"""Unit tests of the pure-Python layout plan (no processes)."""

import itertools

import pytest

from torchtitan_tide.comm.plans.plan import (
    ParamSpec,
    WorldLayout,
    build_group_plan,
    chunks_for_ranks,
    cross_node_exchanges,
    node_local_exchanges,
    pace_chunks,
)

LAYOUTS = [(1, 2), (2, 1), (2, 2), (4, 2), (3, 2), (8, 1), (1, 8)]  # (nodes, local)


def _padded_shard(dim0: int, row_numel: int, world: int) -> int:
    """FSDP2's dim-0 padded shard numel: ceil(dim0 / world) rows."""
    return -(-dim0 // world) * row_numel


def _specs(world: int) -> list[ParamSpec]:
    shapes = [((13, 7), "torch.bfloat16"), ((1,), "torch.float32"), ((11, 6), "torch.bfloat16"),
              ((5,), "torch.float32"), ((3, 3), "torch.float16")]  # fmt: skip
    out = []
    for i, (shape, dtype) in enumerate(shapes):
        row = 1 if len(shape) == 1 else shape[1]
        out.append(ParamSpec(f"p{i}", _padded_shard(shape[0], row, world), dtype))
    return out


def _simulate(layout: WorldLayout, specs: list[ParamSpec], pacing: int = 0) -> None:
    """Run every rank's exchanges step by step on sets of held (param, rank)
    shards; check sends only use held data, receivers get exactly what their
    peer sends, and at the end every rank holds every shard."""
    W = layout.world_size
    plans = [build_group_plan(specs, layout, r, pacing=pacing) for r in range(W)]
    held = [{(p.index, r) for p in plans[r].params} for r in range(W)]
    n_steps = {len(p.exchanges) for p in plans}
    assert len(n_steps) == 1
    for step in range(n_steps.pop()):
        sent: dict[tuple[int, int], list] = {}
        for r in range(W):
            ex = plans[r].exchanges[step]
            chunks = chunks_for_ranks(plans[r].params, ex.send_ranks)
            waves = ex.send_waves  # what the transport posts
            assert [c for w in waves for c in w] == chunks
            if pacing:
                assert all(len(w) <= pacing for w in waves)
            flat = [c for w in waves for c in w]
            for c in flat:
                p = plans[r].params[c.param_index]
                assert c.offset == p.dst_offset(c.ranks[0])
                assert c.numel == p.shard_numel * len(c.ranks)
                for src in c.ranks:
                    assert (c.param_index, src) in held[r], (r, step, c)
            sent[(r, ex.send_peer)] = [[(c.param_index, c.offset, c.numel) for c in w] for w in waves]
        for r in range(W):
            ex = plans[r].exchanges[step]
            chunks = [c for w in ex.recv_waves for c in w]
            assert chunks == chunks_for_ranks(plans[r].params, ex.recv_ranks)
            recv = [[(c.param_index, c.offset, c.numel) for c in w] for w in ex.recv_waves]
            assert sent[(ex.recv_peer, r)] == recv, (r, step)  # wave i matches wave i
            for c in chunks:
                held[r] |= {(c.param_index, src) for src in c.ranks}
    for r in range(W):
        assert held[r] == {(p.index, s) for p in plans[r].params for s in range(W)}


@pytest.mark.parametrize("nodes,local", LAYOUTS)
def test_schedule_delivers_every_shard(nodes, local):
    layout = WorldLayout(nodes * local, local)
    _simulate(layout, _specs(layout.world_size))


@pytest.mark.parametrize("nodes,local,pacing", [(2, 2, 1), (4, 2, 3), (2, 1, 2)])
def test_schedule_with_pacing(nodes, local, pacing):
    layout = WorldLayout(nodes * local, local)
    _simulate(layout, _specs(layout.world_size), pacing)


def test_layout_validation():
    with pytest.raises(ValueError, match="must be >= 1 and divide"):
        WorldLayout(4, 3)
    assert WorldLayout(8, 2).num_nodes == 4
    layout = WorldLayout(8, 2)
    assert [layout.rank_of(layout.node_of(r), layout.local_of(r)) for r in range(8)] == list(
        range(8)
    )


def test_dst_offsets_rank_major_and_padded():
    # Linear(7, 13).weight on 4 ranks: ceil(13 / 4) = 4 rows of 7 -> shard 28.
    layout = WorldLayout(4, 2)
    plan = build_group_plan([ParamSpec("w", _padded_shard(13, 7, 4), "torch.bfloat16")], layout, 0)
    p = plan.params[0]
    assert p.shard_numel == 28 and p.unsharded_numel == 112
    assert [p.dst_offset(r) for r in range(4)] == [0, 28, 56, 84]
    # One-element parameter: every rank holds a padded 1-element shard.
    plan = build_group_plan([ParamSpec("g", _padded_shard(1, 1, 4), "torch.float32")], layout, 3)
    assert plan.params[0].shard_numel == 1 and plan.params[0].dst_offset(3) == 3


def test_recursive_doubling_one_chunk_per_param_when_one_rank_per_node():
    layout = WorldLayout(8, 1)
    specs = _specs(8)
    plan = build_group_plan(specs, layout, 5)
    assert [e.send_peer for e in plan.exchanges] == [4, 7, 1]
    for k, ex in enumerate(plan.exchanges):
        assert len(ex.send_ranks) == 2**k
        assert len(chunks_for_ranks(plan.params, ex.send_ranks)) == len(specs)


def test_two_by_two_strided_chunks():
    layout = WorldLayout(4, 2)  # ranks (node, local): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1)
    cross = cross_node_exchanges(layout, 1)
    assert [(e.send_peer, e.send_ranks, e.recv_ranks) for e in cross] == [(3, (1,), (3,))]
    local = node_local_exchanges(layout, 1)
    assert [(e.send_peer, e.send_ranks, e.recv_ranks) for e in local] == [(0, (1, 3), (0, 2))]
    # Ranks 0 and 2 are not adjacent: two chunks per parameter.
    chunks = chunks_for_ranks(build_group_plan(_specs(4), layout, 1).params, (0, 2))
    assert len(chunks) == 2 * 5


def test_non_power_of_two_nodes_use_direct_steps():
    layout = WorldLayout(6, 2)
    ex = cross_node_exchanges(layout, 2)  # node 1, local 0
    assert [(e.send_peer, e.recv_peer) for e in ex] == [(4, 0), (0, 4)]


def test_fallback_reasons():
    layout = WorldLayout(2, 2)
    specs = [
        ParamSpec("a", 4, "torch.float32"),
        ParamSpec("b", 4, "torch.float32", "Shard(1) placement"),
    ]
    plan = build_group_plan(specs, layout, 0)
    assert not plan.uses_tide and "b: Shard(1) placement" in plan.fallback_reason
    assert plan.exchanges == () and plan.params == ()
    assert not build_group_plan([], layout, 0).uses_tide


def test_pull_local_plan():
    layout = WorldLayout(4, 4)
    plan = build_group_plan(_specs(4), layout, 2, pull_local=True)
    assert plan.exchanges == ()


def test_mixed_dtypes_recorded():
    plan = build_group_plan(_specs(2), WorldLayout(2, 1), 0)
    assert plan.dtypes == ("torch.bfloat16", "torch.float16", "torch.float32")


def test_pace_chunks_edges():
    chunks = chunks_for_ranks(build_group_plan(_specs(2), WorldLayout(2, 2), 0).params, (1,))
    assert pace_chunks(chunks, 0) == [tuple(chunks)]
    assert pace_chunks([], 2) == []
    waves = pace_chunks(chunks, 2)
    assert list(itertools.chain.from_iterable(waves)) == chunks and len(waves) == 3
