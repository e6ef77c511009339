"""Node-local groups of FSDP sub-groups on 2 nodes x 8 GPUs (pure: torch.distributed faked).

With TP the FSDP group of a rank is strided across the world (TorchTitan's dense mesh is
``(dp, tp)``, tp innermost). TIDE splits it into node-local groups with
``dist.split_group``, whose ``split_ranks`` are ranks WITHIN the parent group (torch's
docstring), not global ranks. These tests give ``topology.make_node_local_group`` a fake
16-rank world and check the ``split_ranks`` torch receives (``test_topology`` checks the
pure rank mapping; this checks the call that uses it).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from torchtitan_tide.comm import topology
from torchtitan_tide.comm.options import TideOptions
from torchtitan_tide.comm.plan import WorldLayout

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
def test_node_group_split_ranks_are_parent_group_ranks(monkeypatch, tp, me):
    ranks = fsdp_group_ranks(tp, me)
    group = FakeGroup(ranks, me)
    nodes = [f"node{r // GPUS}" for r in ranks]
    lws, _ = topology.resolve_local_world_size(TideOptions(), nodes)
    assert lws == GPUS // tp  # consecutive group ranks share a host
    layout = WorldLayout(len(ranks), lws)
    calls: list[list[list[int]]] = []

    def split_group(parent_pg=None, split_ranks=None, **kwargs):
        assert parent_pg is group
        calls.append(split_ranks)
        return object()

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: NODES * GPUS)
    monkeypatch.setattr(dist, "split_group", split_group)
    node_group = topology.make_node_local_group(group, layout, ranks)
    assert node_group is not None, "no node-local group for a strided FSDP group"
    assert len(calls) == 1, "split_group must be called once, by every rank of the group"
    expected = [list(range(m * lws, (m + 1) * lws)) for m in range(NODES)]
    assert calls[0] == expected, f"split_ranks {calls[0]} must be group ranks {expected}"
