"""GPU (2 GPUs, NCCL): a peer that stops before TIDE's next wait on it (it sleeps past the
deadline) makes the other rank fail within the watchdog's timeout instead of hanging,
on the copy-engine path (slot barrier: ``cuStreamWaitValue32`` or torch's barrier
kernel) and on the NCCL point-to-point path. Skipped with fewer than 2 GPUs.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
        python -m pytest tests/comm/test_watchdog_gpu.py -m gpu -v -s
"""

import time

import pytest
import torch
import torch.multiprocessing as mp
from _harness import Scenario, _entry, build, free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs >= 2 CUDA GPUs",
    ),
]

DEADLINE_S = 5.0


def _stalled_peer(
    rank: int, world_size: int, options: dict, dump_folder: str, gpu: int | None = None
) -> None:
    """Rank 1 stops before step 2; rank 0 must be ended by its watchdog. ``gpu``: the GPU
    of every rank (emulated nodes on one GPU), default each rank its own."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from torchtitan_tide import comm
    from torchtitan_tide.comm.base import watchdog

    device = torch.device("cuda", rank if gpu is None else gpu)
    model = build(Scenario(bf16=True), device)
    comm.apply(model, "tide", **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 11, (4, 8), device=device)
    y = torch.randint(0, 5, (4, 8), device=device)

    def step() -> None:
        F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
        opt.step()
        opt.zero_grad()

    step()  # both ranks: transports, slots and communicators are set up
    torch.cuda.synchronize()
    wd = watchdog.Watchdog(
        DEADLINE_S, rank=rank, world_size=world_size,
        store=dist.distributed_c10d._get_default_store(), dump_folder=dump_folder, poll_s=0.2,
    )  # fmt: skip
    watchdog.start(wd)
    watchdog.set_step(2)
    time.sleep(2 * wd.poll_s)  # a heartbeat of each rank is in the store
    if rank == 1:
        time.sleep(DEADLINE_S + 60)  # stops before its next all-gather (the test kills it)
        return
    with open(f"{dump_folder}/stall_start", "w") as f:
        f.write(repr(time.time()))
    step()  # waits on rank 1: the watchdog must end this process (os._exit)
    torch.cuda.synchronize()
    raise AssertionError("rank 0 finished a step its stopped peer never joined")


@pytest.mark.parametrize(
    "options",
    [
        {"transport": "copy_engine"},
        {"transport": "copy_engine", "slot_barrier": "kernel"},
        {"transport": "nccl_p2p", "local_world_size": 1},
    ],
    ids=["copy_engine-barrier", "kernel-barrier", "nccl_p2p-2x1"],
)
def test_stalled_peer_fails_the_other_rank_within_the_deadline(tmp_path, options):
    ctx = mp.start_processes(
        _entry,
        args=(2, free_port(), "cuda", _stalled_peer, (options, str(tmp_path))),
        nprocs=2, join=False, start_method="spawn",
    )  # fmt: skip
    check_survivor_ended_by_watchdog(ctx, tmp_path)


def check_survivor_ended_by_watchdog(ctx, tmp_path) -> None:
    """Rank 0 of ``ctx`` (running ``_stalled_peer``) exits with the watchdog's code within
    the deadline and its report names rank 1; every process is gone afterwards."""
    from torchtitan_tide.comm.base import watchdog

    survivor = ctx.processes[0]
    try:
        survivor.join(120)  # start-up and the first step, then the deadline
        assert survivor.exitcode == watchdog.EXIT_CODE, survivor.exitcode
        stalled_for = time.time() - float((tmp_path / "stall_start").read_text())
        # The deadline, a poll, the bounded abort (<= 10 s) and process exit.
        assert DEADLINE_S <= stalled_for < DEADLINE_S + 15, stalled_for
        cause = watchdog.failure_summary(str(tmp_path))
        assert cause is not None and "TIDE watchdog: rank 0 waited 5 s at step 2" in cause, cause
        # Rank 1 is alive (it sleeps), so its heartbeats are current: named as the peer.
        assert "for rank(s) 1 in" in cause and "not answered by rank(s) 1" in cause, cause
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)
