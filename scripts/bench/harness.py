"""Processes, timing, reference layers and FSDP2 plumbing of the distributed benchmarks.

- :func:`spawn` runs a worker in one process per GPU (NCCL, ``device_id`` given, so
  the communicator exists right away) or per CPU rank (gloo), with extra environment
  set before the process group is created; :func:`group_launches` puts comm modes
  that can share such a spawn together (``symm_mem`` needs ``NCCL_CTA_POLICY=2``
  before its communicator exists, so it gets its own).
- :func:`time_call`: one call timed with CUDA events, every rank started together.
- Reference shapes (:data:`FULL_LAYERS`, :data:`SMALL_LAYERS`) and
  :func:`build_fsdp_layer`: one layer's parameters as one FSDP group, every value
  reproducible from a per-parameter seed, so correctness has exact references.
- The FSDP2 internals the benchmarks drive directly (``post_backward``,
  ``finalize_backward``, the training state, buffers FSDP keeps for the next group):
  torch 2.11 / 2.13 differences are handled here and nowhere else in ``scripts/bench``.

Importing this module turns NVLink multicast off for the process and the workers it
spawns (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``: docs/design/2026-11-29-h200-facts.md); import it before anything
creates a CUDA context or a communicator.
"""

from __future__ import annotations

import os

os.environ.update(
    NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
)

import contextlib
import datetime
import faulthandler
import json
import logging
import math
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE), str(_HERE.parents[1])):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import common

TIMEOUT_S = 120  # a collective hung this long aborts the spawn (partial JSON is kept)
SLEEP_CYCLES = 20_000_000  # ~10 ms at H200 clocks: hides host launch time ("queued")


def _mode_env() -> dict[str, dict[str, str]]:
    from torchtitan_tide.comm.symm_mem import ZERO_CTA_ENV

    return {"symm_mem": dict(ZERO_CTA_ENV)}


# Environment a comm mode needs before its process group exists (NCCL_CTA_POLICY=2).
MODE_ENV: dict[str, dict[str, str]] = _mode_env()


# ---------------------------------------------------------------- processes and timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], None], device: torch.device, queued: bool) -> tuple[float, float]:
    """(elapsed ms of ``fn`` on the current stream, host ms of the call).
    All ranks start together (barrier + sync). ``queued``: a sleep kernel is
    enqueued first so the host launch overlaps it (pure device time). On CPU
    both are the wall time of the call."""
    dist.barrier()
    sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms
    stream = torch.cuda.current_stream(device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    if queued:
        torch.cuda._sleep(SLEEP_CYCLES)
    start.record(stream)
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end), host_ms


def agree_errors(err: str | None) -> str | None:
    """Every rank's error of the same step (collective); None if all succeeded."""
    errs: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
    return "; ".join(bad) or None


def error_info(e: BaseException) -> dict[str, str]:
    """``{"error": "<Type>: <message>", "traceback": <last 3000 characters>}``."""
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Launch:
    """Comm modes that share one spawn (one process per rank): same extra environment."""

    modes: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def group_launches(
    modes: Sequence[str], env_of: Mapping[str, Mapping[str, str]] = MODE_ENV
) -> list[Launch]:
    """``modes`` grouped by the environment they need (:data:`MODE_ENV`), in order
    of first appearance; e.g. (fsdp2, symm_mem, tide) -> [(fsdp2, tide), (symm_mem,)]."""
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for mode in modes:
        groups.setdefault(tuple(sorted(env_of.get(mode, {}).items())), []).append(mode)
    return [Launch(tuple(ms), env) for env, ms in groups.items()]


