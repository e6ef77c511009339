"""Multi-process harness for TIDE-AG parity tests (CPU gloo and GPU NCCL).

``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in
``world_size`` processes with ``torch.distributed`` initialized (gloo on CPU,
NCCL on CUDA with one GPU per rank). An assertion in any rank fails the test.

``run_parity(...)`` trains two identical small models in lockstep, one with
stock FSDP2 and one with TIDE (TIDE-AG, plus TIDE-RS unless the options say
``reduce_scatter="fsdp2"``), and asserts losses and parameter shards are
bitwise identical after every step (``tolerance=0``) or within ``tolerance``
relative (TIDE-RS sums in another order than the backend's reduce-scatter when
more than two ranks add up), with NaN poisoning of the unsharded storage
before every TIDE all-gather and of every TIDE-RS output before it is
written, and a check that no NaN is left after.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class LogRecords(logging.Handler):
    """Every message logged through the logger it is added to (tests grep them)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def grep(self, text: str) -> list[str]:
        return [m for m in self.messages if text in m]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, device_type: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    torch.set_num_threads(1)
    if device_type == "cuda":
        # NVLink multicast must stay off on these machines (docs/design/2026-11-29-h200-facts.md).
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):  # fmt: skip
            os.environ.setdefault(k, v)
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank)
        )
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args, device_type: str = "cpu") -> None:
    """CPU: fork (children inherit the imported torch; ~0.2 s instead of
    ~15 s of imports on 2 cores). CUDA: spawn (CUDA cannot be forked)."""
    if device_type == "cpu":
        import torch._dynamo  # noqa: F401  - imported lazily by FSDP hooks; share it

        import torchtitan_tide.comm  # noqa: F401

        start_method = "fork"
    else:
        start_method = "spawn"
    mp.start_processes(
        _entry,
        args=(world_size, free_port(), device_type, fn, args),
        nprocs=world_size,
        join=True,
        start_method=start_method,
    )


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)  # e.g. (13, 7): uneven rows
        self.gate = nn.Parameter(torch.full((1,), 0.5))  # 1-element parameter
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.down(F.gelu(self.up(x)))


class TinyModel(nn.Module):
    """Uneven shapes on purpose: embedding with 11 rows, Linear(7, 13),
    1-element parameters, a 5-row head."""

    def __init__(self, vocab: int = 11, dim: int = 7, hidden: int = 13, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


@dataclass(frozen=True)
class Scenario:
    reshard_after_forward: bool | int = True
    bf16: bool = False
    prefetch: bool = False
    grad_accum: int = 1
    steps: int = 3

    def __str__(self) -> str:
        return (
            f"raf={self.reshard_after_forward} bf16={self.bf16} "
            f"prefetch={self.prefetch} accum={self.grad_accum}"
        )


def build(scn: Scenario, device: torch.device) -> nn.Module:
    torch.manual_seed(1234)
    model = TinyModel().to(device)
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if scn.bf16
        else MixedPrecisionPolicy()
    )
    kw = {"reshard_after_forward": scn.reshard_after_forward, "mp_policy": mp_policy}
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if device.type == "cpu":
        # gloo has no PREMUL_SUM/AVG for FSDP's reduce-scatter: sum and divide
        # outside, as torchtitan does (divide factor 1.0).
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # torch >= 2.12
                m.set_force_sum_reduction_for_comms(True)
            elif hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
    if scn.prefetch:
        layers = list(model.layers)
        for i, layer in enumerate(layers[:-1]):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        for i, layer in enumerate(layers[1:], start=1):
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, batches, scn: Scenario) -> torch.Tensor:
    losses = []
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        model.set_requires_gradient_sync(last)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        losses.append(loss.detach())
    opt.step()
    opt.zero_grad()
    return torch.stack(losses)


def run_parity(
    rank: int,
    world_size: int,
    scenarios: list[Scenario],
    tide_options: dict,
    post_apply=None,
    sync_check: bool = True,
    tolerance: float = 0.0,
) -> None:
    """Stock vs TIDE parity (see module docstring). ``post_apply(model)`` runs
    after ``comm.apply`` (white-box tests swap transports there).
    ``sync_check=False`` keeps the NaN poisoning (stream-ordered, no host sync)
    but drops the after-all-gather host check, so GPU stream races are not
    hidden by synchronization; unwritten elements then show up as NaN losses."""
    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import all_gather as tide_ag
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch
    from torchtitan_tide.comm.fsdp import reduce_scatter as tide_rs

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available() and dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    calls = {"n": 0}

    def poison(outputs: list[torch.Tensor]) -> None:
        calls["n"] += 1
        for o in outputs:
            o.fill_(float("nan"))

    def check(outputs: list[torch.Tensor]) -> None:
        for o in outputs:
            assert not torch.isnan(o).any().item(), "TIDE-AG left an element unwritten"

    def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        if tolerance == 0.0:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(b, a, rtol=tolerance, atol=tolerance, msg=what)

    tide_ag.set_debug_hooks(before=poison, after=check if sync_check else None)
    tide_rs.set_poison(float("nan"))
    try:
        for scn in scenarios:
            ref, tide = build(scn, device), build(scn, device)
            comm.apply(tide, "tide", **tide_options)
            if post_apply is not None:
                post_apply(tide)
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
            opt_tide = torch.optim.AdamW(tide.parameters(), lr=1e-2, foreach=False)
            gen = torch.Generator().manual_seed(99 + rank)
            before = calls["n"]
            for step in range(scn.steps):
                batches = [
                    (
                        torch.randint(0, 11, (2, 5), generator=gen).to(device),
                        torch.randint(0, 5, (2, 5), generator=gen).to(device),
                    )
                    for _ in range(scn.grad_accum)
                ]
                l_ref = _step(ref, opt_ref, batches, scn)
                l_tide = _step(tide, opt_tide, batches, scn)
                same(l_ref, l_tide, f"[{scn}] step {step} loss {l_ref} != {l_tide}")
                for (n, p_ref), p_tide in zip(ref.named_parameters(), tide.parameters()):
                    a, b = p_ref.to_local(), p_tide.to_local()
                    assert not torch.isnan(b).any(), f"[{scn}] step {step} param {n} has NaN"
                    same(a, b, f"[{scn}] step {step} param {n} differs")
            assert calls["n"] > before, f"[{scn}] TIDE-AG was never used"
            rs_calls = [
                g._tide_rs_state.calls
                for _, g in fsdp_patch.fsdp_param_groups(tide)
                if hasattr(g, "_tide_rs_state")
            ]
            if tide_options.get("reduce_scatter", "tide") == "tide":
                assert rs_calls and min(rs_calls) > 0, f"[{scn}] TIDE-RS not used: {rs_calls}"
            else:
                assert not rs_calls, f"[{scn}] TIDE-RS installed with reduce_scatter='fsdp2'"
            comm.remove(tide)
    finally:
        tide_ag.set_debug_hooks()
        tide_rs.set_poison(None)
