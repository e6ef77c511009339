"""GPU tests that need ONE GPU (run where only a 1-GPU machine is lent): the copy-engine
barrier's driver calls (flag write, the wait with the FLUSH flag where the device has
it), its fallback under ``CUDA_DEVICE_MAX_CONNECTIONS=1``, and the topology's device
lookup by UUID. The 2-GPU protocol tests are in test_gpu.py."""

import os

import pytest
import torch
import torch.distributed as dist
from _harness import spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _barrier_driver_calls(rank: int, world_size: int) -> None:
    from torchtitan_tide.comm.plans.plan import WorldLayout
    from torchtitan_tide.comm.plans.topology import local_peer_access, local_rank_info
    from torchtitan_tide.comm.transports import copy_engine
    from torchtitan_tide.comm.transports.copy_engine import SymmSlots

    device = torch.device("cuda", 0)
    infos = [local_rank_info(device)]
    assert infos[0].device_uuid == str(torch.cuda.get_device_properties(0).uuid)
    ok, why = local_peer_access(infos, WorldLayout(1, 1), 0)
    assert ok, why

    driver = copy_engine._cuda_driver()
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES
    err, can_flush = driver.cuDeviceGetAttribute(attr, 0)
    print(f"CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES = {can_flush} ({err})")

    slots = SymmSlots.create(1 << 20, dist.group.WORLD, device)
    assert slots.barrier_kind == "copy_engine", copy_engine._barrier_state
    expect = copy_engine._CU_STREAM_WAIT_VALUE_FLUSH if can_flush else 0
    assert slots.wait_flags == expect
    stream = torch.cuda.Stream(device=device)
    own = slots.peer_flags[0]
    with torch.cuda.stream(stream):
        for seq in range(1, 6):
            torch.ops.symm_mem.stream_write_value32_(own, slots.flags_base, seq)
            # the wait the barrier issues per peer, with the flags it uses
            copy_engine._wait_value32(stream, own.data_ptr() + 4 * slots.flags_base, seq,
                                      slots.wait_flags)  # fmt: skip
            slots.barrier()  # no peers: must return at once, no hang
    stream.synchronize()
    assert int(own[slots.flags_base]) == 5

    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    try:
        kernel = SymmSlots.create(1 << 20, dist.group.WORLD, device)
    finally:
        del os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
    assert kernel.barrier_kind == "kernel"
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in copy_engine._barrier_state["fallback_reason"]


def test_gpu_barrier_driver_calls_one_gpu():
    pytest.importorskip("cuda.bindings.driver")
    spawn(_barrier_driver_calls, 1, device_type="cuda")


def _bounded_setup_one_gpu(rank: int, world_size: int) -> None:
    from torchtitan_tide.comm.base.setup_steps import SetupSteps
    from torchtitan_tide.comm.transports.copy_engine import SymmSlots

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    steps = SetupSteps(install=0, timeout_s=60.0)
    buffer = SymmSlots.allocate(1 << 20, device)

    def exchange(value: object) -> list:
        return steps.exchange("slot details", "node0", [0], value)

    def rendezvous() -> SymmSlots:
        assert torch.cuda.current_device() == 0  # the helper thread runs on the rank's device
        return SymmSlots.connect(buffer, dist.group.WORLD, device, "copy_engine", exchange)

    slots = steps.run("symmetric-memory rendezvous", "node0", [0], rendezvous, device)
    view = slots.peer_flags[0]
    assert view.device == device
    slots.barrier()  # usable from the main thread after the helper thread's rendezvous
    torch.cuda.synchronize()


def test_gpu_bounded_setup_rendezvous_in_helper_thread_one_gpu():
    """install's set-up runs the symmetric-memory rendezvous in a helper thread while the
    caller watches the store (setup_steps): it must work on the GPU's torch, with a
    cloned store client, and leave slots the main thread can use."""
    spawn(_bounded_setup_one_gpu, 1, device_type="cuda")
