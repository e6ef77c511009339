"""Node-local groups of FSDP sub-groups on 2 nodes x 8 GPUs (pure: torch.distributed faked).

With TP the FSDP group of a rank is strided across the world (TorchTitan's dense mesh is
``(dp, tp)``, tp innermost). TIDE makes the node-local group of its node with
``dist.new_group(ranks, use_local_synchronization=True)``: the GLOBAL ranks of the group's
ranks on this node, called by those ranks only (``dist.split_group`` would need a device
bound to the default group, which TorchTitan does not bind). These tests give
``topology.make_node_local_group`` a fake 16-rank world and check the ranks torch receives
(``test_topology`` checks the pure rank mapping; this checks the call that uses it).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from torchtitan_tide.comm.options import TideOptions
from torchtitan_tide.comm.plans import topology
from torchtitan_tide.comm.plans.plan import WorldLayout

NODES, GPUS = 2, 8


class FakeGroup:
    """A process group of the given global ranks, seen from ``me``."""

    def __init__(self, global_ranks: list[int], me: int) -> None:
        self.global_ranks = global_ranks
        self.me = me

    def size(self) -> int:
        return len(self.global_ranks)

    def rank(self) -> int:
        return self.global_ranks.index(self.me)


def fsdp_group_ranks(tp: int, me: int) -> list[int]:
    """Global ranks of ``me``'s FSDP group in a (dp, tp) mesh over 16 ranks."""
    return list(range(me % tp, NODES * GPUS, tp))


@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("me", [0, 1, 7, 8, 15])
def test_node_group_is_made_by_the_node_from_its_global_ranks(monkeypatch, tp, me):
    ranks = fsdp_group_ranks(tp, me)
    group = FakeGroup(ranks, me)
    nodes = [f"node{r // GPUS}" for r in ranks]
    lws, _ = topology.resolve_local_world_size(TideOptions(), nodes)
    assert lws == GPUS // tp  # consecutive group ranks share a host
    layout = WorldLayout(len(ranks), lws)
    calls: list[tuple[list[int], bool]] = []

    def new_group(ranks=None, use_local_synchronization=False, **kwargs):
        calls.append((ranks, use_local_synchronization))
        return object()

    def split_group(*args, **kwargs):
        raise AssertionError("split_group needs a bound device; TorchTitan binds none")

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "split_group", split_group)
    node_group = topology.make_node_local_group(group, layout, ranks)
    assert node_group is not None, "no node-local group for a strided FSDP group"
    assert len(calls) == 1, "one new_group per rank: its own node's"
    node = group.rank() // lws
    expected = [ranks[r] for r in range(node * lws, (node + 1) * lws)]  # global ranks
    assert calls[0] == (expected, True), f"new_group got {calls[0]}, expected {expected}"
    assert {r // GPUS for r in expected} == {me // GPUS}  # all on this rank's node
