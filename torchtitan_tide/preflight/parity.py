"""Check 4, ``parity``: a few steps of the small model with ``tide`` and with ``fsdp2`` on the
job's own layout, sharded gradients compared after every backward.

Both copies start from one seed on the job's FSDP mesh (``preflight/model.py``); the
``tide`` copy is the one the ``paths`` check applied TIDE to (the run's ``[tide]`` options,
the transports install chose here). Per step, on equal parameters (the ``fsdp2`` copy's
are copied into the ``tide`` copy before each step), every rank checks:

- the losses are bitwise equal (each forward reads what TIDE-AG gathered);
- the sharded gradients are bitwise equal where the sum order cannot differ: two ranks add
  (one FSDP group of 2, no replicas) in fp32 (``mixed_precision_reduce = "float32"``);
- otherwise both copies' sharded gradients against a float64 reference (the same step in
  float64 on every rank, summed over the data-parallel ranks, sharded as FSDP2 shards): the
  ``tide`` error may not exceed twice the ``fsdp2`` error plus one rounding of the reduce
  dtype per adding rank (FSDP2's own error sets the bound);
- TIDE-RS ran on every group it was installed on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_tide.comm.fsdp.internals import fsdp_param_groups
from torchtitan_tide.preflight import model as small
from torchtitan_tide.preflight.layout import JobLayout
from torchtitan_tide.preflight.report import Row, ranks_text

STEPS = 3
LR = 0.1
FIX = (
    "train with [tide] comm = 'fsdp2' until this is understood; [tide] cross_node_transport = "
    "'p2p' or ag_transport = 'nccl_p2p' isolates the transport; keep the JSON for the report"
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _float64_grads(ref: nn.Module, layout: JobLayout, tokens, targets) -> dict[str, torch.Tensor]:
    """This step's gradients of the summed loss in float64, every parameter's full tensor,
    summed over the data-parallel ranks (collective over the job's FSDP mesh)."""
    full = {name: p.full_tensor().detach().double() for name, p in ref.named_parameters()}
    exact = small.SmallModel(ref.vocab, full["layers.0.up.weight"].shape[0]).to(layout.device)
    exact = exact.double()
    exact.load_state_dict(full)
    small.loss_of(exact, tokens, targets).backward()
    grads = {}
    for name, p in exact.named_parameters():
        grad = p.grad
        for group in (layout.shard_group, layout.replicate_group):
            if group is not None:
                dist.all_reduce(grad, group=group)
        grads[name] = grad
    return grads


def _shard(full: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """``index``'s dim-0 shard as FSDP2 cuts it (``torch.chunk``; empty past the chunks)."""
    chunks = torch.chunk(full, count, dim=0)
    return chunks[index] if index < len(chunks) else full.new_empty((0, *full.shape[1:]))


def run(layout: JobLayout, tide_model: nn.Module, ref_model: nn.Module,
        job_config: Any) -> dict[str, Any]:  # fmt: skip
    """This rank's outcome of :data:`STEPS` steps (module docstring), as plain data."""
    group_size = len(layout.shard_ranks)
    replicas = layout.replicate_group.size() if layout.replicate_group is not None else 1
    reduce_dtype = small.DTYPES[job_config.training.mixed_precision_reduce]
    bitwise = group_size == 2 and replicas == 1 and reduce_dtype == torch.float32
    eps = torch.finfo(reduce_dtype).eps
    adders = group_size * replicas
    opt = torch.optim.SGD(ref_model.parameters(), lr=LR)
    problems: list[str] = []
    worst = {"tide": 0.0, "fsdp2": 0.0}
    for step in range(STEPS):
        with torch.no_grad():
            for p_ref, p_tide in zip(ref_model.parameters(), tide_model.parameters()):
                _local(p_tide).copy_(_local(p_ref))
        tokens, targets = small.batch(ref_model.vocab, layout.rank, step, layout.device)
        loss_ref = small.loss_of(ref_model, tokens, targets)
        loss_ref.backward()
        loss_tide = small.loss_of(tide_model, tokens, targets)
        loss_tide.backward()
        if not torch.equal(loss_ref.detach(), loss_tide.detach()):
            problems.append(f"step {step}: loss {loss_tide.item()!r} vs fsdp2 "
                            f"{loss_ref.item()!r} (the all-gathered parameters differ)")  # fmt: skip
        exact = None if bitwise else _float64_grads(ref_model, layout, tokens, targets)
        named_tide = dict(tide_model.named_parameters())
        for name, p_ref in ref_model.named_parameters():
            g_ref, g_tide = p_ref.grad, named_tide[name].grad
            if g_ref is None or g_tide is None:
                problems.append(f"step {step}: {name}: no sharded gradient "
                                f"({'tide' if g_tide is None else 'fsdp2'})")  # fmt: skip
                continue
            g_ref, g_tide = _local(g_ref), _local(g_tide)
            if bitwise:
                if not torch.equal(g_ref, g_tide):
                    diff = (g_ref.float() - g_tide.float()).abs().max().item()
                    problems.append(f"step {step}: {name}: gradient shard not bitwise equal "
                                    f"(max |diff| {diff:.3g})")  # fmt: skip
                continue
            want = _shard(exact[name], layout.shard_rank, group_size)
            if want.numel() == 0:
                continue
            scale = want.abs().max().item() or 1.0
            err = {k: (g.double() - want).abs().max().item() / scale
                   for k, g in (("tide", g_tide), ("fsdp2", g_ref))}  # fmt: skip
            worst = {k: max(value, err[k]) for k, value in worst.items()}
            if err["tide"] > 2 * err["fsdp2"] + adders * eps:
                problems.append(f"step {step}: {name}: relative error vs float64 "
                                f"{err['tide']:.3g}, fsdp2's {err['fsdp2']:.3g}")  # fmt: skip
        opt.step()
        opt.zero_grad(set_to_none=True)
        tide_model.zero_grad(set_to_none=True)
    installed, ran = [], []
    for fqn, pg in fsdp_param_groups(tide_model):
        rs = getattr(pg, "_tide_rs_state", None)
        if rs is not None:
            installed.append(fqn or "<root>")
            if getattr(rs, "calls", 1):
                ran.append(fqn or "<root>")
    if set(installed) - set(ran):
        problems.append(f"TIDE-RS installed on {sorted(set(installed) - set(ran))} but never ran")
    taken = any(getattr(pg, "_tide_ag_state", None) is not None
                for _, pg in fsdp_param_groups(tide_model))  # fmt: skip
    return {"bitwise": bitwise, "adders": adders, "problems": problems, "worst": worst,
            "taken": taken, "steps": STEPS}  # fmt: skip


def rows(gathered: list[dict[str, Any] | None], skipped: str | None) -> list[Row]:
    """Rank 0's rows from every rank's :func:`run` (None: not run there)."""
    if skipped:
        return [Row("parity", "tide vs fsdp2", "skip", skipped)]
    outcomes = [g for g in gathered if g is not None]
    if not any(g["taken"] for g in outcomes):
        return [Row("parity", "tide vs fsdp2", "skip",
                    "TIDE took FSDP2's path on every group (paths above): nothing to compare")]
    bad = {r: g["problems"] for r, g in enumerate(gathered) if g and g["problems"]}
    first = outcomes[0]
    how = (f"bitwise (2 ranks add in fp32), {first['steps']} steps" if first["bitwise"] else
           f"against float64, {first['adders']} ranks add; worst relative error tide "
           f"{max(g['worst']['tide'] for g in outcomes):.3g}, fsdp2 "
           f"{max(g['worst']['fsdp2'] for g in outcomes):.3g}; {first['steps']} steps")  # fmt: skip
    if not bad:
        return [Row("parity", "losses and sharded gradients", "ok",
                    f"tide = fsdp2 on every rank: losses bitwise, gradients {how}")]
    ranks = sorted(bad)
    worst_rank = ranks[0]
    return [Row("parity", "losses and sharded gradients", "FAIL",
                f"{ranks_text(ranks)}: {'; '.join(bad[worst_rank][:3])} (rank {worst_rank}; "
                f"{sum(len(p) for p in bad.values())} finding(s); gradients {how})",
                ranks, FIX)]  # fmt: skip
