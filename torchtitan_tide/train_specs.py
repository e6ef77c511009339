"""TorchTitan train specs whose FSDP communication follows ``[tide] comm``.

``llama3_tide`` and ``qwen3_tide`` reuse TorchTitan's llama3 / qwen3 models, flavors,
loss, optimizers and tokenizer; ``wan22`` is this project's Wan2.2 DiT (``models/wan22``).
Each spec's ``parallelize_fn`` runs the model's own, then :func:`apply_comm_mode`
switches every FSDP module to the chosen mode. Importing this
module registers the specs (TOML: ``[experimental] custom_import =
"torchtitan_tide.train_specs"``) and the embedded dataset ``tide_text``.
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.tokenizer import HuggingFaceTokenizer, build_hf_tokenizer
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec
from torchtitan.tools.logging import logger

from torchtitan_tide import comm
from torchtitan_tide.comm.fsdp.install import TideInstallError
from torchtitan_tide.comm.options import TideOptionError
from torchtitan_tide.comm.plans.group_sizes import check_local_world_size, fsdp_group_sizes
from torchtitan_tide.comm.symm_mem import SymmMemUnavailable
from torchtitan_tide.config import Tide, TideConfigError
from torchtitan_tide.data import register_dataset, resolve_asset_path
from torchtitan_tide.launch.checks import unavailable_reason  # the launcher decides alike, earlier
from torchtitan_tide.metrics import build_metrics_processor_with_jsonl

ParallelizeFn = Callable[[nn.Module, ParallelDims, JobConfig], nn.Module]


class CommModeError(RuntimeError):
    """``[tide] comm`` cannot run here; the message says why and what to change."""


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def apply_comm_mode(model: nn.Module, tide: Tide) -> str:
    """Switch every FSDP module of ``model`` to ``tide.comm``; return the mode in effect.

    Logs the path taken on every rank. On gloo (CPU) FSDP2's gradient reduction is
    forced to plain SUM (gloo has no PREMUL_SUM; TorchTitan already sets the divide
    factor to 1.0 and scales the loss by the global token count).

    Raises:
        CommModeError: the mode is not implemented yet, needs FSDP, or cannot run on
            this backend or hardware (symm_mem: :class:`SymmMemUnavailable`; tide: a
            ``TideInstallError`` from install; both raised alike on every rank) and
            ``fallback`` is "none". With ``fallback = "fsdp2"`` every rank logs why and
            returns "fsdp2", the model untouched by the failed set-up.
    """
    mode = tide.comm
    rank = dist.get_rank()
    backend = str(dist.get_backend())
    modules = fsdp_modules(model)
    if mode != "fsdp2" and not modules:
        raise CommModeError(
            f"[tide] comm = {mode!r} needs FSDP (data_parallel_shard_degree > 1 or -1), "
            "but the model has no FSDP module; use comm = 'fsdp2'"
        )
    if ignored := tide.options_ignored_by_mode():
        logger.warning(
            f"[tide] options {ignored} only apply to comm = 'tide'; ignored under {mode!r}"
        )

    reason = unavailable_reason(mode, backend)
    if reason is not None:
        if tide.fallback != "fsdp2":
            raise CommModeError(
                f"{reason}. Set [tide] fallback = 'fsdp2' to run stock FSDP2 instead."
            )
        logger.warning(
            f"[rank {rank}] {reason}; falling back to comm = 'fsdp2' as [tide] fallback asks"
        )
        mode = "fsdp2"

    if "gloo" in backend:
        for module in modules:
            module.set_force_sum_reduction_for_comms(True)

    if mode != "fsdp2":
        failure: Exception | None = None
        try:
            comm.apply(model, mode=mode, **tide.comm_options())
        except (SymmMemUnavailable, TideInstallError) as exc:
            # Raised alike on every rank of this rank's FSDP groups (install agrees on
            # failures and frees what it set up: the model is stock FSDP2 again).
            failure = exc
        failure = _job_wide_failure(model, mode, failure)
        if failure is not None:
            if tide.fallback != "fsdp2":
                raise CommModeError(
                    f"{failure}\nSet [tide] fallback = 'fsdp2' to train with stock FSDP2 "
                    "instead when comm cannot be set up."
                ) from failure
            logger.warning(
                f"[rank {rank}] comm = {mode!r} could not be set up ({type(failure).__name__}: "
                f"{failure}); falling back to comm = 'fsdp2' as [tide] fallback asks"
            )
            mode = "fsdp2"
    logger.info(
        f"[rank {rank}] comm mode {mode!r} on {len(modules)} FSDP modules "
        f"(backend {backend}, {nccl_version_string()})"
    )
    return mode


def _job_wide_failure(
    model: nn.Module, mode: str, failure: Exception | None
) -> Exception | None:
    """The set-up outcome of the whole job: ``failure`` (this rank's) or a peer's.

    Install agrees within this rank's FSDP groups only; ranks in other groups (HSDP
    replicas, pipeline stages) would go on with ``mode`` beside ranks that took FSDP2's
    path, or block in their first collective. One ``all_gather_object`` over the default
    group (every rank runs one per model part, in the same order) makes the outcome the
    same everywhere: a rank whose own set-up succeeded removes it again when any rank
    failed, and returns that rank's error."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failure
    mine = None if failure is None else (type(failure).__name__, str(failure))
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, mine)
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if not failed or failure is not None:
        return failure
    comm.remove(model)  # this rank's set-up succeeded; the job takes FSDP2's path together
    ranks = [r for r, _ in failed]
    kind, message = failed[0][1]
    return TideInstallError(
        f"comm = {mode!r} could not be set up on rank(s) {ranks} (in FSDP groups other than "
        f"this rank's); first: {kind}: {message}"
    )


