"""The command the launcher runs: torchrun over ``torchtitan_tide.train`` (or, with
``--preflight``, ``torchtitan_tide.preflight``: the same world, checks instead of training),
and its environment.

``comm = "symm_mem"`` also gets ``NCCL_CTA_POLICY=2`` (NCCL's zero-CTA policy, read when a
communicator is created: the all-gather then runs on copy engines) unless the environment
sets another value, which is kept with a warning (:func:`comm_env`). NVLink multicast stays
off unless the caller's environment turns it on (:data:`MULTICAST_OFF`). Where the
launcher's stdout is not a terminal (a batch job's log file) TorchTitan's colour codes are
turned off unless the run sets ``metrics.disable_color_printing`` itself
(:func:`plain_log_args`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from torchtitan_tide.launch.job_config import trainer_args
from torchtitan_tide.launch.world import World

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Set for comm = "symm_mem" before any process group exists: NCCL's zero-CTA policy, so the
# all-gather on symmetric buffers runs on copy engines. Equal to comm/symm_mem.ZERO_CTA_ENV
# (kept here so the launcher does not import torch.distributed; a test checks they agree).
SYMM_MEM_ENV = {"NCCL_CTA_POLICY": "2"}

COLOR_KEY = "metrics.disable_color_printing"
TRAIN_ENTRY = "torchtitan_tide.train"
PREFLIGHT_ENTRY = "torchtitan_tide.preflight"  # run_train.sh --preflight


def plain_log_args(table: dict, values: dict[str, str], stdout_is_terminal: bool) -> list[str]:
    """``["--metrics.disable_color_printing"]`` where the output goes to a file or pipe and
    neither the TOML ``table`` (``[metrics] disable_color_printing``) nor the override
    ``values`` set the key; else ``[]`` (the user's choice, or a terminal, keeps colour)."""
    section, _, name = COLOR_KEY.partition(".")
    user_set = (
        COLOR_KEY in values
        or f"{section}.no_{name}" in values
        or name in table.get(section, {})
    )
    return [] if stdout_is_terminal or user_set else [f"--{COLOR_KEY}"]


def torchrun_command(
    world: World, config_path: Path, overrides: list[str], entry: str = TRAIN_ENTRY
) -> list[str]:
    """torchrun (``torchtitan_tide.torchrun``) over the module ``entry`` (the trainer, or
    :data:`PREFLIGHT_ENTRY`) on ``world``, getting ``config_path`` and ``overrides`` as the
    trainer would; ``LOG_RANK`` picks the local ranks whose output is shown (default 0;
    "all")."""
    log_rank = os.environ.get("LOG_RANK", "0")
    cmd = [
        sys.executable,
        "-m",
        "torchtitan_tide.torchrun",  # torchrun, with a short grace before SIGKILL of hung ranks
        f"--nproc_per_node={world.nproc_per_node}",
    ]
    if world.nnodes > 1:
        cmd += [
            f"--nnodes={world.nnodes}",
            f"--node_rank={world.node_rank}",
            f"--master_addr={world.master_addr}",
            f"--master_port={world.master_port}",
        ]
    else:
        cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"]
    if log_rank != "all":
        cmd += [f"--local-ranks-filter={log_rank}"]
    cmd += ["--role=rank", "--tee=3", "-m", entry]
    return cmd + trainer_args(config_path, overrides)


def comm_env(comm: str, environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """Variables comm mode ``comm`` needs before any process group exists: (the ones to set,
    one note per variable). A value the environment already has is kept (with a warning
    note when it differs from what the mode wants)."""
    if comm != "symm_mem":
        return {}, []
    updates, notes = {}, []
    for key, value in SYMM_MEM_ENV.items():
        current = environ.get(key) or None
        if current is None:
            updates[key] = value
            notes.append(
                f"{key}={value} (set for comm = 'symm_mem': zero-CTA copy-engine all-gather)"
            )
        elif current == value:
            notes.append(f"{key}={value} (from the environment)")
        else:
            notes.append(
                f"WARNING: {key}={current} from the environment is kept; comm = 'symm_mem' "
                f"wants {key}={value} (zero-CTA copy-engine all-gather), so this run is not "
                "the documented baseline"
            )
    return updates, notes


def command_env(world: World, environ: Mapping[str, str], comm_updates: Mapping[str, str]) -> dict[str, str]:
    """The environment of the command: ``environ``, plus on a CPU world ``TIDE_DEVICE=cpu``
    and ``OMP_NUM_THREADS`` (the cores shared by the processes, unless set), plus
    :data:`MULTICAST_OFF` where ``environ`` does not set those, plus ``comm_updates``
    (:func:`comm_env`)."""
    env = dict(environ)
    if world.device == "cpu":
        env["TIDE_DEVICE"] = "cpu"
        env.setdefault(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world.nproc_per_node))
        )
    # NVLink multicast stays off unless the caller's environment turns it on: on shared
    # hosts a multicast fault can take every GPU of the host out of service.
    for key, value in MULTICAST_OFF.items():
        env.setdefault(key, value)
    env.update(comm_updates)
    return env
