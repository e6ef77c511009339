"""TIDE-RS's copy-engine round (``CopyEngineTransport.reduce_rows``) on ONE GPU.

The copy-engine transport needs one process per GPU with CUDA symmetric memory, so its
protocol tests need 2 GPUs (test_gpu.py). This test runs the same method on one GPU for
``L`` node-local "ranks": one thread each, each with its own stream and its own slot buffer
(plain device memory standing in for the symmetric buffers: the peers' buffers are the
other threads' tensors, so ``cudaMemcpyBatchAsync`` really pushes into them). The slot
barrier is replaced by a device-side one with the real one's contract: each rank's stream
waits for an event every rank recorded at the same barrier (the host only makes sure the
events exist; it never waits for the device). Each rank has its own side streams, as each
process has, and every accumulate kernel starts after a ~1 ms device sleep: were the
accumulate not ordered before the next barrier, a peer's later round would overwrite the
rows it reads (4 rounds over 2 slots). One thread runs outside the barrier at a time.
Checked: every rank's fp32 shard equals the float64 sum of all ranks' bf16 gradient
slices divided by the divisor, on NaN-poisoned outputs, over 1, 2 and 4 rounds and the
kernel's division.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class _ThreadBarrier:
    """The slots' ``handle``: ``barrier`` records an event on this rank's current stream,
    meets every rank's thread on the host, then makes the stream wait for every rank's
    event of this barrier (device-side, like the real barrier). ``lock`` is held by a
    thread whenever it runs outside the barrier."""

    def __init__(self, ranks: int) -> None:
        self.gate = threading.Barrier(ranks, timeout=60)
        self.lock = threading.Lock()
        self.events: dict[tuple[int, int], torch.cuda.Event] = {}  # (barrier, rank)
        self.seen = threading.local()
        self.calls = 0

    def barrier(self, channel: int = 0) -> None:
        del channel
        index = getattr(self.seen, "count", 0)
        self.seen.count = index + 1
        stream = torch.cuda.current_stream()
        self.events[(index, self.seen.rank)] = stream.record_event()
        self.calls += 1
        self.lock.release()
        try:
            self.gate.wait()
        finally:
            self.lock.acquire()
        for (at, _), event in list(self.events.items()):
            if at == index:
                stream.wait_event(event)


@pytest.mark.parametrize("local_ranks,rows,divisor", [(2, 2, 2.0), (4, 2, 4.0), (4, 1, 3.0)])
def test_copy_engine_reduce_rows_sums_every_ranks_slices(
    local_ranks, rows, divisor, monkeypatch
):
    from torchtitan_tide.comm.base import kernels, streams
    from torchtitan_tide.comm.plans.plan import WorldLayout, build_rs_plan
    from torchtitan_tide.comm.transports.copy_engine import CopyEngineTransport, SymmSlots

    per_thread = threading.local()

    def own_stream(name: str, device: torch.device) -> torch.cuda.Stream:
        cache = per_thread.__dict__.setdefault("streams", {})
        if name not in cache:
            cache[name] = torch.cuda.Stream(device=device)
        return cache[name]

    accumulate_rows = kernels.accumulate_rows
    launched = []

    def late_accumulate(rows_in, out, **kwargs):
        torch.cuda._sleep(2_000_000)  # ~1 ms of device time before the rows are read
        launched.append(rows_in.shape)
        accumulate_rows(rows_in, out, **kwargs)

    monkeypatch.setattr(streams, "stream", own_stream)  # one set of side streams per "rank"
    monkeypatch.setattr(kernels, "accumulate_rows", late_accumulate)

    device = torch.device("cuda", 0)
    layout = WorldLayout(local_ranks, local_ranks)
    gen = torch.Generator().manual_seed(1000 * local_ranks + rows)
    numels = [1021, 64 * 48, 7]  # odd sizes: padded shards, a parameter smaller than the world
    shard_numels = [-(-n // local_ranks) for n in numels]
    grads = [
        [torch.randn(n, generator=gen).to(torch.bfloat16).to(device) for n in numels]
        for _ in range(local_ranks)
    ]
    plans = [build_rs_plan(layout, r, rows, numels, shard_numels) for r in range(local_ranks)]
    shard_numel = plans[0].shard_numel
    itemsize = 2
    slot_bytes = rows * shard_numel * itemsize
    buffers = [torch.empty(2 * slot_bytes, dtype=torch.uint8, device=device)
               for _ in range(local_ranks)]  # fmt: skip
    sync = _ThreadBarrier(local_ranks)
    outs = [torch.full((shard_numel,), float("nan"), device=device) for _ in range(local_ranks)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        slots = SymmSlots(
            buffer=buffers[rank], handle=sync, slot_bytes=slot_bytes, peer_bufs=buffers,
            peer_ptrs=[b.data_ptr() for b in buffers], peer_devices=[0] * local_ranks,
        )  # fmt: skip
        transport = CopyEngineTransport(slots)
        plan = plans[rank]
        stream = torch.cuda.Stream(device=device)
        sync.seen.rank = rank
        sync.lock.acquire()
        try:
            with torch.cuda.stream(stream):
                (chunk,) = plan.chunks  # one node: the own node's chunk only
                for rnd, pushes in zip(chunk.rounds, chunk.pushes):
                    transport.reduce_rows(
                        layout, rank, rnd, pushes, grads[rank], plan.segments, None,
                        outs[rank], divisor=divisor if rnd.last else 1.0, num_ctas=4,
                    )  # fmt: skip
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            sync.gate.abort()
        finally:
            sync.lock.release()

    torch.cuda.synchronize(device)  # gradients and poisoned outputs written
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(local_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank thread hangs"
    assert not errors, errors
    rounds = len(plans[0].chunks[0].rounds)
    assert rounds == -(-local_ranks // rows)
    assert sync.calls == local_ranks * rounds, "the copy-engine round did not run"
    assert len(launched) == local_ranks * rounds, "an accumulate did not run beside"
    for rank in range(local_ranks):
        for seg in plans[rank].segments:
            valid = seg.valid(rank)
            start = rank * seg.shard_numel
            slices = [grads[q][seg.param_index][start : start + valid].double().cpu()
                      for q in range(local_ranks)]  # fmt: skip
            want = sum(slices) / divisor
            magnitude = sum(s.abs() for s in slices) / divisor
            got = outs[rank][seg.out_offset : seg.out_offset + valid].double().cpu()
            assert not torch.isnan(got).any(), (rank, seg)
            bound = (local_ranks + 2) * torch.finfo(torch.float32).eps * magnitude + 1e-30
            assert ((got - want).abs() <= bound).all(), (rank, seg, (got - want).abs().max())
