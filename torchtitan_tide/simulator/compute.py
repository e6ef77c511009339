"""Compute of one FSDP group at the simulated workload, from a trace at another one.

- Tokens and sequence: a group's time is split into attention (the flash-attention
  kernels of the profiled trace, ``bench_trace --kernels``; without one, by FLOPs) and
  the rest. The rest scales with tokens per GPU; self-attention with tokens x sequence
  length (quadratic in the sequence at a fixed batch); Wan2.2's cross-attention to its
  512 text tokens with tokens (its share of the attention time by FLOPs).
- Activation checkpointing as configured (``[activation_checkpoint]``): ``none``
  recomputes nothing; ``full`` one forward in backward; ``selective`` with
  ``selective_ac_option = "N"`` wraps every N-th block (``"0"``: every block): 1/N of a
  forward; ``selective_ac_option = "op"`` (TorchTitan's per-op policy) saves attention
  and every other ``mm``: it recomputes the forward minus attention minus half of the
  dense GEMM time (grouped expert GEMMs are not ``mm``: recomputed). The traced config's
  own recompute is taken out first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchtitan_tide.comm.plans.memory_plan import GroupShape
from torchtitan_tide.simulator.interference import ATTENTION, GROUPED, kernel_class
from torchtitan_tide.simulator.results import SimulateError

_DENSE = "dense"  # kernel_class's label for every kernel that is not attention / grouped
_MAX_ATTENTION = 0.95


@dataclass(frozen=True)
class GroupCompute:
    """Forward / backward ms of one FSDP group on one GPU."""

    fwd_ms: float
    bwd_ms: float


@dataclass(frozen=True)
class Workload:
    """Per GPU and step: ``tokens`` in ``batch`` samples of ``seq_len`` tokens each."""

    tokens: int
    seq_len: int

    @property
    def batch(self) -> float:
        return self.tokens / self.seq_len


def workload_of(table: Mapping[str, Any], model_args: Any) -> Workload:
    """``local_batch_size`` x tokens per sample: ``seq_len``, or for Wan2.2 the
    patchified latent (``[wan22] latent_frames x latent_height x latent_width / patch``)."""
    import math

    training = table.get("training", {})
    batch = int(training.get("local_batch_size", 8))
    if hasattr(model_args, "patch_size"):
        from models.wan22.job_config import Wan22DataConfig

        data = {**vars(Wan22DataConfig()), **table.get("wan22", {})}
        latent = (data["latent_frames"], data["latent_height"], data["latent_width"])
        seq = math.prod(n // p for n, p in zip(latent, model_args.patch_size))
    else:
        seq = int(training.get("seq_len", 2048))
    return Workload(batch * seq, seq)


def recompute_fraction(
    ac: Mapping[str, Any], shares: Mapping[str, float], where: str = "[activation_checkpoint]"
) -> tuple[float, str]:
    """The forward time recomputed in backward per block, as a fraction of its forward
    (module docstring); ``shares``: the compute classes' time shares (``attention``,
    ``grouped_experts``, the rest dense GEMM and other kernels)."""
    mode = str(ac.get("mode", "selective"))
    option = str(ac.get("selective_ac_option", "2"))
    match mode:
        case "none":
            return 0.0, "none"
        case "full":
            return 1.0, "full: one forward recomputed"
        case "selective" if option.isdigit():
            every = int(option)
            fraction = 1.0 if every == 0 else 1.0 / every
            return fraction, f"selective, every {every or 1} block(s): {fraction:.2f} forward"
        case "selective" if option == "op":
            attention = shares.get(ATTENTION, 0.0)
            dense = 1.0 - attention - shares.get(GROUPED, 0.0)
            fraction = max(0.0, 1.0 - attention - 0.5 * dense)
            return fraction, (
                f"selective per op: forward minus attention ({100 * attention:.0f}%) and half "
                f"the dense GEMMs and other kernels ({100 * dense:.0f}%): {fraction:.2f} forward"
            )
        case "selective":
            raise SimulateError(
                f"{where} selective_ac_option = {option!r}: the simulator models 'op' or a "
                "block count ('2')"
            )
        case _:
            raise SimulateError(
                f"{where} mode = {mode!r}: the simulator models none, selective or full "
                "(memory_budget's recompute depends on the solver: not modeled)"
            )


def attention_flops_share(model_args: Any, work: Workload) -> tuple[float, float]:
    """(attention's share of a block's forward FLOPs, its quadratic part's share of the
    attention FLOPs): self-attention ``4 s^2 H d`` per sample (half of it causal),
    Wan2.2's cross-attention ``4 s T H d`` (T text tokens), against ``2 x block params x
    tokens`` (MoE: the active experts)."""
    heads = int(getattr(model_args, "n_heads", getattr(model_args, "num_heads", 0)) or 0)
    dim = int(getattr(model_args, "dim", 0) or 0)
    head_dim = int(getattr(model_args, "head_dim", 0) or (dim // heads if heads else 0))
    if not heads or not head_dim:
        return 0.0, 1.0
    causal = not hasattr(model_args, "patch_size")
    self_flops = 4 * work.batch * work.seq_len**2 * heads * head_dim * (0.5 if causal else 1)
    cross = 4 * work.tokens * int(getattr(model_args, "text_len", 0)) * heads * head_dim
    dense = 2 * work.tokens * _block_active_params(model_args)
    attn = self_flops + cross
    return attn / (attn + dense), self_flops / attn if attn else 1.0


def _block_active_params(model_args: Any) -> float:
    """Parameters one token multiplies with in one block (attention projections + FFN;
    MoE: top_k experts and the shared FFN where present)."""
    dim = int(getattr(model_args, "dim", 0))
    heads = int(getattr(model_args, "n_heads", getattr(model_args, "num_heads", 1)))
    kv = int(getattr(model_args, "n_kv_heads", None) or heads)
    head_dim = int(getattr(model_args, "head_dim", 0) or dim // heads)
    attn = dim * head_dim * (2 * heads + 2 * kv)
    moe = getattr(model_args, "moe_args", None)
    if moe is not None and getattr(model_args, "moe_enabled", True):
        ffn = 3 * dim * int(getattr(model_args, "moe_inter_dim", 0)) * moe.top_k
    else:
        hidden = int(getattr(model_args, "ffn_dim", 0) or getattr(model_args, "hidden_dim", 0))
        if not hidden:
            hidden = int(8 * dim / 3 * float(getattr(model_args, "ffn_dim_multiplier", 1) or 1))
        ffn = (2 if hasattr(model_args, "patch_size") else 3) * dim * hidden
    return attn + ffn


def trace_shares(trace: Mapping[str, Any]) -> dict[str, float] | None:
    """Time shares of attention, grouped GEMMs and the rest in a profiled trace's top
    kernels; None without a profiled iteration."""
    kernels = (trace.get("profiled_iteration") or {}).get("kernels") or []
    total = sum(k["ms"] for k in kernels)
    if not total:
        return None
    shares: dict[str, float] = {}
    for k in kernels:
        cls = kernel_class(k["name"], _DENSE)
        shares[cls] = shares.get(cls, 0.0) + k["ms"] / total
    return shares


def attention_share_of_blocks(
    trace: Mapping[str, Any], groups_ms: float
) -> tuple[float | None, str]:
    """Attention kernels' ms of the profiled iteration over the blocks' traced fwd+bwd ms
    (None without a profiled iteration)."""
    kernels = (trace.get("profiled_iteration") or {}).get("kernels") or []
    if not kernels or groups_ms <= 0:
        return None, "no profiled kernels in the trace"
    attn = sum(k["ms"] for k in kernels if kernel_class(k["name"], _DENSE) == ATTENTION)
    share = min(_MAX_ATTENTION, attn / groups_ms)
    return share, f"flash-attention kernels {attn:.1f} ms of {groups_ms:.1f} block ms"


def compute_from_trace(
    trace: Mapping[str, Any],
    groups: Sequence[GroupShape],
    target: Workload,
    traced: Workload,
    attention: float,
    quadratic: float,
    recompute: tuple[float, float],
) -> tuple[dict[str, GroupCompute], float, float]:
    """Per group ms at ``target`` from a trace at ``traced``: each block's ``attention``
    share (its ``quadratic`` part scales with tokens x sequence, the rest with tokens),
    other groups with tokens; ``recompute`` = (target, traced) forward fractions
    recomputed in backward. A group the trace lacks takes the median block."""
    import statistics

    by_name = {g["group"]: g for g in trace["groups"]}
    blocks = [g for n, g in by_name.items() if n.startswith("layers.")]
    median_block = {k: statistics.median(g[k] for g in blocks) for k in ("fwd_ms", "bwd_ms")}
    tokens = target.tokens / traced.tokens
    seq = target.seq_len / traced.seq_len
    block_scale = tokens * (1 - attention + attention * (1 - quadratic + quadratic * seq))
    want, had = recompute
    out = {}
    for group in groups:
        if group.name == "root":
            continue
        src = by_name.get(group.name) or (
            median_block if group.name.startswith("layers.") else None
        )
        if src is None:
            raise SimulateError(f"the trace has no group {group.name!r} (it has {sorted(by_name)})")
        is_block = group.name.startswith("layers.")
        scale = block_scale if is_block else tokens
        redo = (want, had) if is_block else (0.0, 0.0)
        fwd = scale * src["fwd_ms"]
        bwd = scale * (src["bwd_ms"] - redo[1] * src["fwd_ms"]) + redo[0] * fwd
        out[group.name] = GroupCompute(fwd, bwd)
    return out, tokens * trace["root_fwd_ms"], tokens * trace["root_bwd_ms"]


def compute_from_flops(
    cm: Any, work: Workload, mfu: float, peak_flops: float, recompute: float
) -> dict[str, GroupCompute]:
    """Without a trace: 2 x active params x tokens per forward (+ attention FLOPs for
    the blocks), 2 x per backward, at ``mfu`` of ``peak_flops``; ``recompute`` forwards
    added to each block's backward."""
    out = {}
    share = cm.active_numel / max(1, cm.total_numel)
    attention, _ = attention_flops_share(cm.model_args, work)
    for group in cm.groups:
        if group.name == "root":
            continue
        dense = 2 * group.numel * share * work.tokens
        is_block = group.name.startswith("layers.")
        flops = dense / (1 - attention) if is_block and attention < 1 else dense
        fwd = 1e3 * flops / (peak_flops * mfu)
        out[group.name] = GroupCompute(fwd, 2 * fwd + (recompute * fwd if is_block else 0.0))
    return out
