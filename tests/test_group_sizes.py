"""``[tide] local_world_size`` is checked against the FSDP groups TorchTitan 0.2.2
builds (``fsdp = dp_shard x cp``, the experts' ``efsdp``), by one function shared by
the launcher, the train spec and install."""

import pytest
from torchtitan.distributed import ParallelDims

from torchtitan_tide.comm.options import TideOptionError
from torchtitan_tide.comm.plans.group_sizes import check_local_world_size, fsdp_group_sizes
from torchtitan_tide.config import Tide, TideConfigError
from torchtitan_tide.launch.checks import check_run_values
from torchtitan_tide.launch.errors import LaunchError
from torchtitan_tide.launch.world import World
from torchtitan_tide.train_specs import check_group_sizes


def _launch_check(world_size: int, lws: int, **parallelism: int) -> None:
    table = {"parallelism": parallelism}
    world = World(1, world_size, 0, "cuda", None, 0)
    check_run_values(table, {}, world, Tide(comm="tide", local_world_size=lws))


def test_group_sizes_follow_torchtitan_meshes():
    assert list(fsdp_group_sizes(2, cp=4).values()) == [8]
    # EP: the experts' FSDP group is dp_shard x cp x tp / (ep x etp).
    assert list(fsdp_group_sizes(8, ep=4).values()) == [8, 2]
    assert list(fsdp_group_sizes(2, cp=2, tp=2, ep=2, etp=2).values()) == [4, 2]
    assert fsdp_group_sizes(1) == {}  # no FSDP group of more than one rank
    # Matches the meshes ParallelDims builds (without building them).
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=4, tp=1, pp=1, ep=1, etp=1, world_size=8)
    assert list(fsdp_group_sizes(dims.dp_shard, dims.cp).values()) == [dims.dp_shard * dims.cp]


def test_context_parallel_group_is_dp_shard_times_cp():
    """dp_shard 2 x cp 4 on 8 GPUs: one FSDP group of 8, so 8 per node is valid
    (the launcher used to reject it against dp_shard alone)."""
    _launch_check(8, 8, data_parallel_shard_degree=2, context_parallel_degree=4)
    check_group_sizes(Tide(comm="tide", local_world_size=8),
                      ParallelDims(1, 2, 4, 1, 1, 1, 1, 8))  # fmt: skip


def test_expert_group_is_checked_before_start():
    """ep 4 on 8 ranks: efsdp = 2, so 4 per node divides fsdp (8) but not efsdp; it
    used to pass the launcher and fail in install after the model was built."""
    with pytest.raises(LaunchError) as info:
        _launch_check(8, 4, expert_parallel_degree=4)
    message = str(info.value)
    assert "--tide.local_world_size 4 must divide the FSDP group size 2 (efsdp" in message
    assert "use one of [1, 2]" in message and "host name" not in message
    with pytest.raises(TideConfigError, match=r"local_world_size = 4 .* 2 \(efsdp"):
        check_group_sizes(Tide(comm="tide", local_world_size=4),
                          ParallelDims(1, 8, 1, 1, 1, 4, 1, 8))  # fmt: skip


def test_detected_and_dividing_values_pass():
    check_local_world_size(0, {"fsdp": 6})
    check_local_world_size(None, {"fsdp": 6})
    check_local_world_size(3, {"fsdp": 6, "efsdp": 3})
    with pytest.raises(TideOptionError, match="must divide the FSDP group size 6 "):
        check_local_world_size(4, {"fsdp": 6})
