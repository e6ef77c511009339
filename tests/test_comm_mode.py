"""apply_comm_mode: named errors for modes that cannot run, force-sum on gloo, logging."""

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from train_helpers import free_port

from torchtitan_tide.config import Tide
from torchtitan_tide.train_specs import CommModeError, apply_comm_mode, unavailable_reason


@pytest.fixture
def gloo_world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded_model(mesh) -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_fsdp2_sets_force_sum_on_gloo(gloo_world_of_one, caplog):
    model = sharded_model(gloo_world_of_one)
    with caplog.at_level("INFO"):
        assert apply_comm_mode(model, Tide(comm="fsdp2")) == "fsdp2"
    assert "comm mode 'fsdp2' on 3 FSDP modules (backend gloo" in caplog.text
    for module in model.modules():
        if hasattr(module, "_get_fsdp_state"):
            group = module._get_fsdp_state()._fsdp_param_group
            assert group is None or group.force_sum_reduction_for_comms


def test_tide_needs_fsdp(gloo_world_of_one):
    with pytest.raises(CommModeError, match="needs FSDP"):
        apply_comm_mode(nn.Linear(4, 4), Tide(comm="tide"))


def test_options_of_other_modes_are_reported_not_dropped(gloo_world_of_one, caplog):
    model = sharded_model(gloo_world_of_one)
    with caplog.at_level("WARNING"):
        apply_comm_mode(model, Tide(comm="fsdp2", ag_pacing=4))
    assert "['ag_pacing'] only apply to comm = 'tide'" in caplog.text


def test_hardware_reasons():
    assert "needs CUDA GPUs with the NCCL backend" in unavailable_reason("symm_mem", "gloo")
    assert unavailable_reason("symm_mem", "nccl") is None
    assert unavailable_reason("fsdp2", "gloo") is None
    assert unavailable_reason("tide", "gloo") is None


def test_symm_mem_on_gloo_as_the_launcher_predicts(gloo_world_of_one, caplog):
    """The launcher refuses symm_mem on a CPU world, or says it falls back to fsdp2; the ranks
    decide alike (launch/checks.py comm_for_world and apply_comm_mode share unavailable_reason)."""
    from torchtitan_tide.launch.checks import CommChoice, comm_for_world
    from torchtitan_tide.launch.errors import LaunchError
    from torchtitan_tide.launch.world import World

    cpu_world = World(nnodes=1, nproc_per_node=1, node_rank=0, device="cpu", master_addr=None,
                      master_port=29500)
    with pytest.raises(LaunchError, match="fallback = 'fsdp2'"):
        comm_for_world(Tide(comm="symm_mem"), cpu_world)
    with pytest.raises(CommModeError, match="fallback = 'fsdp2'"):
        apply_comm_mode(sharded_model(gloo_world_of_one), Tide(comm="symm_mem"))
    fallback = Tide(comm="symm_mem", fallback="fsdp2")
    choice = comm_for_world(fallback, cpu_world)
    assert choice == CommChoice("fsdp2", unavailable_reason("symm_mem", "gloo"))
    with caplog.at_level("WARNING"):
        assert apply_comm_mode(sharded_model(gloo_world_of_one), fallback) == "fsdp2"
    assert "falling back to comm = 'fsdp2' as [tide] fallback asks" in caplog.text
