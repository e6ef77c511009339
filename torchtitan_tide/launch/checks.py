"""Why a run is refused: every check the launcher makes before any process starts.

:func:`check_run` runs them in order, each raising an error that names the key or variable,
the bad value and the fix:

1. the ``[tide]`` section after the overrides (``command_line.effective_tide``; unknown
   keys and bad values: ``torchtitan_tide/config.py``);
2. sizes, steps and the parallel layout against the world (:func:`check_run_values`);
3. the comm mode against the world's device (:func:`comm_for_world`: refused, or the
   fallback the ranks will take);
4. the dump folder can be written (:func:`check_dump_folder`);
5. the whole job config as the trainer will parse it (TorchTitan's parser plus
   ``[tide]``: ``launch/job_config.py``).

Refused earlier, before these: the command line itself (``launch/command_line.py``: no
``--config``, no such config, a boolean that is none) and the environment's world
(``launch/world.py``: ``NGPU``, ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``).
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_tide.launch.command_line import (
    effective_tide,
    normalize_bool_flags,
    override_values,
)
from torchtitan_tide.launch.errors import LaunchError
from torchtitan_tide.launch.job_config import (
    bool_keys,
    check_job_args,
    custom_config_module,
    option_types,
)
from torchtitan_tide.launch.world import World

if typing.TYPE_CHECKING:
    from torchtitan_tide.config import Tide

# (section.key, smallest accepted value, what the key means): checked by check_run_values.
POSITIVE_INTS = (
    ("training.steps", 1, "training steps"),
    ("training.seq_len", 1, "tokens per sample"),
    ("training.local_batch_size", 1, "samples per rank and micro-batch"),
    ("lr_scheduler.warmup_steps", 0, "warm-up steps"),
    ("metrics.log_freq", 1, "steps between logged metrics"),
    ("checkpoint.interval", 1, "steps between checkpoints"),
)
POSITIVE_FLOATS = (
    ("training.max_norm", "the gradient-norm clip; 0 would zero every gradient"),
    ("optimizer.lr", "learning rate"),
)


@dataclass(frozen=True)
class CommChoice:
    """The comm mode the ranks will run (``mode``) and, where that is the fallback, why
    the configured one cannot run (``fallback_reason``; None when it runs as configured)."""

    mode: str
    fallback_reason: str | None = None


@dataclass(frozen=True)
class CheckedRun:
    """A run that passed every check of :func:`check_run`, as the launcher starts it."""

    table: dict[str, Any]
    """The parsed TOML."""
    values: dict[str, str]
    """The overrides as {"section.key": value} (``command_line.override_values``)."""
    overrides: list[str]
    """The overrides as the trainer gets them (booleans in TorchTitan's flag form)."""
    tide: Tide
    comm: CommChoice
    job_config: Any
    """TorchTitan's JobConfig, as the trainer will parse it."""


def check_run(config_path: Path, overrides: list[str], world: World) -> CheckedRun:
    """Every check of the module docstring, in its order, for the run of ``config_path``
    with the command-line ``overrides`` on ``world``.

    Raises:
        LaunchError, TideConfigError, JobArgsError (all ValueError): the first check that
            fails, naming the key, the value and the fix.
    """
    from torchtitan_tide.config import load_toml  # imports torch (torchtitan_tide.comm)

    table = load_toml(str(config_path))
    values = override_values(overrides)
    tide = effective_tide(config_path, table, values)
    check_run_values(table, values, world, tide)
    comm = comm_for_world(tide, world)
    dump_folder, dump_folder_source = dump_folder_setting(config_path, table, values)
    if dump_folder is not None:
        check_dump_folder(dump_folder, dump_folder_source)
    # The whole job config as the trainer will parse it (imports TorchTitan: ~3 s more).
    types = option_types(custom_config_module(table, values))
    overrides = normalize_bool_flags(overrides, bool_keys(types))
    job_config = check_job_args(config_path, table, overrides, types)
    if dump_folder is None:
        check_dump_folder(job_config.job.dump_folder, dump_folder_source)
    return CheckedRun(table, values, overrides, tide, comm, job_config)


def _setting(table: dict, values: dict[str, str], key: str):
    """``key`` ("section.name") from the overrides, else the TOML table, else None."""
    if key in values:
        return values[key]
    section, _, name = key.partition(".")
    return table.get(section, {}).get(name)


def _as_number(key: str, raw, kind: type):
    if isinstance(raw, bool):
        raise LaunchError(f"--{key} {raw!r} must be a number")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        word = "an integer" if kind is int else "a number"
        raise LaunchError(f"--{key} {raw!r} must be {word}") from None


def check_run_values(table: dict, values: dict[str, str], world: World, tide: Tide) -> None:
    """Sizes, steps and the parallel layout of the run (TOML ``table`` after the override
    ``values``) checked against ``world`` before any process starts.

    Raises:
        LaunchError: naming the key, the bad value and the fix.
    """
    for key, minimum, meaning in POSITIVE_INTS:
        raw = _setting(table, values, key)
        if raw is not None and _as_number(key, raw, int) < minimum:
            raise LaunchError(
                f"--{key} {raw} ({meaning}) must be an integer >= {minimum}; "
                f"set [{key.split('.')[0]}] {key.split('.')[1]} or --{key} to at least {minimum}"
            )
    for key, meaning in POSITIVE_FLOATS:
        raw = _setting(table, values, key)
        if raw is not None and not _as_number(key, raw, float) > 0:
            raise LaunchError(f"--{key} {raw} must be > 0 ({meaning})")
    degrees = parallel_degrees(table.get("parallelism", {}), values, world.size)
    if any(degree < 1 for degree in degrees.values()):
        raise LaunchError(
            f"parallel degrees {degrees} on {world.size} ranks: each must be >= 1 "
            "(data_parallel_shard_degree may be -1: the ranks the other degrees leave)"
        )
    product = 1
    for degree in degrees.values():
        product *= degree
    if product != world.size:
        raise LaunchError(
            f"parallel degrees {degrees} multiply to {product}, not the world size {world.size}; "
            "set --parallelism.data_parallel_shard_degree -1 or degrees whose product is "
            f"{world.size} (world = NNODES x NGPU)"
        )
    local_batch = _setting(table, values, "training.local_batch_size")
    global_batch = _setting(table, values, "training.global_batch_size")
    if global_batch is not None and _as_number("training.global_batch_size", global_batch, int) > 0:
        per_step = _as_number("training.local_batch_size", local_batch or 8, int) * (
            degrees["dp_shard"] * degrees["dp_replicate"])
        if int(global_batch) % per_step:
            raise LaunchError(
                f"--training.global_batch_size {global_batch} must be a multiple of "
                f"local_batch_size x data-parallel degree = {per_step} (or -1: no accumulation)"
            )
    if tide.comm == "tide":
        from torchtitan_tide.comm.options import TideOptionError
        from torchtitan_tide.comm.plans.group_sizes import check_local_world_size, fsdp_group_sizes

        expert = {
            key: _as_number(f"parallelism.{name}", _setting(table, values, f"parallelism.{name}") or 1, int)
            for key, name in (("ep", "expert_parallel_degree"), ("etp", "expert_tensor_parallel_degree"))
        }  # fmt: skip
        sizes = fsdp_group_sizes(degrees["dp_shard"], degrees["cp"], degrees["tp"], **expert)
        try:
            check_local_world_size(tide.local_world_size, sizes,
                                   f"--tide.local_world_size {tide.local_world_size}")  # fmt: skip
        except TideOptionError as exc:
            raise LaunchError(f"{exc} ({world.size} ranks)") from None


def parallel_degrees(par: dict, values: dict[str, str], world_size: int) -> dict[str, int]:
    """Degrees after overrides; a dp_shard of -1 is resolved as TorchTitan does."""
    keys = (
        ("dp_shard", "data_parallel_shard_degree", -1),
        ("dp_replicate", "data_parallel_replicate_degree", 1),
        ("tp", "tensor_parallel_degree", 1),
        ("pp", "pipeline_parallel_degree", 1),
        ("cp", "context_parallel_degree", 1),
    )
    degrees = {
        short: _as_number(f"parallelism.{key}", values.get(f"parallelism.{key}", par.get(key, default)), int)
        for short, key, default in keys
    }
    if degrees["dp_shard"] == -1:
        others = degrees["dp_replicate"] * degrees["tp"] * degrees["pp"] * degrees["cp"]
        degrees["dp_shard"] = world_size // others if others > 0 else 0
    return degrees


def unavailable_reason(mode: str, backend: str) -> str | None:
    """Why comm ``mode`` cannot run on a process group with ``backend``; None when it can.
    The launcher asks it of the world it starts (:func:`comm_for_world`), each rank of its
    process group (``train_specs.apply_comm_mode``)."""
    if mode == "symm_mem" and "nccl" not in backend:
        return (
            f"comm = 'symm_mem' needs CUDA GPUs with the NCCL backend (symmetric memory), "
            f"but the process group backend is {backend!r}"
        )
    return None


def comm_for_world(tide: Tide, world: World) -> CommChoice:
    """The comm mode the ranks will run on ``world``: ``tide.comm``, or "fsdp2" with the
    reason where that cannot run there and ``[tide] fallback = "fsdp2"`` (the ranks then
    log the fallback).

    Raises:
        LaunchError: ``tide.comm`` cannot run on ``world`` and ``fallback`` is "none".
    """
    reason = unavailable_reason(tide.comm, world.backend)
    if reason is None:
        return CommChoice(tide.comm)
    if tide.fallback != "fsdp2":
        raise LaunchError(
            f"--tide.comm {tide.comm} ([tide] comm) cannot run on this {world.device.upper()} "
            f"world: {reason}; use --tide.comm fsdp2 (or tide, which runs on gloo), or set "
            "[tide] fallback = 'fsdp2' (--tide.fallback fsdp2) to run stock FSDP2 instead"
        )
    return CommChoice("fsdp2", reason)


def check_dump_folder(folder: str, source: str) -> None:
    """``folder`` (the run's ``job.dump_folder``, relative to the working directory as the
    trainer reads it) is a writable folder, or can be created as one. ``source`` says where
    the value came from ("--job.dump_folder", "[job] dump_folder in X.toml").

    Raises:
        LaunchError: naming ``source``, the path in the way and the fix.
    """
    path = Path(folder).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fix = "pass --job.dump_folder a folder you can write (e.g. --job.dump_folder ./outputs/NAME)"
    if not existing.is_dir():
        raise LaunchError(
            f"{source} {folder!r}: {existing} is a file, not a folder, so the dump folder "
            f"cannot be created; {fix}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing}, where it would be created)"
        raise LaunchError(f"{source} {folder!r}: not writable by this user{where}; {fix}")


def dump_folder_setting(
    config_path: Path, table: dict, values: dict[str, str]
) -> tuple[str | None, str]:
    """The run's ``job.dump_folder`` and where it comes from, as an error message names it;
    the folder is None where TorchTitan's default applies."""
    if "job.dump_folder" in values:
        return values["job.dump_folder"], "--job.dump_folder"
    if "dump_folder" in table.get("job", {}):
        return str(table["job"]["dump_folder"]), f"[job] dump_folder in {config_path}"
    return None, "job.dump_folder (TorchTitan's default)"
