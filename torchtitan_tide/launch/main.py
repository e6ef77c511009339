"""What ``run_train.sh`` runs: resolve a config, print the run, start torchrun.

    ./run_train.sh --config NAME[.toml] [--dry-run] [--preflight] [--section.key value ...]

NAME is looked up in ``train_configs/`` first, then as a path. Overrides go to
TorchTitan unchanged (its ``--section.key value`` syntax). The world comes from the
environment:

==============  ==============================================================
NGPU            processes per node (default: the GPUs present, else 2 on CPU)
NNODES          nodes (default: SLURM_NNODES, else 1)
NODE_RANK       this node's rank (default: SLURM_NODEID, else 0)
MASTER_ADDR     rendezvous host for multi-node runs (default: first host of
                SLURM_JOB_NODELIST via ``scontrol``); MASTER_PORT (default 29500)
LOG_RANK        local ranks whose output is shown (default 0; "0,1" or "all")
TIDE_DEVICE     "cpu" forces CPU training even where GPUs exist
TIDE_LOG_ALL    "1" shows the known-harmless messages the training entry hides
==============  ==============================================================

``comm = "symm_mem"`` also gets ``NCCL_CTA_POLICY=2`` (NCCL's zero-CTA policy: the
all-gather then runs on copy engines) unless the environment sets another value, which is
kept with a warning. When stdout is not a terminal (a batch job's log file) TorchTitan's
colour codes are off unless the run sets ``metrics.disable_color_printing``.

``--preflight`` runs, on the same world and config, checks of TIDE's assumptions instead of
training (``torchtitan_tide/preflight``; docs/guide/slurm-and-preflight.md): what each rank
has (torch, NCCL, driver, GPU, nodes), which path each tier gets, the one-sided protocol
under stress, sharded gradients of ``tide`` vs ``fsdp2``, and collective rates with the
simulator's prediction for this cluster. Rank 0 prints one table and writes it as JSON under
``<dump_folder>/preflight/``; the exit status is non-zero when a check fails (the failed
check, rank and fix are named). ``TIDE_PREFLIGHT_TIMEOUT_S`` bounds each check (default 300).

``--dry-run`` prints the summary and the command without running it; ``--help`` prints
this text (standard library only: it works before the install). Booleans take any of
``--section.key``, ``--section.key true|false`` (also ``=false``, ``1/0``, ``yes/no``) and
``--section.no-key``. Before any process starts, the launcher parses the whole job config
as the trainer will (TorchTitan's parser plus ``[tide]``: an unknown key fails here) and
checks sizes, steps and the layout against the world, the comm mode against the device and
that the dump folder can be written: every refusal is in
``torchtitan_tide/launch/checks.py``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

from torchtitan_tide.launch.checks import check_run
from torchtitan_tide.launch.command import (
    MULTICAST_OFF,
    PREFLIGHT_ENTRY,
    TRAIN_ENTRY,
    comm_env,
    command_env,
    plain_log_args,
    torchrun_command,
)
from torchtitan_tide.launch.command_line import resolve_config, split_args
from torchtitan_tide.launch.errors import LaunchError
from torchtitan_tide.launch.summary import summary
from torchtitan_tide.launch.world import detect_world


def print_help() -> int:
    """Print the module docstring (standard library only: it works before the install). A
    reader that closes the pipe early (``--help | head``) ends it quietly."""
    try:
        sys.stdout.write(__doc__.strip() + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        discard_stdout()
    return 0


def discard_stdout() -> None:
    """Point stdout at /dev/null: Python's flush at exit then cannot raise BrokenPipeError
    again (the recipe of Python's ``signal`` documentation)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    """The launcher (module docstring); returns the exit code: 2 for a refused run, else
    torchrun's."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        return print_help()
    try:
        args = split_args(argv)
        config_path = resolve_config(args.config)
        world = detect_world()
        run = check_run(config_path, args.overrides, world)
        env_updates, env_notes = comm_env(run.tide.comm, os.environ)  # as the train entry
        print(summary(config_path, world, run, env_notes), flush=True)
        if args.preflight:
            print("[run_train] preflight   checks of TIDE's assumptions on this world instead "
                  "of training; one table at the end, JSON under "
                  f"{run.job_config.job.dump_folder}/preflight/", flush=True)  # fmt: skip
        for note in env_notes:
            if note.startswith("WARNING"):
                print(f"run_train.sh: {note}", file=sys.stderr, flush=True)
    except (LaunchError, ValueError, FileNotFoundError) as exc:
        print(f"run_train.sh: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # torch / TorchTitan not installed yet
        print(f"run_train.sh: error: {exc}; install first: bash scripts/install.sh "
              "(README, Quick start)", file=sys.stderr)
        return 2
    plain = plain_log_args(run.table, run.values, sys.stdout.isatty())
    entry = PREFLIGHT_ENTRY if args.preflight else TRAIN_ENTRY
    cmd = torchrun_command(world, config_path, [*plain, *run.overrides], entry)
    print("[run_train] " + shlex.join(cmd), flush=True)
    if args.dry_run:
        print("[run_train] dry run: nothing started (drop --dry-run to "
              f"{'run the preflight' if args.preflight else 'train'})", flush=True)  # fmt: skip
        return 0
    env = command_env(world, os.environ, env_updates)
    print("[run_train] multicast: " + " ".join(f"{k}={env[k]}" for k in MULTICAST_OFF), flush=True)
    started = time.time()
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        from torchtitan_tide.comm.base.watchdog import failure_summary

        if cause := failure_summary(run.job_config.job.dump_folder, since=started):
            print(f"run_train.sh: cause: {cause}", file=sys.stderr, flush=True)
    return rc
