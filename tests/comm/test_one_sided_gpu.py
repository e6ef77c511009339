"""The one-sided cross-node transport (NCCL put/signal) on ONE GPU
(docs/design/2026-12-02-one-sided.md).

Two processes share GPU 0. ``one_node``: NCCL sees one node (``NCCL_MULTI_RANK_GPU_ENABLE=1``,
needs NCCL >= 2.30 in torch's place: check.sh's emulation stage swaps it in) and moves the
puts by copy engine; TIDE is told ``local_world_size = 1``, so every rank is its own TIDE
"node" and TIDE's cross-node code path runs. ``nodes``: each process its own NCCL host
(``NCCL_HOSTID``, sockets on loopback), where NCCL has no host RMA: ``auto`` must fall back
to send/recv naming why, and the explicit choice must fail at ``comm.apply``.

Checked against stock FSDP2 on the same data: every sharded gradient after each backward
and every loss; TIDE's outputs are NaN-poisoned before each run; the one-sided transports'
counters prove they moved the bytes; a profile of a step shows no NCCL kernel.
"""

import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _harness import LogRecords, Scenario, build, free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.emulation,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_NO_NVLS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip


def _entry(rank: int, world_size: int, port: int, mode: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **_NO_NVLS)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    if mode == "one_node":
        os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
        os.environ.pop("NCCL_HOSTID", None)
    else:
        os.environ.update(NCCL_HOSTID=f"emunode{rank}", NCCL_SOCKET_IFNAME="lo",
                          NCCL_IB_DISABLE="1")  # fmt: skip
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", 0))  # fmt: skip
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(fn, mode: str, *args, world_size: int = 2) -> None:
    mp.start_processes(_entry, args=(world_size, free_port(), mode, fn, args),
                       nprocs=world_size, join=True, start_method="spawn")  # fmt: skip


def _loaded_nccl() -> int:
    from torchtitan_tide.comm.transports.windows import nccl_rma

    return nccl_rma.nccl_version() or 0


def needs_multi_rank_gpu(test):
    """Marked ``one_node`` (check.sh's emulation stage runs these with NCCL >= 2.30 swapped
    in) and skipped where the loaded NCCL refuses two ranks on one GPU."""
    skip = pytest.mark.skipif(
        torch.cuda.is_available() and _loaded_nccl() < 23000,
        reason="two ranks on one GPU as one NCCL node need NCCL >= 2.30 in torch's place "
        "(scripts/gpu/check.sh's emulation stage swaps it in)",
    )
    return pytest.mark.one_node(skip(test))


def _records() -> LogRecords:
    records = LogRecords()
    log = logging.getLogger("torchtitan_tide")
    log.addHandler(records)
    log.setLevel(logging.INFO)
    return records


def _batches(gen: torch.Generator, device: torch.device, count: int):
    return [
        (torch.randint(0, 11, (2, 5), generator=gen).to(device),
         torch.randint(0, 5, (2, 5), generator=gen).to(device))
        for _ in range(count)
    ]  # fmt: skip


