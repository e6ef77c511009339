"""The CPU stand-in of NCCL's one-sided calls (``transports/windows/rma_standin.py``): the rules
NCCL enforces, cumulative signal counting across processes, and the two deliberate faults."""

import pytest
import torch
import torch.distributed as dist
from _harness import spawn

from torchtitan_tide.comm.transports.windows.rma_standin import (
    Faults,
    StandinError,
    StandinRma,
    StandinTimeout,
    new_unique_id,
)


def _shared_id(rank: int) -> bytes:
    box = [new_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _ping_pong(rank: int, world: int) -> None:
    comm = StandinRma.create(_shared_id(rank), rank, world)
    window = comm.register(4096)
    peer = (rank + 1) % world
    src = window.tensor.narrow(0, 0, 64)
    for round_index in range(5):
        src.fill_(rank * 10 + round_index)
        # two puts into the peer's upper half, then the wait for the other side's two
        comm.put_signal(src, peer, window, 1024 + 64 * (round_index % 2))
        comm.signal(peer)
        comm.wait_signal((rank - 1) % world, 2)
        got = window.tensor.narrow(0, 1024 + 64 * (round_index % 2), 64)
        assert torch.all(got == ((rank - 1) % world) * 10 + round_index), got[:4]
        dist.barrier()  # a ring has no back-pressure: the writer must not lap the reader
    assert comm.signals_from((rank - 1) % world) == 10
    with pytest.raises(StandinError, match="not in a valid symmetric window"):
        comm.put_signal(torch.zeros(4, dtype=torch.uint8), peer, window, 0)
    with pytest.raises(StandinError, match="overflows"):
        comm.put_signal(src, peer, window, 4096 - 32)
    with pytest.raises(StandinError, match="opCnt"):
        comm.wait_signal(peer, 0)
    dist.barrier()
    comm.destroy()
    dist.barrier()
    if rank == 0:
        comm.remove_folder()


def test_standin_puts_and_counts_signals_across_processes():
    spawn(_ping_pong, 3)


def _faults(rank: int, world: int) -> None:
    uid = _shared_id(rank)
    faulty = Faults(signal_before_data=True, delay_s=0.2) if rank == 0 else None
    comm = StandinRma.create(uid, rank, world, faults=faulty)
    window = comm.register(4096)
    if rank == 0:
        window.tensor.narrow(0, 0, 8).fill_(7)
        comm.put_signal(window.tensor.narrow(0, 0, 8), 1, window, 512)
    else:
        comm.wait_signal(0, 1)
        # the signal overtook the data: it is not there yet
        assert torch.all(window.tensor.narrow(0, 512, 8) == 0)
    dist.barrier()
    comm.destroy()
    late = StandinRma.create(_shared_id(rank), rank, world,
                             faults=Faults(late_source_read=True, delay_s=0.2))  # fmt: skip
    window = late.register(4096)
    if rank == 0:
        src = window.tensor.narrow(0, 0, 8)
        src.fill_(1)
        late.put_signal(src, 1, window, 512)
        src.fill_(2)  # rewritten before the (late) read: the peer receives 2
    else:
        late.wait_signal(0, 1)
        assert torch.all(window.tensor.narrow(0, 512, 8) == 2)
        late.timeout_s = 0.2
        with pytest.raises(StandinTimeout, match="from rank 0"):
            late.wait_signal(0, 1)
    dist.barrier()
    late.destroy()


def test_standin_faults_break_what_they_name():
    spawn(_faults, 2)