def _entry(
    rank: int,
    world: int,
    port: int,
    device_type: str,
    env: tuple[tuple[str, str], ...],
    worker: Callable[..., None],
    args: tuple,
) -> None:
    faulthandler.enable()  # a fatal signal (e.g. SIGABRT) prints every thread's Python stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # before the process group (and NCCL) exists; "{rank}" in a value: this rank's number
    os.environ.update({k: v.replace("{rank}", str(rank)) for k, v in env})
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if device_type in ("cuda", "cuda:0"):
        gpu = 0 if device_type == "cuda:0" else rank  # "cuda:0": every rank on GPU 0
        torch.cuda.set_device(gpu)
        dist.init_process_group(
            "nccl",
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=torch.device("cuda", gpu),
        )
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        worker(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _exit_after_teardown()


def _exit_after_teardown() -> None:
    """End a rank whose work, final barrier and process-group teardown succeeded, without
    the interpreter's finalization (logs and stdio flushed first): once on CPU CI (torch
    2.13, gloo, a profiled bench) a rank aborted there with "terminate called without an
    active exception" after its results were written (docs/design/2026-12-06-bench-exit.md).
    Failures still raise out of :func:`_entry` and end the rank as before."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(
    worker: Callable[..., None],
    world: int,
    device_type: str,
    args: tuple = (),
    env: tuple[tuple[str, str], ...] = (),
    start_method: str = "spawn",
    timeout_s: float | None = None,
) -> None:
    """Run ``worker(rank, world, *args)`` in ``world`` spawned processes, each in a
    process group of all of them (``"cuda"``: NCCL on GPU ``rank``; ``"cuda:0"``: NCCL,
    every rank on GPU 0, for emulated nodes; ``"cpu"``: gloo) created after ``env`` is
    set (``{rank}`` in a value is replaced by the rank). Raises when a process fails.
    ``start_method="fork"`` (CPU only: CUDA cannot be forked) saves each process
    the imports of a fresh interpreter. ``timeout_s``: past it every process is killed
    and ``TimeoutError`` raised (a hung variant ends, the next one runs)."""
    import torch.multiprocessing as mp

    if start_method == "fork" and device_type != "cpu":
        raise ValueError("spawn: start_method='fork' is for CPU ranks only")
    context = mp.start_processes(
        _entry,
        args=(world, free_port(), device_type, tuple(env), worker, tuple(args)),
        nprocs=world,
        join=False,
        start_method=start_method,
    )
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not context.join(timeout=5.0):
        if deadline is not None and time.monotonic() > deadline:
            alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join(10.0)
            raise TimeoutError(f"spawn: {worker.__name__} not done after {timeout_s:.0f} s; "
                               f"rank(s) {alive} still running were killed")  # fmt: skip


def save_quietly(write: Callable[[dict, bool], object], results: dict) -> None:
    """``write(results, final=False)``; a failure is printed, never raised (rank 0
    must not leave the other ranks waiting in a collective)."""
    try:
        write(results, False)
    except Exception as e:  # noqa: BLE001
        print(f"WARNING: writing results failed: {type(e).__name__}: {e}", flush=True)


def run_benchmark(
    results: dict,
    worker: Callable[..., None],
    world: int,
    device_type: str,
    config_for: Callable[[Launch], Any],
    write: Callable[[dict, bool], str],
) -> int:
    """Run a benchmark whose ``results`` (``config.stem``, ``config.modes``) are set
    up: write them, then one :func:`spawn` of ``worker`` (argument
    ``config_for(launch)``) per launch of :func:`group_launches`. The workers' rank 0
    extends ``<stem>.json``; after each spawn it is read back and the launch recorded
    under ``"launches"`` (modes, env, error of a crashed spawn, wall seconds). Ends
    with ``write(results, True)``, printed. Returns 1 if a spawn failed, else 0."""
    stem = results["config"]["stem"]
    write(results, False)
    t0, failed = time.perf_counter(), False
    for launch in group_launches(results["config"]["modes"]):
        lt0, err = time.perf_counter(), None
        try:
            spawn(worker, world, device_type, (config_for(launch),), launch.env)
        except Exception as e:  # noqa: BLE001 - recorded; the next spawn runs
            err, failed = f"{type(e).__name__}: {e}", True
            print(f"spawn {launch.modes} FAILED: {err}", file=sys.stderr, flush=True)
        results = json.loads(Path(stem + ".json").read_text())
        results.setdefault("launches", []).append(
            {
                "modes": list(launch.modes),
                "env": dict(launch.env),
                "error": common.short_error(err, 300),
                "wall_s": round(time.perf_counter() - lt0, 1),
            }
        )
        write(results, False)
    results["status"] = "complete"
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    common.announce_results(stem, write(results, True))
    return 1 if failed else 0


# ---------------------------------------------------------------- reference layers

ParamShapes = dict[str, tuple[int, ...]]


def _gqa_attention(dim: int, heads: int, kv_heads: int, head_dim: int) -> ParamShapes:
    return {
        "attention_wq": (heads * head_dim, dim),
        "attention_wk": (kv_heads * head_dim, dim),
        "attention_wv": (kv_heads * head_dim, dim),
        "attention_wo": (dim, heads * head_dim),
    }


def llama_layer(
    dim: int = 8192, ffn: int = 28672, heads: int = 64, kv_heads: int = 8, head_dim: int = 128
) -> ParamShapes:
    """One Llama-3 transformer block (TorchTitan's parameter order and shapes)."""
    return {
        **_gqa_attention(dim, heads, kv_heads, head_dim),
        "feed_forward_w1": (ffn, dim),
        "feed_forward_w2": (dim, ffn),
        "feed_forward_w3": (ffn, dim),
        "attention_norm": (dim,),
        "ffn_norm": (dim,),
    }


def qwen3_moe_layer(
    dim: int = 2048,
    heads: int = 32,
    kv_heads: int = 4,
    head_dim: int = 128,
    experts: int = 128,
    expert_ffn: int = 768,
) -> ParamShapes:
    """One Qwen3 MoE block: attention with q/k RMSNorm, router, experts as grouped
    3-D weights (TorchTitan's GroupedExperts), no shared expert."""
    return {
        **_gqa_attention(dim, heads, kv_heads, head_dim),
        "attention_q_norm": (head_dim,),
        "attention_k_norm": (head_dim,),
        "moe_router_gate": (experts, dim),
        "moe_experts_w1": (experts, expert_ffn, dim),
        "moe_experts_w2": (experts, dim, expert_ffn),
        "moe_experts_w3": (experts, expert_ffn, dim),
        "attention_norm": (dim,),
        "ffn_norm": (dim,),
    }


def wan22_block(dim: int = 5120, ffn: int = 13824) -> ParamShapes:
    """One Wan2.2 DiT block as ``models/wan22`` builds it: self- and cross-attention
    (q, k, v, o with biases, full-width q/k RMSNorm), the affine cross-attention
    LayerNorm, the FFN with biases and the (1, 6, dim) AdaLN modulation (dim 0 of
    size 1: one rank holds it all, the others an empty shard)."""
    params: ParamShapes = {}
    for attn in ("self_attn", "cross_attn"):
        for proj in "qkvo":
            params[f"{attn}_{proj}_weight"] = (dim, dim)
            params[f"{attn}_{proj}_bias"] = (dim,)
        params[f"{attn}_norm_q"] = (dim,)
        params[f"{attn}_norm_k"] = (dim,)
        if attn == "self_attn":
            params["norm3_weight"] = (dim,)
            params["norm3_bias"] = (dim,)
    params["ffn_in_weight"] = (ffn, dim)
    params["ffn_in_bias"] = (ffn,)
    params["ffn_out_weight"] = (dim, ffn)
    params["ffn_out_bias"] = (dim,)
    params["modulation"] = (1, 6, dim)
    return params


@dataclass(frozen=True)
class LayerSpec:
    """One layer's parameter shapes (one FSDP group in the benchmarks)."""

    name: str
    label: str
    params: Mapping[str, tuple[int, ...]]

    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.params.values())


FULL_LAYERS: dict[str, LayerSpec] = {
    s.name: s
    for s in (
        LayerSpec("llama70b", "Llama-3.1-70B layer", llama_layer()),
        LayerSpec("qwen3_30b_a3b", "Qwen3-30B-A3B MoE layer", qwen3_moe_layer()),
        LayerSpec("wan22_a14b", "Wan2.2 A14B DiT block", wan22_block()),
    )
}
# Same structure, tiny widths: CPU smoke runs and GPU tests.
SMALL_LAYERS: dict[str, LayerSpec] = {
    s.name: s
    for s in (
        LayerSpec("llama70b", "Llama layer (tiny)", llama_layer(64, 160, 4, 2, 16)),
        LayerSpec("qwen3_30b_a3b", "Qwen3 MoE layer (tiny)", qwen3_moe_layer(64, 4, 2, 16, 8, 32)),
        LayerSpec("wan22_a14b", "Wan2.2 block (tiny)", wan22_block(64, 160)),
    )
}


def param_value(shape: Sequence[int], seed: int, device: torch.device) -> torch.Tensor:
    """fp32 parameter data from ``seed``: ``1 + 0.1 N(0, 1)`` for 1-D (norm-like)
    parameters, ``0.02 N(0, 1)`` otherwise. Same seed, device and shape: same values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tuple(shape), generator=gen, device=device)
    return 1 + 0.1 * x if len(shape) == 1 else 0.02 * x


def random_grad(
    shape: Sequence[int], dtype: torch.dtype, seed: int, device: torch.device
) -> torch.Tensor:
    """N(0, 1) data of ``dtype`` from ``seed`` (reproducible, never all zeros)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=dtype)


