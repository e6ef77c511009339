"""Training entry point: ``python -m torchtitan_tide.train --job.config_file X.toml [...]``.

Runs TorchTitan 0.2.2's own Trainer. Before TorchTitan builds anything it:
1. checks the TOML's ``[tide]`` table (unknown keys, bad values) and fails early, and sets
   the environment the comm mode needs before any process group exists
   (``comm = "symm_mem"``: ``NCCL_CTA_POLICY=2``, see ``launch/command.py`` ``comm_env``);
2. on machines without CUDA (or with ``TIDE_DEVICE=cpu``) switches TorchTitan to the
   CPU device (gloo process groups, CPU memory monitor, CPU MoE index kernels);
3. registers the ``*_tide`` train specs and the ``tide_text`` dataset;
4. keeps W&B offline unless ``WANDB_MODE`` says otherwise (nothing leaves the machine);
5. with ``TIDE_FSDP_AT_WORLD_SIZE_1=1`` (benchmarks only) applies FSDP2 in a one-process
   run (``torchtitan_tide.world1_fsdp``).
``run_train.sh`` launches this module under torchrun.
"""

import functools
import os
import sys
import types
from collections.abc import MutableMapping
from pathlib import Path

import torch

from torchtitan_tide import checkpoint, guards, world1_fsdp
from torchtitan_tide.config import load_toml
from torchtitan_tide.device import use_cpu_device, wants_cpu
from torchtitan_tide.launch.command import comm_env
from torchtitan_tide.launch.command_line import (
    effective_tide,
    normalize_bool_flags,
    override_values,
    tide_bool_keys,
)


def config_file_from_args(args: list[str]) -> str | None:
    """The value of ``--job.config_file`` / ``--job.config-file`` in ``args``, if any."""
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            if eq:
                return value
            return args[i + 1] if i + 1 < len(args) else None
    return None


class _TorchWithIntegerHistc(types.ModuleType):
    """``torch`` as TorchTitan's MoE router sees it on CPU: ``histc`` also counts integer
    expert indices (CPU ``histc`` takes floats only; counts stay exact below 2**24)."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def histc(values: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if values.is_floating_point():
            return torch.histc(values, *args, **kwargs)
        return torch.histc(values.float(), *args, **kwargs).to(values.dtype)


def use_cpu_moe_kernels() -> None:
    """Make TorchTitan's MoE layers run on CPU: token-permutation indices from its CPU
    implementation (the default is a Triton GPU kernel), and expert counts through
    :class:`_TorchWithIntegerHistc`."""
    import torchtitan.models.moe.kernels as moe_kernels
    import torchtitan.models.moe.moe as moe_layers
    import torchtitan.models.moe.utils as moe_utils

    moe_utils.generate_permute_indices = functools.partial(
        moe_kernels.generate_permute_indices, use_cpu=True
    )
    moe_layers.torch = _TorchWithIntegerHistc("torch")


def check_config_and_set_comm_env(
    args: list[str], environ: MutableMapping[str, str] = os.environ
) -> list[str]:
    """Validate the ``[tide]`` table of ``--job.config_file`` (with ``--tide.*`` overrides)
    and set the variables its comm mode needs in ``environ``, before any process group
    exists (NCCL reads ``NCCL_CTA_POLICY`` when it creates a communicator). Returns notes
    for the log; a value the environment already has is kept."""
    config_file = config_file_from_args(args)
    if config_file is None:
        return []
    tide = effective_tide(Path(config_file), load_toml(config_file), override_values(args))
    updates, notes = comm_env(tide.comm, environ)
    environ.update(updates)
    return notes


def prepare(args: list[str]) -> tuple[str, list[str]]:
    """Everything that must happen before TorchTitan's Trainer; returns the device type
    and the comm env notes."""
    env_notes = check_config_and_set_comm_env(args)
    os.environ.setdefault("WANDB_MODE", "offline")
    device_type = "cpu" if wants_cpu() else "cuda"
    if device_type == "cpu":
        use_cpu_device()
        use_cpu_moe_kernels()
    import torchtitan_tide.train_specs  # noqa: F401  (registers specs and dataset)

    guards.install()  # watchdog, non-finite steps
    checkpoint.install()  # checkpoint manifests, partial/corrupt step folders
    if world1_fsdp.requested():
        world1_fsdp.install(int(os.environ.get("WORLD_SIZE", "1")))

    return device_type, env_notes


def main() -> None:
    # `--tide.slot_reuse false` -> `--tide.no_slot_reuse` (the form tyro takes), before
    # torchtitan.config is imported: its parse_args binds sys.argv[1:] as a default then.
    sys.argv[1:] = normalize_bool_flags(sys.argv[1:], tide_bool_keys())
    device_type, env_notes = prepare(sys.argv[1:])
    from torchtitan.tools.logging import init_logger, logger
    from torchtitan.train import Trainer
    from torchtitan.train import main as titan_main

    from torchtitan_tide.log_noise import install_noise_filters
    from torchtitan_tide.train_specs import nccl_version_string

    init_logger()
    install_noise_filters(device_type)
    logger.info(
        f"torchtitan-tide: device {device_type}, torch {torch.__version__}, "
        f"{nccl_version_string()}, W&B mode {os.environ['WANDB_MODE']}"
        + "".join(f"; comm env {note}" for note in env_notes)
    )
    if world1_fsdp.installed():
        logger.warning(
            f"{world1_fsdp.ENV}=1: FSDP2 over a one-rank mesh (one rank's work of a "
            "multi-GPU step, for profiling; not what the one-GPU trainer runs)"
        )
    try:
        titan_main(Trainer)
    except Exception as exc:
        guards.explain_failure(exc)  # names a peer that stopped answering, if any
        raise


if __name__ == "__main__":
    main()
