"""Compute floor of a step config: the per-GPU work of an N-rank step on ONE device.

The model, shapes, loss and data are those the trainer builds for ``--config``: the
train spec registered by ``torchtitan_tide.train_specs``, its model args updated from
the config, its ``parallelize_fn`` (activation checkpointing as the config says; with
one rank no FSDP and no communication), TorchTitan's meta-device init. Per-GPU work of
an ``--world-size``-rank step, each part timed on its own:

- ``fwd_bwd``: the model with its parameters in ``mixed_precision_param`` (bf16 in the
  H200 configs), forward + loss + backward on one rank's batch (``local_batch_size`` x
  ``seq_len`` random token ids, full vocabulary; Wan2.2: its own synthetic data pipeline
  and flow-matching loss), grads set to None before each iteration; a parameter that
  ``init_weights`` leaves all zero (Wan2.2's output head) is filled with ``normal(0,
  optimizer.lr)`` first, as after the trainer's first step: else every gradient above
  it is zero and backward runs faster than in training;
- ``adamw``: TorchTitan's optimizer (``[optimizer]``, fused AdamW) on rank 0's fp32
  shards (dim 0 split in ``world_size`` parts, FSDP2's layout), random fp32 grads;
- ``clip``: TorchTitan's grad-norm clip over those shards;
- ``cast``: the fp32 -> param-dtype copy of those shards (what every all-gather's
  copy-in casts), reported beside the floor, not in it.

``floor_ms = fwd_bwd + adamw + clip``, each the lowest of the ``--rounds`` medians
(CUDA events after ``--warmup`` iterations; each variant timed once per round, rounds
interleaved). Writes ``<date>_<machine>_<commit>_floor_<config>.{json,md,png}``:

    python scripts/bench/bench_floor.py --config h200x2_llama70b_4layers \\
        [--world-size 2] [--device auto|cuda|cpu] [--rounds 2] [--warmup 2] [--iters 0] \\
        [--out-dir bench/results] [--model.flavor debugmodel ...]

Arguments this script does not know are TorchTitan config overrides. Docs:
docs/design/2026-12-01-compute-floor.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import common

VARIANTS = ("fwd_bwd", "adamw", "clip", "cast")
FLOOR_PARTS = ("fwd_bwd", "adamw", "clip")
MIN_ITERS, MAX_ITERS = 3, 20


class FloorConfigError(ValueError):
    """The config asks for something this benchmark does not model; the message says what."""


def load_job_config(config: str, overrides: Sequence[str] = ()):
    """TorchTitan's JobConfig of ``config`` (a name in train_configs/ or a path) with
    TorchTitan command-line ``overrides``."""
    from torchtitan.config import ConfigManager

    from torchtitan_tide.launch.command_line import resolve_config

    path = resolve_config(config)
    return ConfigManager().parse_args(["--job.config_file", str(path), *overrides])


def check_supported(job_config) -> None:
    """Raise :class:`FloorConfigError` for parallelisms or options whose per-GPU work
    this benchmark does not reproduce (it would measure something else silently)."""
    par = job_config.parallelism
    for key in ("tensor_parallel_degree", "context_parallel_degree", "pipeline_parallel_degree",
                "expert_parallel_degree"):  # fmt: skip
        if getattr(par, key, 1) > 1:
            raise FloorConfigError(f"parallelism.{key} = {getattr(par, key)}: the floor models "
                                   "FSDP only; set it to 1")  # fmt: skip
    if par.data_parallel_replicate_degree > 1:
        raise FloorConfigError("parallelism.data_parallel_replicate_degree > 1 is not modeled; "
                               "use --world-size for the FSDP degree")  # fmt: skip
    if job_config.compile.enable:
        raise FloorConfigError("compile.enable = true: the floor runs eager; set it to false")
    if job_config.model.converters:
        raise FloorConfigError(f"model.converters = {job_config.model.converters}: not modeled")
    if job_config.optimizer.early_step_in_backward:
        raise FloorConfigError("optimizer.early_step_in_backward = true: not modeled")


@contextlib.contextmanager
def one_rank_process_group() -> Iterator[None]:
    """A 1-rank gloo process group for the duration (``parallelize_fn`` asks for the
    rank); nothing communicates. Reuses a group that already exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def one_rank_parallel_dims():
    """ParallelDims of a 1-rank run: no FSDP, TP, CP, PP or EP (nothing communicates)."""
    from torchtitan.distributed import ParallelDims

    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)