def _parity(rank: int, world_size: int, transport: str) -> None:
    import torch.nn.functional as F

    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import all_gather as tide_ag
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch
    from torchtitan_tide.comm.fsdp import reduce_scatter as tide_rs
    from torchtitan_tide.comm.transports.windows.transport import WindowTransport

    device = torch.device("cuda", 0)
    records = _records()
    unsharded = {"n": 0}

    def poison(outputs):
        unsharded["n"] += 1
        for o in outputs:
            o.fill_(float("nan"))

    def check(outputs):
        for o in outputs:
            assert not torch.isnan(o).any().item(), "TIDE-AG left an element unwritten"

    tide_ag.set_debug_hooks(before=poison, after=check)
    tide_rs.set_poison(float("nan"))
    bitwise = True
    try:
        for scn in (Scenario(bf16=True, steps=3),
                    Scenario(bf16=True, prefetch=True, grad_accum=2, steps=2),
                    Scenario(bf16=True, reshard_after_forward=False, steps=2)):  # fmt: skip
            ref, tide = build(scn, device), build(scn, device)
            comm.apply(tide, "tide", local_world_size=1, cross_node_transport=transport,
                       ag_storage_swap="ctypes")  # in place on torch 2.11 too
            groups = [g for _, g in fsdp_patch.fsdp_param_groups(tide)]
            ags = [g._tide_ag_state.transport for g in groups]
            sides = [g._tide_rs_state.cross_node for g in groups]
            assert all(isinstance(t, WindowTransport) for t in ags), ags
            assert all(s.name == "nccl_one_sided" for s in sides), "TIDE-RS phase 2 is not one-sided"
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
            opt_tide = torch.optim.AdamW(tide.parameters(), lr=1e-2, foreach=False)
            gen = torch.Generator().manual_seed(7 + rank)
            before = unsharded["n"]
            for step in range(scn.steps):
                for i, (x, y) in enumerate(_batches(gen, device, scn.grad_accum)):
                    last = i == scn.grad_accum - 1
                    losses = []
                    for model in (ref, tide):
                        model.set_requires_gradient_sync(last)
                        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
                        loss.backward()
                        losses.append(loss.detach())
                    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0,
                                               msg=f"[{scn}] step {step} loss")  # fmt: skip
                    if not last:
                        continue
                    for (name, p_ref), p_tide in zip(ref.named_parameters(), tide.parameters()):
                        g_ref, g_tide = p_ref.grad.to_local(), p_tide.grad.to_local()
                        assert not torch.isnan(g_tide).any(), f"{name}: unwritten gradient"
                        bitwise &= torch.equal(g_ref, g_tide)
                        torch.testing.assert_close(g_tide, g_ref, rtol=1e-6, atol=1e-7,
                                                   msg=f"[{scn}] step {step} grad {name}")  # fmt: skip
                opt_ref.step()
                opt_tide.step()
                opt_ref.zero_grad()
                opt_tide.zero_grad()
            assert unsharded["n"] > before, "TIDE-AG never ran"
            torch.cuda.synchronize()
            assert min(t.counters.puts for t in ags) > 0, "no one-sided TIDE-AG put"
            assert min(s.counters.puts for s in sides) > 0, "no one-sided TIDE-RS put"
            comm.remove(tide)
    finally:
        tide_ag.set_debug_hooks()
        tide_rs.set_poison(None)
    if rank == 0:
        assert records.grep("cross-node nccl_one_sided"), records.messages
    print(f"[rank {rank}] one-sided parity: gradients bitwise equal to FSDP2's: {bitwise}")


@needs_multi_rank_gpu
@pytest.mark.parametrize("transport", ["nccl_one_sided", "auto"])
def test_one_node_one_sided_parity_with_fsdp2(transport):
    """Gradients after each backward, losses and unsharded parameters (poisoned) equal to
    stock FSDP2's over the one-sided path, explicit and taken by ``auto``."""
    _spawn(_parity, "one_node", transport)


def _kernels_in_step(rank: int, world_size: int, transport: str, result_file: str) -> None:
    import json

    import torch.nn.functional as F
    from torch.autograd import DeviceType

    from torchtitan_tide import comm

    device = torch.device("cuda", 0)
    model = build(Scenario(bf16=True), device)
    comm.apply(model, "tide", local_world_size=1, cross_node_transport=transport,
               ag_storage_swap="ctypes")  # in place on torch 2.11 too
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(3 + rank)

    def step():
        ((x, y),) = _batches(gen, device, 1)
        F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    nccl_kernels = [n for n in names if "nccl" in n.lower() and "memcpy" not in n.lower()]
    copies = [n for n in names if "memcpy" in n.lower()]
    comm.remove(model)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"transport": transport, "nccl_kernels": len(nccl_kernels),
                       "nccl_kernel_names": sorted(set(nccl_kernels)), "copies": len(copies)}, f)  # fmt: skip


@needs_multi_rank_gpu
def test_one_sided_step_runs_no_nccl_kernel(tmp_path):
    """Profiled TIDE step: send/recv runs NCCL kernels, the one-sided path none (its puts
    are copies)."""
    import json

    seen = {}
    for transport in ("p2p", "nccl_one_sided"):
        out = tmp_path / f"{transport}.json"
        _spawn(_kernels_in_step, "one_node", transport, str(out))
        seen[transport] = json.loads(out.read_text())
    print(seen)
    assert seen["p2p"]["nccl_kernels"] > 0, seen  # the profile sees NCCL's kernels
    assert seen["nccl_one_sided"]["nccl_kernels"] == 0, seen
    assert seen["nccl_one_sided"]["copies"] > 0, seen