def nccl_version_string() -> str:
    """The NCCL version loaded by this process, or why there is none."""
    if not torch.cuda.is_available():
        return "no CUDA, NCCL not loaded"
    from torchtitan_tide.comm.transports.windows import nccl_rma

    try:
        built = ".".join(str(v) for v in torch.cuda.nccl.version()[:3])
    except (RuntimeError, AttributeError) as exc:
        built = f"unknown ({exc})"
    # ncclGetVersion of the library this process mapped: torch reports the version it
    # was built against, also after the library was replaced (docs/guide/install.md, NCCL).
    loaded = nccl_rma.version_text(nccl_rma.nccl_version())
    if loaded in ("none", built):
        return f"NCCL {built}"
    return f"NCCL {loaded} loaded ({nccl_rma.library_path()}; torch built with {built})"


def check_group_sizes(tide: Tide, parallel_dims: ParallelDims) -> None:
    """``[tide] local_world_size`` against the FSDP groups ``parallel_dims`` builds (as
    the launcher checks it; here for runs started without it).

    Raises:
        TideConfigError: naming the key, the groups and the values that work.
    """
    d = parallel_dims
    try:
        check_local_world_size(
            tide.local_world_size, fsdp_group_sizes(d.dp_shard, d.cp, d.tp, d.ep, d.etp)
        )
    except TideOptionError as exc:
        raise TideConfigError(str(exc)) from None


def wrap_parallelize(parallelize_fn: ParallelizeFn) -> ParallelizeFn:
    """Run TorchTitan's ``parallelize_fn``, then :func:`apply_comm_mode`."""

    def parallelize_with_comm_mode(
        model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
    ) -> nn.Module:
        model = parallelize_fn(model, parallel_dims, job_config)
        if job_config.tide.comm == "tide":
            check_group_sizes(job_config.tide, parallel_dims)
        apply_comm_mode(model, job_config.tide)
        return model

    return parallelize_with_comm_mode


def build_tokenizer(job_config: JobConfig, *args, **kwargs) -> HuggingFaceTokenizer:
    """TorchTitan's HF tokenizer; ``torchtitan_tide/assets/...`` paths resolve to the package."""
    job_config.model.hf_assets_path = resolve_asset_path(job_config.model.hf_assets_path)
    return build_hf_tokenizer(job_config, *args, **kwargs)


def tide_spec(base: TrainSpec) -> TrainSpec:
    """``base`` with the comm-mode parallelize wrapper, JSONL metrics, and (for HF
    tokenizers) tokenizer paths that resolve inside the package."""
    tokenizer_fn = base.build_tokenizer_fn
    return dataclasses.replace(
        base,
        parallelize_fn=wrap_parallelize(base.parallelize_fn),
        build_metrics_processor_fn=build_metrics_processor_with_jsonl,
        build_tokenizer_fn=build_tokenizer if tokenizer_fn is build_hf_tokenizer else tokenizer_fn,
    )


def _with_flavor(spec: TrainSpec, name: str, args) -> TrainSpec:
    """``spec`` with one more model flavor (TorchTitan's own flavors stay untouched)."""
    return dataclasses.replace(spec, model_args={**spec.model_args, name: args})


def _with_reduced_depth(spec: TrainSpec, flavor: str, n_layers: int) -> TrainSpec:
    """Add flavor ``{flavor}_{n_layers}layers``: full width, ``n_layers`` blocks (configs
    that fit a 2-GPU machine yet keep the per-layer FSDP group sizes of the full model)."""
    reduced = dataclasses.replace(spec.model_args[flavor], n_layers=n_layers)
    return _with_flavor(spec, f"{flavor}_{n_layers}layers", reduced)


def _llama3() -> TrainSpec:
    return _with_reduced_depth(get_train_spec("llama3"), "70B", 4)


def _qwen3() -> TrainSpec:
    spec = _with_reduced_depth(get_train_spec("qwen3"), "30B-A3B", 4)
    # CPU-sized MoE: 2 layers, 8 experts top-2, experts as a for-loop of fp32 matmuls
    # (the grouped-mm path casts to bf16, ~20x slower than fp32 on CPUs without bf16 units).
    moe = spec.model_args["debugmodel_moe"]
    small = dataclasses.replace(
        moe,
        n_layers=2,
        moe_args=dataclasses.replace(moe.moe_args, num_experts=8, top_k=2, use_grouped_mm=False),
    )
    return _with_flavor(spec, "debugmodel_moe_2layers", small)


def _wan22() -> TrainSpec:
    from models.wan22 import build_wan22_train_spec

    return build_wan22_train_spec()


SPECS: dict[str, Callable[[], TrainSpec]] = {
    "llama3_tide": _llama3,
    "qwen3_tide": _qwen3,
    "wan22": _wan22,
}


def register() -> None:
    """Register the specs and the ``tide_text`` dataset; safe to call twice."""
    from torchtitan.protocols import train_spec as train_spec_module

    register_dataset()
    for name, build_base in SPECS.items():
        if name not in train_spec_module._extra_train_specs:
            register_train_spec(name, tide_spec(build_base()))


register()
