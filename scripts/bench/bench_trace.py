"""Per-FSDP-group forward/backward durations of a step config on ONE device (the
simulator's compute input, ``python -m torchtitan_tide.simulator --trace``).

The model, shapes, loss and data are bench_floor's (the trainer's, per-GPU work of a
``--world-size``-rank step, no communication). Each FSDP group of the FSDP group model's
grouping (``torchtitan_tide.fsdp_groups.fsdp_group_modules``: the groups FSDP2 would wrap) gets
timing marks: forward from the group's first module's pre-hook to its last module's
forward hook; backward from the gradient hook of the group's output (its backward
starts) to the last gradient accumulated into one of its parameters (it is done). On
CUDA the marks are CUDA events on the current stream (device time, host-bound gaps
inside a group included); on CPU the wall clock. What lies outside every group
(the root: loss, final ops) is ``root_fwd_ms`` / ``root_bwd_ms``. Also the fused AdamW
and grad-norm clip of rank 0's shards (bench_floor's ``adamw`` / ``clip``); where they do
not fit in memory beside the model, ``adamw_ms`` / ``clip_ms`` are null and
``optimizer_error`` says why (the simulator then takes the optimizer from the config's
other trace).

``--precision world1`` traces what the one-GPU trainer runs instead (TorchTitan applies
no FSDP at world 1): fp32 weights, forward and loss under ``torch.autocast`` to
``training.mixed_precision_param`` (a cast of every weight at each use), fp32 gradients;
use it with ``--world-size 1``. The simulator's world-1 rows read it.

``--heat-s S`` runs fwd+bwd for S seconds before the warm-up, so the timed iterations start
on a GPU as warm as a training job's. The H200 is power-capped: its SM clock follows the
power the work draws. On one H200 (2026-12-03) 75 s of heat left the Wan2.2 trace within
0.2% of a cool one, while the same kernels ran 7% slower inside a training step
(docs/design/2026-12-02-simulator.md). With ``nvidia-smi`` the timed iterations' SM clock,
temperature and power are recorded (``clock``), to read a trace beside its clock.

``--kernels TOP`` (CUDA) profiles one more fwd+bwd after the timed ones and keeps its
device time and TOP kernels by name (``profiled_iteration``), to compare with bench_step's
profiled step kernel by kernel.

Medians over ``--iters`` after ``--warmup``. Writes a compact
``<date>_<machine>_<commit>_trace_<config>.{json,md,png}`` (``trace_world1_<config>``
with ``--precision world1``; a few KB; no chrome trace):

    python scripts/bench/bench_trace.py --config h200x2_llama70b_4layers [--world-size 2]
        [--precision fsdp2|world1] [--device auto|cuda|cpu] [--warmup 2] [--iters 5] [--kernels 25]
        [--heat-s 60]
        [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_floor
import common
import gpu_clock

from torchtitan_tide.fsdp_groups import fsdp_group_modules

COLUMNS = [
    ["group", "group"],
    ["params", "params"],
    ["fwd_ms", "fwd ms"],
    ["bwd_ms", "bwd ms"],
    ["reshard_after_forward", "reshard after fwd"],
]


class Marks:
    """Named time marks of one iteration: CUDA events on the current stream, or the
    wall clock on CPU; :meth:`ms` reads them after a synchronize."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: dict[str, Any] = {}
        self.forward = True  # False from the loss on: activation-checkpoint recomputes

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def ms(self, a: str, b: str) -> float:
        """Milliseconds from mark ``a`` to mark ``b``."""
        if self.cuda:
            return self.marks[a].elapsed_time(self.marks[b])
        return 1e3 * (self.marks[b] - self.marks[a])

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, (tuple, list)):
        for item in value:
            if (found := _first_grad_tensor(item)) is not None:
                return found
    if isinstance(value, dict):
        return _first_grad_tensor(list(value.values()))
    return None