def _no_host_rma(rank: int, world_size: int) -> None:
    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp.install import TideConfigError

    device = torch.device("cuda", 0)
    records = _records()
    model = build(Scenario(bf16=True), device)
    comm.apply(model, "tide", local_world_size=1, cross_node_transport="auto")
    if rank == 0:
        fallbacks = records.grep("cross-node p2p (auto:")
        assert fallbacks, records.messages
        print(f"auto across emulated nodes: {fallbacks[0]}")
    comm.remove(model)
    model = build(Scenario(bf16=True), device)
    with pytest.raises(TideConfigError, match="cross_node_transport = 'nccl_one_sided'"):
        comm.apply(model, "tide", local_world_size=1, cross_node_transport="nccl_one_sided")


def test_emulated_nodes_without_host_rma_fall_back_or_refuse():
    """Across emulated nodes (sockets) NCCL has no host RMA (or is older than 2.29):
    ``auto`` keeps send/recv and says why; ``nccl_one_sided`` is a named error."""
    _spawn(_no_host_rma, "nodes")


@needs_multi_rank_gpu
def test_stopped_peer_inside_a_one_sided_wait_ends_the_job(tmp_path):
    """Rank 1 stops before step 2: rank 0's one-sided waits (GPU stream waits, no host
    block) pass their deadline and TIDE's watchdog ends rank 0 naming rank 1."""
    from test_watchdog_gpu import _stalled_peer, check_survivor_ended_by_watchdog

    options = {"local_world_size": 1, "cross_node_transport": "nccl_one_sided"}
    ctx = mp.start_processes(
        _entry,
        args=(2, free_port(), "one_node", _stalled_peer, (options, str(tmp_path), 0)),
        nprocs=2, join=False, start_method="spawn",
    )  # fmt: skip
    check_survivor_ended_by_watchdog(ctx, tmp_path)


def _bf16_wire(rank: int, world_size: int) -> None:
    """[tide] rs_wire_dtype = "bfloat16" over the one-sided phase 2
    (docs/design/2026-12-02-rs-wire.md).
    One rank per TIDE node with bf16 gradients: each partial is one bf16 gradient, so the
    rounding is exact and every gradient equals the fp32 wire's bitwise, at half the put
    bytes; the rounded partial is put from the window (``wire_slot``)."""
    import torch.nn.functional as F

    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch
    from torchtitan_tide.comm.fsdp import reduce_scatter as tide_rs

    device = torch.device("cuda", 0)
    tide_rs.set_poison(float("nan"))
    grads: dict[str, list[torch.Tensor]] = {}
    put_bytes: dict[str, int] = {}
    try:
        for wire in ("float32", "bfloat16"):
            model = build(Scenario(bf16=True), device)
            comm.apply(model, "tide", local_world_size=1, cross_node_transport="nccl_one_sided",
                       rs_wire_dtype=wire)  # fmt: skip
            states = [g._tide_rs_state for _, g in fsdp_patch.fsdp_param_groups(model)]
            assert all(s.cross_node.name == "nccl_one_sided" for s in states), (
                "phase 2 is not one-sided"
            )
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
            gen = torch.Generator().manual_seed(11 + rank)
            grads[wire] = []
            for _ in range(2):
                ((x, y),) = _batches(gen, device, 1)
                F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
                grads[wire] += [p.grad.to_local().clone() for p in model.parameters()]
                opt.step()
                opt.zero_grad()
            torch.cuda.synchronize()
            sides = {id(s.cross_node): s.cross_node for s in states}.values()
            put_bytes[wire] = sum(s.counters.put_bytes for s in sides)
            if wire == "bfloat16":
                for s in states:
                    send, window = s.buffers.send, s.cross_node.window
                    assert send is not None and send.dtype == torch.bfloat16
                    assert window.ptr <= send.data_ptr() < window.ptr + window.nbytes
            comm.remove(model)
    finally:
        tide_rs.set_poison(None)
    for a, b in zip(grads["float32"], grads["bfloat16"], strict=True):
        assert not torch.isnan(b).any(), "unwritten gradient"
        assert torch.equal(a, b), "bf16 wire changed partials that are bf16 already"
    assert put_bytes["float32"] > 0 and put_bytes["bfloat16"] * 2 == put_bytes["float32"], put_bytes


@needs_multi_rank_gpu
def test_one_sided_bf16_wire_exact_at_one_rank_per_node_half_bytes():
    _spawn(_bf16_wire, "one_node")
