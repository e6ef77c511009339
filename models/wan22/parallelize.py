"""Activation checkpointing, torch.compile and FSDP2/HSDP for the Wan2.2 DiT.

Mirrors torchtitan's ``models/llama3/infra/parallelize.py``: one function per technique,
applied in the order AC -> compile -> FSDP. TP, CP and PP are not implemented.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import (
    _op_sac_save_list,
    apply_compile,
    apply_ddp,
    disable_fsdp_gradient_division,
)
from torchtitan.tools.logging import logger


def parallelize_wan22(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply AC, per-block compile and FSDP/HSDP (or DDP) to a meta-device ``Wan22Model``.

    Raises ``NotImplementedError`` if tensor, context or pipeline parallelism is enabled.
    """
    for name, enabled in (
        ("tensor", parallel_dims.tp_enabled),
        ("context", parallel_dims.cp_enabled),
        ("pipeline", parallel_dims.pp_enabled),
    ):
        if enabled:
            raise NotImplementedError(f"Wan2.2 does not implement {name} parallelism")

    model_compile_enabled = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=model_compile_enabled,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
    if model_compile_enabled:
        apply_compile(model, job_config.compile)

    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        kind = "HSDP" if parallel_dims.dp_replicate_enabled else "FSDP"
        logger.info(f"Applied {kind} to the Wan2.2 model")
    elif parallel_dims.dp_replicate_enabled:
        dp_replicate_mesh = parallel_dims.get_mesh("dp_replicate")
        if parallel_dims.world_size != dp_replicate_mesh.size():
            raise RuntimeError("DDP has not supported > 1D parallelism")
        apply_ddp(model, dp_replicate_mesh, enable_compile=model_compile_enabled)
    return model


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
) -> None:
    """Shard the model with FSDP2: one unit per transformer block, one each for the text
    embedding, time embedding and time projection, one for the head, and the root (patch
    embedding). Gradient division is disabled: torchtitan's Trainer scales the loss by the
    global element count itself.

    Args:
        model: A ``Wan22Model`` (meta device or materialized).
        dp_mesh: Mesh of the data-parallel dims (1D FSDP or 2D HSDP).
        param_dtype: Dtype of unsharded parameters in forward/backward (compute dtype).
        reduce_dtype: Dtype of gradient reduce-scatter.
        cpu_offload: Keep sharded parameters, gradients and optimizer states on CPU.
        reshard_after_forward_policy: "default" or "always" (reshard every unit after its
            forward; the head stays unsharded under "default", since backward needs it at
            once) or "never".

    On gloo (CPU) the caller must also force SUM reductions
    (``set_force_sum_reduction_for_comms``): gloo has no PREMUL_SUM. torchtitan_tide's
    parallelize wrapper does that for every train spec.

    Forward inputs are not cast (``cast_forward_inputs=False``): the model casts
    activations to the parameter dtype itself and keeps timesteps, the modulation vectors
    and the RoPE tables in float32, as Wan does. Casting them to bf16 would round
    timesteps near 1000 to multiples of 4.
    """
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    fsdp_config: dict = {"mesh": dp_mesh, "mp_policy": mp_policy}
    if cpu_offload:
        fsdp_config["offload_policy"] = CPUOffloadPolicy()

    match reshard_after_forward_policy:
        case "always":
            reshard_after_forward = True
        case "never":
            reshard_after_forward = False
        case "default":
            reshard_after_forward = True
        case _:
            raise ValueError(
                f"Invalid reshard_after_forward_policy: {reshard_after_forward_policy}."
            )

    for module in (model.text_embedding, model.time_embedding, model.time_projection):
        fully_shard(module, **fsdp_config, reshard_after_forward=reshard_after_forward)
    for block in model.layers.values():
        fully_shard(block, **fsdp_config, reshard_after_forward=reshard_after_forward)
    # The head runs last in forward and first in backward: keep it gathered in between.
    fully_shard(
        model.head,
        **fsdp_config,
        reshard_after_forward=reshard_after_forward_policy == "always",
    )
    fully_shard(model, **fsdp_config)
    disable_fsdp_gradient_division(model)