def fill_zero_parameters(model: nn.Module, std: float, seed: int) -> list[str]:
    """Fill every floating-point parameter that is all zeros with seeded ``normal(0, std)``
    (in place); returns their names. A zero-initialized output layer (Wan2.2's ``head``)
    makes every gradient above it exactly zero until the optimizer's first step moves it:
    timed on such a model, backward multiplies zeros, draws less power and runs faster
    than in training (measured 2026-12-03: Wan2.2's backward kernels took x 1.12-1.15 as
    long in a training step, docs/design/2026-12-02-simulator.md, "2026-12-03, third session")."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    filled = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.numel() and not param.any():
                noise = torch.randn(param.shape, generator=gen, device=param.device)
                param.copy_(noise.mul_(std))
                filled.append(name)
    return filled


def name_patterns(names: Sequence[str]) -> str:
    """``names`` with layer numbers as ``*`` and activation-checkpoint wrappers dropped,
    each pattern once, in order: ``layers.*.ffn.0.bias, head.head.weight``."""
    unwrapped = (n.replace("_checkpoint_wrapped_module.", "") for n in names)
    patterns = (re.sub(r"\blayers\.\d+\.", "layers.*.", n) for n in unwrapped)
    return ", ".join(dict.fromkeys(patterns))


class BuiltModel(NamedTuple):
    model: nn.Module
    spec: Any  # TorchTitan's TrainSpec
    model_args: Any
    zero_filled: list[str]  # parameters init_weights left all zero, filled (fill_zero_parameters)


def build_model(job_config, device: torch.device, seed: int = 0) -> BuiltModel:
    """The model as the Trainer builds it: meta-device model of the spec's flavor, the
    spec's ``parallelize_fn`` (on one rank: activation checkpointing only), ``to_empty``
    + ``init_weights``. Then, unlike the Trainer, every parameter ``init_weights`` left all
    zero is filled with seeded ``normal(0, optimizer.lr)`` (about AdamW's first update;
    :func:`fill_zero_parameters`); every other value is untouched. Last, every parameter
    cast to ``training.mixed_precision_param`` (what FSDP2's mixed precision computes in)."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.tools import utils

    import torchtitan_tide.train_specs  # noqa: F401  (registers the specs)

    spec = get_train_spec(job_config.model.name)
    model_args = copy.deepcopy(spec.model_args[job_config.model.flavor])
    model_args.update_from_config(job_config)
    attn = getattr(model_args, "attn_type", "sdpa")
    if attn != "sdpa":
        raise FloorConfigError(f"model attn_type {attn!r}: only sdpa is modeled (no masks)")
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]):
        model = spec.model_cls(model_args)
    model = spec.parallelize_fn(model, one_rank_parallel_dims(), job_config)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    filled = fill_zero_parameters(model, job_config.optimizer.lr, seed)
    if filled:
        print(f"[bench_floor] {len(filled)} all-zero parameters after init_weights filled with "
              f"normal(0, optimizer.lr = {job_config.optimizer.lr:g}): {name_patterns(filled)}",
              flush=True)  # fmt: skip
    model.train()
    param_dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    for p in model.parameters():
        p.data = p.data.to(param_dtype)
    return BuiltModel(model, spec, model_args, filled)


def local_batch(job_config, spec, model_args, world_size: int, device: torch.device, seed: int):
    """(input, extra model inputs, labels) of rank 0's batch. Language models: random
    token ids in [0, vocab_size) of shape (local_batch_size, seq_len); models without a
    vocabulary (Wan2.2): the first batch of the spec's own dataloader for rank 0 of
    ``world_size``."""
    if hasattr(model_args, "vocab_size"):
        gen = torch.Generator().manual_seed(seed)
        shape = (job_config.training.local_batch_size, job_config.training.seq_len)
        tokens = torch.randint(0, model_args.vocab_size, (2, *shape), generator=gen)
        return tokens[0].to(device), {}, tokens[1].to(device)
    loader = spec.build_dataloader_fn(
        dp_world_size=world_size, dp_rank=0, tokenizer=None, job_config=job_config
    )
    input_dict, labels = next(iter(loader))
    extra = {k: v.to(device) for k, v in input_dict.items() if k != "input"}
    return input_dict["input"].to(device), extra, labels.to(device)