def install_marks(groups: Sequence[tuple[str, list, bool]], marks: Marks) -> list:
    """Hooks that mark ``<group>.fwd0/.fwd1/.bwd0/.bwd1`` every iteration; returns the
    handles. ``bwd1`` is re-marked at every gradient accumulated into the group's
    parameters, so the last one stands. Forward hooks that fire again in backward
    (activation-checkpoint recomputes) mark nothing: that time is the group's backward."""
    handles = []
    for name, modules, _ in groups:
        first, last = modules[0], modules[-1]

        def before_forward(module, args, n=name):
            if marks.forward:  # not an activation-checkpoint recompute in backward
                marks.mark(f"{n}.fwd0")

        def after_forward(module, args, output, n=name):
            if not marks.forward:
                return
            marks.mark(f"{n}.fwd1")
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                tensor.register_hook(lambda grad: marks.mark(f"{n}.bwd0"))

        handles.append(first.register_forward_pre_hook(before_forward))
        handles.append(last.register_forward_hook(after_forward))
        for module in modules:
            for p in module.parameters():
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(
                        lambda param, n=name: marks.mark(f"{n}.bwd1")))  # fmt: skip
    return handles


def trace_iteration(
    work: bench_floor.FloorWork, groups, marks: Marks, amp=contextlib.nullcontext
) -> dict[str, float]:
    """One fwd+bwd with marks; per group ``fwd``/``bwd`` ms plus ``fwd_bwd``, ``root_fwd``,
    ``root_bwd`` ms (root: the step's time outside every group). ``amp``: a context
    factory around forward and loss (the trainer's ``maybe_enable_amp``; backward
    outside it, as in TorchTitan's train step)."""
    work.setup("fwd_bwd")
    marks.marks.clear()
    marks.forward = True
    marks.mark("start")
    with amp():
        pred = work.model(work.inputs, **work.extra_inputs)
        loss = work.loss_fn(pred, work.labels) / work.labels.numel()
    del pred
    marks.mark("loss")
    marks.forward = False
    loss.backward()
    marks.mark("end")
    marks.sync()
    out: dict[str, float] = {}
    names = [name for name, _, _ in groups]
    missing = [f"{n}.{k}" for n in names for k in ("fwd0", "fwd1", "bwd0", "bwd1")
               if f"{n}.{k}" not in marks.marks]  # fmt: skip
    if missing:
        raise RuntimeError(f"no timing mark for {missing}: a group ran no forward/backward")
    for n in names:
        out[f"{n}.fwd"] = marks.ms(f"{n}.fwd0", f"{n}.fwd1")
        out[f"{n}.bwd"] = marks.ms(f"{n}.bwd0", f"{n}.bwd1")
    fwd = marks.ms("start", "loss")
    bwd = marks.ms("loss", "end")
    out["fwd_bwd"] = fwd + bwd
    out["root_fwd"] = fwd - sum(out[f"{n}.fwd"] for n in names)
    out["root_bwd"] = bwd - sum(out[f"{n}.bwd"] for n in names)
    return out


def world1_precision(work: bench_floor.FloorWork, job_config, device: torch.device):
    """Turn bench_floor's bf16-parameter model into what the one-GPU trainer runs: fp32
    parameters (values cast up; timing only), forward under autocast to
    ``training.mixed_precision_param``. Returns the autocast context factory."""
    from torchtitan.config import TORCH_DTYPE_MAP

    for p in work.model.parameters():
        p.data = p.data.to(torch.float32)
    dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    return lambda: torch.autocast(device.type, dtype=dtype)


def heat(iteration: Callable[[], object], seconds: float) -> int:
    """Run ``iteration`` until ``seconds`` of wall time have passed (each one synchronizes),
    so the timed iterations start on a warm GPU. Returns the iterations run."""
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        iteration()
        count += 1
    return count