def grad_seed(rank: int, step: int) -> int:
    """Base seed of rank ``rank``'s gradients at ``step`` (parameter i adds i)."""
    return 1_000_003 * (rank + 1) + 1_009 * step


class ParamBlock(nn.Module):
    """The parameters of one :class:`LayerSpec`, no forward (only FSDP's collectives
    run). Parameter ``name`` holds ``param_value(shape, seeds[name], device)``."""

    def __init__(self, spec: LayerSpec, device: torch.device, seed: int = 0) -> None:
        super().__init__()
        self.seeds: dict[str, int] = {}
        for i, (name, shape) in enumerate(spec.params.items()):
            self.seeds[name] = seed + i
            self.register_parameter(name, nn.Parameter(param_value(shape, seed + i, device)))


def build_fsdp_layer(
    spec: LayerSpec,
    device: torch.device,
    before_init: Callable[[nn.Module], object] | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> tuple[ParamBlock, Any]:
    """``spec`` as one FSDP module / group: fp32 master parameters, bf16 param dtype,
    ``reduce_dtype`` (fp32 unless given). ``before_init(module)`` runs after
    ``fully_shard`` and before FSDP's lazy init, where training applies the comm
    mode; then the module is lazily initialized as the root (FSDP's streams exist
    without a forward). On gloo the
    reduction is forced to SUM + divide (gloo has no AVG). Returns (module, its
    FSDPParamGroup)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torchtitan_tide.comm.fsdp.internals import fsdp_param_groups

    block = ParamBlock(spec, device)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    fully_shard(block, mp_policy=mp_policy)
    if device.type == "cpu" and hasattr(block, "set_force_sum_reduction_for_comms"):
        block.set_force_sum_reduction_for_comms(True)
    if before_init is not None:
        before_init(block)
    block._get_fsdp_state()._lazy_init()
    ((_, group),) = fsdp_param_groups(block)
    sync(device)
    return block, group


# ---------------------------------------------------------------- FSDP2 internals


def param_name(fsdp_param) -> str:
    """The name the parameter is registered under in its module."""
    return fsdp_param._module_info.param_name


def set_random_grads(group, seed: int) -> None:
    """The state autograd leaves before FSDP's post-backward: a random gradient of
    the unsharded dtype in every unsharded parameter of ``group`` (parameter i from
    seed ``seed + i``), no sharded gradient. The group must be unsharded."""
    for i, fsdp_param in enumerate(group.fsdp_params):
        fsdp_param.sharded_param.grad = None
        param = fsdp_param.unsharded_param
        param.grad = random_grad(param.shape, param.dtype, seed + i, param.device)


def release_post_backward_state(group) -> None:
    """Drop what ``post_backward`` keeps for the next group (the reduce-scatter
    input: a list on torch >= 2.12, one state on 2.11) and return the group to IDLE.
    Safe once the current stream waited for the post-reduce event."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    ctx = group.comm_ctx
    states = getattr(ctx, "reduce_scatter_states", None)
    if isinstance(states, list):
        states.clear()
    elif hasattr(ctx, "reduce_scatter_state"):
        ctx.reduce_scatter_state = None
    group._training_state = TrainingState.IDLE


def reduce_scatter(group) -> None:
    """FSDP's post-backward of ``group`` (reduce-scatter of the unsharded gradients
    into the sharded ``.grad``; FSDP2: chunk_cat on the current stream, collective on
    its reduce-scatter stream), then the current stream waits for the post-reduce
    event (``finalize_backward``) and the retained buffers are released."""
    group.post_backward()
    group.finalize_backward()
    release_post_backward_state(group)


def post_reduce_event(group) -> torch.Event | None:
    """The event that marks the end of ``group``'s last post-backward reduction
    (recorded on FSDP's reduce-scatter stream now where the mode set none)."""
    event = group._post_reduce_event
    if event is None and group.device.type == "cuda":
        event = group.comm_ctx.reduce_scatter_stream.record_event()
    return event


@contextlib.contextmanager
def forward_state(group) -> Iterator[None]:
    """``group`` in FORWARD training state: ``unshard()`` issues the copy-in and the
    collective on FSDP's all-gather streams, as forward prefetching does."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    with group.use_training_state(TrainingState.FORWARD):
        yield


def issue_all_gather(group) -> torch.Event | None:
    """Issue ``group``'s all-gather as forward prefetching does; returns the event
    that marks the collective's end (None where FSDP records none, e.g. CPU)."""
    with forward_state(group):
        group.unshard()
    result = group._all_gather_result
    event = None if result is None else result.all_gather_event
    if event is None and group.device.type == "cuda":  # no event: all work on FSDP's stream
        event = group.comm_ctx.all_gather_stream.record_event()
    return event


def finish_all_gather(group) -> None:
    """``wait_for_unshard`` of an :func:`issue_all_gather` (copy-out on the current
    stream), then drop the buffer FORWARD keeps for the next group's copy-in."""
    with forward_state(group):
        group.wait_for_unshard()
    group.comm_ctx.all_gather_state = None


# ---------------------------------------------------------------- device measurements


def timing_event_after(event: torch.Event | None, stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A timing event that completes when ``event`` does (FSDP's events are created
    without timing): recorded on ``stream`` after it waits for ``event``."""
    if event is not None:
        stream.wait_event(event)
    marker = torch.cuda.Event(enable_timing=True)
    marker.record(stream)
    return marker


def memory_delta(fn: Callable[[], None], device: torch.device) -> dict[str, int] | None:
    """Caching-allocator bytes of one ``fn()`` (cache emptied first):
    ``peak_allocated`` and ``peak_reserved`` above the level before the call, and
    ``allocated_after`` (what it left allocated). On CPU: ``fn()``, None."""
    if device.type != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    alloc0 = torch.cuda.memory_allocated(device)
    reserved0 = torch.cuda.memory_reserved(device)
    fn()
    sync(device)
    return {
        "peak_allocated": torch.cuda.max_memory_allocated(device) - alloc0,
        "peak_reserved": torch.cuda.max_memory_reserved(device) - reserved0,
        "allocated_after": torch.cuda.memory_allocated(device) - alloc0,
    }


def device_bytes_taken(fn: Callable[[], None], device: torch.device) -> int | None:
    """Device memory ``fn()`` took and kept, from the driver's free-memory figure
    (counts symmetric-memory buffers, which the caching allocator does not see).
    On CPU: ``fn()``, None."""
    if device.type != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info(device)
    fn()
    sync(device)
    free1, _ = torch.cuda.mem_get_info(device)
    return int(free0 - free1)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (0 on CPU)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def profiled_trace(
    body: Callable[[], None], device: torch.device, export: bool
) -> list[dict[str, Any]] | None:
    """Run ``body`` under torch.profiler (CPU + CUDA activities); with ``export`` the
    chrome trace's events (with each kernel's grid), else None. CUDA only."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        body()
        sync(device)
    if not export:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return common.load_chrome_trace(path)