def shard_rows(rows: int, world_size: int) -> int:
    """Rows of rank 0's dim-0 shard of a ``rows``-row parameter (``torch.chunk``: the largest)."""
    return math.ceil(rows / world_size)


class Shards(nn.Module):
    """Rank 0's fp32 shards of every model parameter, each with a random fp32 grad."""

    def __init__(self, model: nn.Module, world_size: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
        self.shards = nn.ParameterList()
        for p in model.parameters():
            local = p.detach()[: shard_rows(p.shape[0], world_size)] if p.dim() else p.detach()
            shard = nn.Parameter(local.to(torch.float32, copy=True))
            shard.grad = torch.randn(
                shard.shape, generator=gen, device=shard.device, dtype=torch.float32
            )
            self.shards.append(shard)


@dataclass
class FloorWork:
    """Everything the timed variants touch (built once)."""

    model: nn.Module
    loss_fn: Callable
    inputs: torch.Tensor
    extra_inputs: dict[str, torch.Tensor]
    labels: torch.Tensor
    microbatches: int
    shards: Shards
    optimizers: Any
    max_norm: float
    cast_dst: list[torch.Tensor]

    def fwd_bwd(self) -> None:
        for _ in range(self.microbatches):
            pred = self.model(self.inputs, **self.extra_inputs)
            loss = self.loss_fn(pred, self.labels) / self.labels.numel()
            del pred
            loss.backward()

    def adamw(self) -> None:
        self.optimizers.step()

    def clip(self) -> None:
        from torchtitan.distributed import utils as dist_utils

        dist_utils.clip_grad_norm_(list(self.shards.parameters()), self.max_norm, foreach=True)

    def cast(self) -> None:
        torch._foreach_copy_(self.cast_dst, [p.detach() for p in self.shards.parameters()])

    def setup(self, variant: str) -> None:
        """Untimed work before each iteration: backward starts without grads (FSDP2's
        unsharded grads are fresh every step)."""
        if variant == "fwd_bwd":
            self.model.zero_grad(set_to_none=True)


def build_work(job_config, world_size: int, device: torch.device, seed: int = 0) -> tuple:
    """(FloorWork, description dict) for ``job_config`` on ``device``."""
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import TORCH_DTYPE_MAP

    # seed + 2: a stream of its own (local_batch draws from seed, the shards from seed + 1)
    model, spec, model_args, filled = build_model(job_config, device, seed + 2)
    inputs, extra, labels = local_batch(job_config, spec, model_args, world_size, device, seed)
    loss_fn = spec.build_loss_fn(job_config, parallel_dims=one_rank_parallel_dims())
    global_batch = job_config.training.global_batch_size
    per_step = job_config.training.local_batch_size * world_size
    if global_batch > 0 and global_batch % per_step:
        raise FloorConfigError(f"training.global_batch_size = {global_batch} is not a multiple "
                               f"of local_batch_size x world size = {per_step}")  # fmt: skip
    microbatches = global_batch // per_step if global_batch > 0 else 1
    shards = Shards(model, world_size, seed + 1)
    optimizers = build_optimizers([shards], job_config.optimizer, one_rank_parallel_dims())
    param_dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    cast_dst = [torch.empty_like(p, dtype=param_dtype) for p in shards.parameters()]
    work = FloorWork(model, loss_fn, inputs, extra, labels, microbatches, shards, optimizers,
                     job_config.training.max_norm, cast_dst)  # fmt: skip
    about = {
        "model": job_config.model.name,
        "flavor": job_config.model.flavor,
        "params": sum(p.numel() for p in model.parameters()),
        "shard_params": sum(p.numel() for p in shards.parameters()),
        "param_dtype": str(param_dtype).replace("torch.", ""),
        "input_shape": list(inputs.shape),
        "label_elements": labels.numel(),
        "microbatches": microbatches,
        "activation_checkpoint": job_config.activation_checkpoint.mode,
        "optimizer": f"{job_config.optimizer.name} ({job_config.optimizer.implementation})",
        "max_norm": job_config.training.max_norm,
        "zero_params_filled": filled,
        "zero_params_std": job_config.optimizer.lr,
    }
    return work, about


def time_iterations(
    body: Callable[[], None], setup: Callable[[], None], device: torch.device, iters: int
) -> list[float]:
    """Milliseconds of ``iters`` runs of ``body`` (``setup()`` untimed before each): CUDA
    events around each run on the current stream, read after one final synchronize;
    on CPU the wall clock."""
    if device.type != "cuda":
        out = []
        for _ in range(iters):
            setup()
            t0 = time.perf_counter()
            body()
            out.append(1e3 * (time.perf_counter() - t0))
        return out
    marks = []
    for _ in range(iters):
        setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        body()
        end.record()
        marks.append((start, end))
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in marks]