def profile_kernels(
    work: bench_floor.FloorWork, groups, marks: Marks, amp, top: int
) -> dict[str, Any]:
    """One more marked fwd+bwd under ``torch.profiler`` (CUDA only): every kernel's,
    copy's and memset's device time of that iteration and the ``top`` kernels by time
    (``common.summarize_device_events``: the names bench_step's profiled step reports, so
    a step's kernels compare with the trace's by name)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trace_iteration(work, groups, marks, amp)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = common.load_chrome_trace(path)
    device = common.summarize_device_events(common.device_events(events), sm_count=0, top=top)
    return {k: device[k] for k in ("kernel_ms", "memcpy_ms", "memset_ms", "kernels")}


def time_optimizer(
    work: bench_floor.FloorWork, device: torch.device, iters: int
) -> tuple[dict[str, float | None], str | None]:
    """Median ms of AdamW and of the clip on rank 0's shards, and None; when they do not
    fit in memory beside the model (world 1: the shards are a second full fp32 copy),
    ``None`` for both and the error: the layer trace measured before is kept."""
    try:
        return {
            v: common.median(bench_floor.time_iterations(
                getattr(work, v), lambda: None, device, iters))
            for v in ("adamw", "clip")
        }, None  # fmt: skip
    except torch.OutOfMemoryError as e:
        first_line = str(e).splitlines()[0]
        print(f"[bench_trace] optimizer not timed: out of memory ({first_line})", flush=True)
        return {"adamw": None, "clip": None}, f"out of memory: {first_line}"


def run(args: argparse.Namespace, overrides: Sequence[str]) -> dict[str, Any]:
    """Build bench_floor's work, time the marked fwd+bwd and the optimizer; the result
    dict (not yet written)."""
    device, job_config = bench_floor.prepare(args.device, args.config, overrides)
    policy = job_config.parallelism.fsdp_reshard_after_forward
    with bench_floor.one_rank_process_group():
        work, about = bench_floor.build_work(job_config, args.world_size, device, seed=0)
        amp = contextlib.nullcontext
        if args.precision == "world1":
            amp = world1_precision(work, job_config, device)
            about = {**about, "param_dtype": "float32 (autocast)"}
        groups, how = fsdp_group_modules(work.model, job_config.model.name, policy)
        marks = Marks(device)
        install_marks(groups, marks)
        sampler = gpu_clock.ClockSampler(gpu_clock.gpu_index()) if device.type == "cuda" else None
        heat_iters = heat(lambda: trace_iteration(work, groups, marks, amp), args.heat_s)
        for _ in range(args.warmup):
            trace_iteration(work, groups, marks, amp)
        timed_from = time.time()
        per_iter = [trace_iteration(work, groups, marks, amp) for _ in range(args.iters)]
        clock = sampler.window(timed_from, time.time()) if sampler else None
        if sampler:
            sampler.stop()
        kernels = None
        if args.kernels and device.type == "cuda":
            kernels = profile_kernels(work, groups, marks, amp, args.kernels)
        elif args.kernels:
            print(f"[bench_trace] --kernels ignored on {device.type}: it profiles CUDA kernels",
                  flush=True)  # fmt: skip
        # The optimizer runs on rank 0's shards, not on the model: the model's gradients
        # (fp32 at world 1: as large as the weights) are freed first. At world 1 the shards
        # are a second full fp32 copy of the model (bench_floor.Shards), so a model near the
        # GPU's size still does not fit: Wan2.2 A14B 20 layers needs about 148 GB here
        # (measured 2026-12-03: out of memory at AdamW's state on one H200).
        work.model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        optimizer, optimizer_error = time_optimizer(work, device, args.iters)
    med = {k: common.median([it[k] for it in per_iter]) for k in per_iter[0]}
    rows = [
        {
            "group": name,
            "params": sum(p.numel() for m in modules for p in m.parameters()),
            "reshard_after_forward": reshard,
            "fwd_ms": med[f"{name}.fwd"],
            "bwd_ms": med[f"{name}.bwd"],
        }
        for name, modules, reshard in groups
    ]
    return {
        **bench_floor.result_header("trace", args, overrides, device, about),
        "grouping": how,
        "precision": args.precision,
        "groups": rows,
        "fwd_bwd_ms": med["fwd_bwd"],
        "root_fwd_ms": med["root_fwd"],
        "root_bwd_ms": med["root_bwd"],
        "adamw_ms": optimizer["adamw"],
        "clip_ms": optimizer["clip"],
        "optimizer_error": optimizer_error,
        "iters": args.iters,
        "profiled_iteration": kernels,
        "heat_s": args.heat_s,
        "heat_iters": heat_iters,
        "clock": clock,
        "tables": [
            {"title": "Per FSDP group, one device (median ms)", "columns": COLUMNS, "rows": rows}
        ],
        "headline": [],
    }


def write_outputs(stem: Path, result: dict[str, Any]) -> str:
    meta, about = result["metadata"], result["work"]
    notes = (
        f"{meta['machine']}, torch {meta['torch']}, commit {meta['commit']}, {meta['date']}. "
        f"Config `{result['config']}`, per-GPU work of a {result['world_size']}-rank step on "
        f"{result['device']} ({about['model']} {about['flavor']}, input {about['input_shape']}, "
        f"activation checkpointing {about['activation_checkpoint']}), median of "
        f"{result['iters']} iterations. fwd+bwd {result['fwd_bwd_ms']:.3f} ms, of which outside "
        f"every group (root) fwd {result['root_fwd_ms']:.3f} / bwd {result['root_bwd_ms']:.3f} "
        + (
            f"ms; AdamW {result['adamw_ms']:.3f} ms, clip {result['clip_ms']:.3f} ms on rank 0's "
            "shards"
            if result["adamw_ms"] is not None
            else f"ms; optimizer not timed ({result['optimizer_error']})"
        )
        + f". Groups: {result['grouping']}."
        + bench_floor.zero_fill_note(about)
        + (
            f" Heated {result['heat_s']:g} s ({result['heat_iters']} fwd+bwd) first."
            if result.get("heat_s")
            else ""
        )
        + (
            f" While timed: SM {c['sm_mhz_median']:.0f} MHz median ({c['sm_mhz_min']:.0f}-"
            f"{c['sm_mhz_max']:.0f}), up to {c['temp_c_max']:.0f} C, {c['power_w_median']:.0f} W "
            "median."
            if (c := result.get("clock"))
            else ""
        )
        + (
            f" Profiled iteration (--kernels): {prof['kernel_ms']:.1f} ms of kernels, "
            f"{prof['memcpy_ms']:.1f} ms of copies; top kernels in the JSON."
            if (prof := result.get("profiled_iteration"))
            else ""
        )
        + "\n"
    )
    names = [r["group"] for r in result["groups"]]
    charts = [
        common.BarChart("forward ms per group", names, [r["fwd_ms"] for r in result["groups"]], "ms"),
        common.BarChart("backward ms per group", names, [r["bwd_ms"] for r in result["groups"]], "ms"),
    ]  # fmt: skip
    title = f"Layer trace: {result['config']}"
    return common.write_result(stem, result, title, notes, charts)


def main(argv: Sequence[str] | None = None, runner: Callable = run) -> int:
    parser = common.step_work_parser(__doc__.splitlines()[0], "traced")
    parser.add_argument("--precision", choices=("fsdp2", "world1"), default="fsdp2",
                        help="fsdp2: bf16 parameters (FSDP2's mixed precision); world1: what "
                             "the one-GPU trainer runs (fp32 weights under autocast)")  # fmt: skip
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--heat-s", type=float, default=0.0,
                        help="run fwd+bwd for this many seconds before --warmup (a GPU as "
                             "warm as a training job's)")  # fmt: skip
    parser.add_argument("--kernels", type=int, default=0, metavar="TOP",
                        help="CUDA: profile one more fwd+bwd and keep its TOP kernels by "
                             "device time (profiled_iteration; 0: no profile)")  # fmt: skip
    args, overrides = parser.parse_known_args(argv)
    if args.world_size < 1 or args.iters < 1 or args.warmup < 0 or args.heat_s < 0:
        parser.error("--world-size and --iters must be >= 1, --warmup and --heat-s >= 0")
    if args.precision == "world1" and args.world_size != 1:
        parser.error("--precision world1 is the one-GPU trainer: use --world-size 1")
    result = runner(args, overrides)
    kind = "trace_world1" if args.precision == "world1" else "trace"
    stem = common.result_stem(args.out_dir, f"{kind}_{result['config']}", result["metadata"])
    common.announce_results(stem, write_outputs(stem, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
