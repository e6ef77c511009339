"""Topology rules of TIDE (pure: no processes): nodes, node-local group ranks on 2-D
meshes, transport choice, and the one slot-sizing rule shared by install and planner."""

from __future__ import annotations

import pytest
import torch

from torchtitan_tide.comm.options import TideOptions
from torchtitan_tide.comm.plans.memory_plan import (
    CommDtypes,
    GroupShape,
    aligned_group_bytes,
    group_shard_numel,
    plan_memory,
    slot_alloc_bytes,
    slot_sizes,
)
from torchtitan_tide.comm.plans.plan import WorldLayout
from torchtitan_tide.comm.plans.topology import (
    SHARED_GPU,
    RankInfo,
    backend_has_p2p,
    choose_transport,
    node_keys,
    node_local_group_ranks,
    resolve_local_world_size,
)


def _mesh_2d(nodes: int, gpus: int, tp: int) -> list[list[int]]:
    """The dp_shard groups (global ranks) of TorchTitan's (dp_shard, tp) mesh of
    ``nodes x gpus`` ranks: mesh = arange(world).view(world // tp, tp), one group per
    tp index."""
    world = nodes * gpus
    mesh = torch.arange(world).view(world // tp, tp)
    return [mesh[:, t].tolist() for t in range(tp)]


def _infos(global_ranks: list[int], gpus: int) -> list[RankInfo]:
    return [RankInfo(f"host{r // gpus}", f"boot{r // gpus}", "", "", r) for r in global_ranks]


@pytest.mark.parametrize(
    "tp, expect_lws",
    [(2, 4), (8, 1)],
    ids=["tp2", "tp8"],
)
def test_node_group_ranks_of_2d_mesh_2_nodes_x_8(tp, expect_lws):
    """dp_shard groups of a 2 nodes x 8 GPUs mesh with TP 2 (4 group ranks per node:
    node-local groups of GROUP ranks [[0..3], [4..7]] = global [[t, t+2, ...], ...]) and
    TP 8 (one group rank per node: no node-local group, point-to-point)."""
    for group in _mesh_2d(2, 8, tp):
        lws, _ = resolve_local_world_size(TideOptions(), node_keys(_infos(group, 8)))
        assert lws == expect_lws
        layout = WorldLayout(len(group), lws)
        ranks = node_local_group_ranks(layout)
        # GROUP ranks, contiguous per node: what dist.split_group takes.
        assert ranks == [list(range(n * lws, (n + 1) * lws)) for n in range(layout.num_nodes)]
        for node, members in enumerate(ranks):
            assert {group[r] // 8 for r in members} == {node}  # all on that node
        if tp == 2:
            t = group[0]
            assert [[group[r] for r in m] for m in ranks] == [
                [t, t + 2, t + 4, t + 6],
                [t + 8, t + 10, t + 12, t + 14],
            ]


def test_nodes_by_boot_and_launcher_not_host_name():
    same_host = [RankInfo("localhost", "b", "", "", r) for r in range(4)]
    assert resolve_local_world_size(TideOptions(), node_keys(same_host))[0] == 4
    # Containers named alike on two machines: different boots, two nodes.
    containers = [RankInfo("trainer", f"boot{r // 2}", "", "", r) for r in range(4)]
    assert resolve_local_world_size(TideOptions(), node_keys(containers))[0] == 2
    # Two launchers (torchrun GROUP_RANK) on one machine: two nodes.
    launchers = [RankInfo("h", "b", str(r // 2), "", r) for r in range(4)]
    assert resolve_local_world_size(TideOptions(), node_keys(launchers))[0] == 2
    # No boot id: the host name decides.
    hosts = [RankInfo(f"h{r // 2}", "", "", "", r) for r in range(4)]
    assert resolve_local_world_size(TideOptions(), node_keys(hosts))[0] == 2
    strided = [RankInfo(f"h{r % 2}", "", "", "", r) for r in range(4)]
    assert resolve_local_world_size(TideOptions(), node_keys(strided))[0] == 1
    with pytest.raises(ValueError, match="must divide the FSDP group size 4"):
        resolve_local_world_size(TideOptions(local_world_size=3), node_keys(hosts))


def test_backend_point_to_point():
    assert backend_has_p2p("gloo") and backend_has_p2p("nccl")
    assert backend_has_p2p("cpu:gloo,cuda:nccl")
    assert not backend_has_p2p("threaded") and not backend_has_p2p("fake")


def test_auto_transport_without_point_to_point_takes_fsdp2():
    cpu = torch.device("cpu")
    no_access = (False, "not CUDA")
    kind, why, _ = choose_transport(TideOptions(), WorldLayout(2, 2), cpu, "threaded", no_access)
    assert kind is None and "no point-to-point" in why
    assert why.startswith("auto: 1 node x 2: ")  # issue 22: not "1 nodes"
    assert WorldLayout(16, 8).shape == "2 nodes x 8"
    kind, why, _ = choose_transport(TideOptions(), WorldLayout(2, 1), cpu, "gloo", no_access)
    assert kind == "p2p"
    # One node whose GPUs reach each other: the copy engine needs no p2p backend.
    cuda = torch.device("cuda", 0)
    p2p_access = (True, "P2P")
    kind, _, _ = choose_transport(TideOptions(), WorldLayout(2, 2), cuda, "threaded", p2p_access)
    assert kind == "copy_engine"
    kind, why, _ = choose_transport(TideOptions(), WorldLayout(4, 2), cuda, "threaded", p2p_access)
    assert kind is None and "cross-node phase" in why
    with pytest.raises(ValueError, match=r"transport='gloo' \(\[tide\] ag_transport\)"):
        choose_transport(TideOptions(transport="gloo"), WorldLayout(2, 1), cuda, "nccl", no_access)


def test_auto_takes_nccl_windows_where_they_earn_their_place():
    """Across nodes and between ranks that share a GPU: windows (fallback named); one node of
    ranks on their own GPUs: the copy engine (pulls, no placement copy, L x smaller slots)."""
    cuda, nccl = torch.device("cuda", 0), "nccl"
    ok = (True, "NCCL 2.30.7")
    shared = (False, f"group ranks [1] {SHARED_GPU} (torch's symmetric memory refuses ...)")
    p2p_access = (True, "CUDA P2P to the GPUs of the 1 other rank(s) of this node")
    auto = TideOptions()
    kind, why, fallback = choose_transport(auto, WorldLayout(8, 2), cuda, nccl, p2p_access, ok)
    assert (kind, fallback) == ("windows", "copy_engine") and "4 nodes x 2" in why
    kind, _, fallback = choose_transport(auto, WorldLayout(4, 1), cuda, nccl, (False, "n"), ok)
    assert (kind, fallback) == ("windows", "p2p")
    kind, why, fallback = choose_transport(auto, WorldLayout(2, 2), cuda, nccl, shared, ok)
    assert (kind, fallback) == ("windows", "p2p") and SHARED_GPU in why
    kind, _, fallback = choose_transport(auto, WorldLayout(2, 2), cuda, nccl, p2p_access, ok)
    assert (kind, fallback) == ("copy_engine", None)
    # cross_node_transport = "p2p" keeps send/recv across nodes
    p2p = TideOptions(cross_node_transport="p2p")
    kind, _, _ = choose_transport(p2p, WorldLayout(8, 2), cuda, nccl, p2p_access, ok)
    assert kind == "copy_engine"
    # windows that cannot run: what auto takes without them, the reason in the log line
    kind, why, _ = choose_transport(auto, WorldLayout(2, 2), cuda, nccl, shared,
                                    (False, "NCCL 2.28.9 refuses two ranks on one GPU"))  # fmt: skip
    assert kind == "p2p" and "NCCL windows: NCCL 2.28.9" in why
    forced = TideOptions(transport="nccl_windows")
    with pytest.raises(ValueError, match="ag_transport.*cannot run here: no host RMA"):
        choose_transport(forced, WorldLayout(2, 2), cuda, nccl, shared, (False, "no host RMA"))
    both = TideOptions(transport="nccl_windows", cross_node_transport="p2p")
    with pytest.raises(ValueError, match="cross_node_transport = 'p2p' asks for send/recv"):
        choose_transport(both, WorldLayout(4, 2), cuda, nccl, shared, ok)
    with pytest.raises(ValueError, match="copy_engine.*cannot run here"):
        choose_transport(TideOptions(transport="copy_engine"), WorldLayout(2, 2), cuda, nccl,
                         shared, ok)  # fmt: skip


def test_slot_sizes_one_rule_for_install_and_planner():
    """rs_rows = 1 with bf16 gradients: one bf16 row is half an fp32 row, and the fp32
    row (FSDP's unsynced accumulated gradients) sets the staging; the planner's
    Slot-Reuse and own-slot figures come from the same rule."""
    group = GroupShape("layer", ((64, 32), (64,)))
    world, lws = 8, 4
    dtypes = CommDtypes(param_bytes=2, reduce_bytes=4, grad_bytes=2, master_bytes=4)
    shard = group_shard_numel(group, world)
    packed = aligned_group_bytes(group, world, 2)
    sizes = slot_sizes(
        num_nodes=2, local_world_size=lws, packed_shard_bytes=[packed],
        grad_shard_bytes=[shard * 2], reduce_shard_bytes=[shard * 4],
        rs_rows=1, tide_rs=True, slot_reuse=False,
    )  # fmt: skip
    assert sizes.ag_slot_bytes == 2 * packed and sizes.rs_slot_bytes == shard * 4
    own = plan_memory([group], world, lws, dtypes, rs_rows=1, slot_reuse=False)["tide"]
    assert own.parts["rs_staging_extra"] == 2 * slot_alloc_bytes(shard * 4)
    reuse = slot_sizes(
        num_nodes=2, local_world_size=lws, packed_shard_bytes=[packed],
        grad_shard_bytes=[shard * 2], reduce_shard_bytes=[shard * 4],
        rs_rows=1, tide_rs=True, slot_reuse=True,
    )  # fmt: skip
    assert reuse.ag_slot_bytes == max(2 * packed, shard * 4) and reuse.rs_slot_bytes == 0
    shared = plan_memory([group], world, lws, dtypes, rs_rows=1, slot_reuse=True)["tide"]
    assert shared.parts["ag_slots"] == 2 * slot_alloc_bytes(2 * packed)
    assert shared.parts["rs_staging_extra"] == (
        2 * slot_alloc_bytes(reuse.ag_slot_bytes) - shared.parts["ag_slots"]
    )