def auto_iters(warm_ms: Sequence[float], target_s: float) -> int:
    """Timed iterations that take about ``target_s`` at the warm-up pace, in
    [MIN_ITERS, MAX_ITERS]."""
    per = max(common.median(warm_ms), 1e-3)
    return int(min(MAX_ITERS, max(MIN_ITERS, round(1e3 * target_s / per))))


def measure(work: FloorWork, device: torch.device, rounds: int, warmup: int, iters: int,
            target_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """Per round, per variant: ``median_ms``, ``min_ms``, ``max_ms``, ``iters``."""
    out = []
    chosen: dict[str, int] = {}
    for round_index in range(1, rounds + 1):
        figures: dict[str, Any] = {"round": round_index}
        for variant in VARIANTS:
            body, setup = getattr(work, variant), lambda v=variant: work.setup(v)
            warm = time_iterations(body, setup, device, max(warmup, 1))
            n = iters or chosen.setdefault(variant, auto_iters(warm, target_s))
            ms = time_iterations(body, setup, device, n)
            figures[variant] = {"median_ms": common.median(ms), "min_ms": min(ms),
                                "max_ms": max(ms), "iters": n}  # fmt: skip
            print(f"[bench_floor] round {round_index} {variant}: median "
                  f"{figures[variant]['median_ms']:.3f} ms over {n}", flush=True)  # fmt: skip
        figures["floor_ms"] = sum(figures[v]["median_ms"] for v in FLOOR_PARTS)
        out.append(figures)
    return out


def summarize(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Top-level figures: every variant's ``<variant>_ms`` (lowest round median),
    ``floor_ms`` (their sum over :data:`FLOOR_PARTS`), ``floor_with_cast_ms``, and the
    per-round floor range ``floor_min_ms`` / ``floor_max_ms``."""
    out = {f"{v}_ms": min(r[v]["median_ms"] for r in rounds) for v in VARIANTS}
    out["floor_ms"] = sum(out[f"{v}_ms"] for v in FLOOR_PARTS)
    out["floor_with_cast_ms"] = out["floor_ms"] + out["cast_ms"]
    out["floor_min_ms"] = min(r["floor_ms"] for r in rounds)
    out["floor_max_ms"] = max(r["floor_ms"] for r in rounds)
    return out


def tables(rounds: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> list[dict]:
    n = len(rounds)
    rows = []
    for v in (*VARIANTS, "floor"):
        row: dict[str, Any] = {"part": {"floor": "floor (fwd_bwd + adamw + clip)"}.get(v, v)}
        for r in rounds:
            row[f"r{r['round']}_ms"] = r["floor_ms"] if v == "floor" else r[v]["median_ms"]
        row["best_ms"] = summary[f"{v}_ms"]
        row["iters"] = rounds[0][v]["iters"] if v != "floor" else None
        rows.append(row)
    columns = [["part", "part"], *[[f"r{i}_ms", f"round {i} median ms"] for i in range(1, n + 1)],
               ["best_ms", "best ms"], ["iters", "timed iterations"]]  # fmt: skip
    return [{"title": "Per-GPU work, one device", "columns": columns, "rows": rows}]


def zero_fill_note(about: Mapping[str, Any]) -> str:
    """The Markdown sentence naming the all-zero parameters :func:`build_model` filled."""
    filled = about.get("zero_params_filled")
    if not filled:
        return ""
    return (f" All-zero after init_weights, filled with normal(0, {about['zero_params_std']:g}) "
            f"so that backward does not run on zero gradients: {name_patterns(filled)}.")  # fmt: skip


def write_outputs(stem: Path, results: Mapping[str, Any]) -> str:
    about, meta = results["work"], results["metadata"]
    notes = (
        f"{meta['machine']}, torch {meta['torch']}, commit {meta['commit']}, {meta['date']}. "
        f"Config `{results['config']}`: per-GPU work of a {results['world_size']}-rank step "
        f"on one device, no communication. {about['model']} {about['flavor']}, "
        f"{about['params']:,} parameters in {about['param_dtype']}, input {about['input_shape']}"
        f" x {about['microbatches']} microbatch(es), activation checkpointing "
        f"{about['activation_checkpoint']}; {about['optimizer']} and grad-norm clip "
        f"(max_norm {about['max_norm']}) on rank 0's fp32 shards ({about['shard_params']:,} "
        f"parameters); cast = fp32 -> {about['param_dtype']} copy of those shards. Medians "
        f"after {results['args']['warmup']} warm-up iterations per variant and round; best = "
        f"lowest round. floor_ms = {results['floor_ms']:.3f} ms "
        f"(rounds {results['floor_min_ms']:.3f}-{results['floor_max_ms']:.3f}); with the cast "
        f"{results['floor_with_cast_ms']:.3f} ms."
        + zero_fill_note(about)
        + (
            f" Peak allocated {results['peak_allocated_gib']:.1f} GiB."
            if results.get("peak_allocated_gib") is not None
            else ""
        )
        + "\n"
    )
    labels = list(VARIANTS) + ["floor"]
    charts = [common.BarChart(f"compute floor, {results['config']} (ms, best round)", labels,
                              [results[f"{v}_ms"] for v in labels], "ms")]  # fmt: skip
    return common.write_result(stem, results, f"Compute floor: {results['config']}", notes, charts)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise FloorConfigError("--device cuda but CUDA is not available; use --device cpu")
    if name not in ("cuda", "cpu"):
        raise FloorConfigError(f"--device {name!r}: use auto, cuda or cpu")
    return (
        torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")
    )


def prepare(device_name: str, config: str, overrides: Sequence[str]) -> tuple:
    """(device, checked JobConfig) of a one-device run (CPU: the project's CPU shims);
    the torch seed set from ``[debug] seed``. Also bench_trace.py's."""
    device = resolve_device(device_name)
    if device.type == "cpu":
        os.environ.setdefault("TIDE_DEVICE", "cpu")
        from torchtitan_tide.device import use_cpu_device
        from torchtitan_tide.train import use_cpu_moe_kernels

        use_cpu_device()
        use_cpu_moe_kernels()
    job_config = load_job_config(config, overrides)
    check_supported(job_config)
    torch.manual_seed(job_config.debug.seed or 0)
    return device, job_config


def result_header(kind: str, args: argparse.Namespace, overrides: Sequence[str],
                  device: torch.device, about: Mapping[str, Any]) -> dict[str, Any]:
    """The first keys of a one-device result (also bench_trace.py's): kind, metadata,
    config, world size, device, arguments, the work's description."""
    return {"kind": kind, "metadata": common.metadata(args.world_size),
            "config": Path(args.config).stem, "world_size": args.world_size,
            "device": str(device), "args": {**vars(args), "overrides": list(overrides)},
            "work": dict(about)}  # fmt: skip


def run(args: argparse.Namespace, overrides: Sequence[str]) -> dict[str, Any]:
    """Build, measure and summarize; returns the result dict (not yet written)."""
    device, job_config = prepare(args.device, args.config, overrides)
    with one_rank_process_group():
        work, about = build_work(job_config, args.world_size, device, seed=args.seed)
        print(f"[bench_floor] {args.config} on {device}, per-GPU work of a "
              f"{args.world_size}-rank step: {about}", flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rounds = measure(work, device, args.rounds, args.warmup, args.iters, args.target_s)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    summary = summarize(rounds)
    return {
        **result_header("floor", args, overrides, device, about),
        **summary,
        "peak_allocated_gib": peak,
        "rounds": rounds,
        "tables": tables(rounds, summary),
        "headline": [],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.step_work_parser(__doc__.splitlines()[0], "measured")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=0,
                        help=f"timed iterations per variant and round; 0: about --target-s "
                             f"of work, {MIN_ITERS}-{MAX_ITERS}")  # fmt: skip
    parser.add_argument("--target-s", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    args, overrides = parser.parse_known_args(argv)
    if args.world_size < 1 or args.rounds < 1:
        parser.error("--world-size and --rounds must be >= 1")
    results = run(args, overrides)
    stem = common.result_stem(args.out_dir, f"floor_{results['config']}", results["metadata"])
    common.announce_results(stem, write_outputs(stem, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
