"""What ``run_train.sh`` runs: resolve a config, print the run, start torchrun.

    ./run_train.sh --config NAME[.toml] [--dry-run] [--section.key value ...]

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

``comm = "symm_mem"`` also gets ``NCCL_CTA_POLICY=2`` (NCCL's zero-CTA policy, read when a
communicator is created: the all-gather then runs on copy engines) unless the environment
sets another value, which is kept with a warning (:func:`comm_env`).

``--dry-run`` prints the summary and the command without running it; ``--help`` prints
this text (standard library only: it works before the install). Booleans take any of
``--section.key``, ``--section.key true|false`` (also ``=false``, ``1/0``, ``yes/no``) and
``--section.no-key``: the launcher rewrites them to the flag form TorchTitan's parser accepts
(:func:`normalize_bool_flags`). Before any process starts, the launcher parses the whole job
config as the trainer will (TorchTitan's parser plus ``[tide]``: an unknown key fails here,
``torchtitan_tide/job_args.py``) and checks sizes, steps and the layout against the world
(:func:`check_run_values`), the comm mode against the device (:func:`comm_for_world`) and
that the dump folder can be written (:func:`check_dump_folder`).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

if typing.TYPE_CHECKING:
    from torchtitan_tide.config import Tide

# torchtitan_tide.config (and so torch, through torchtitan_tide.comm) is imported by the
# functions that need it, never at module level: --help must work before the install.

REPO_CONFIG_DIR = Path(__file__).resolve().parents[1] / "train_configs"
DEFAULT_CPU_PROCESSES = 2
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Set for comm = "symm_mem" before any process group exists: NCCL's zero-CTA policy, so the
# all-gather on symmetric buffers runs on copy engines. Equal to comm/symm_mem.ZERO_CTA_ENV
# (kept here so the launcher does not import torch.distributed; a test checks they agree).
SYMM_MEM_ENV = {"NCCL_CTA_POLICY": "2"}


class LaunchError(ValueError):
    """Bad launcher input; the message names the argument or variable and the fix."""


@dataclass
class World:
    nnodes: int
    nproc_per_node: int
    node_rank: int
    device: str  # "cuda" or "cpu"
    master_addr: str | None
    master_port: int

    @property
    def size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def backend(self) -> str:
        """The process-group backend TorchTitan will create on this device."""
        return "nccl" if self.device == "cuda" else "gloo"


def resolve_config(name: str, config_dir: Path = REPO_CONFIG_DIR) -> Path:
    """``name`` in ``config_dir`` (``.toml`` optional), else ``name`` as a path."""
    candidates = [config_dir / name, config_dir / f"{name}.toml", Path(name)]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    available = sorted(p.name for p in config_dir.glob("*.toml"))
    raise LaunchError(
        f"--config {name!r}: no such file in {config_dir} or as a path; "
        f"available configs: {available}"
    )


BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
              "0": False, "false": False, "no": False, "off": False}


def split_args(argv: list[str]) -> tuple[str, bool, list[str]]:
    """Return (config name, dry_run, overrides passed to TorchTitan)."""
    config, dry_run, overrides = None, False, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                config = arg.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
                config = argv[i]
            else:
                raise LaunchError("--config needs a value: --config NAME.toml")
        elif arg == "--dry-run":
            dry_run = True
        elif arg.split("=", 1)[0] in ("--job.config_file", "--job.config-file"):
            raise LaunchError("use --config NAME instead of --job.config_file with run_train.sh")
        else:
            overrides.append(arg)
        i += 1
    if not config:
        raise LaunchError(
            "missing --config; e.g. ./run_train.sh --config debug_model.toml "
            f"(configs live in {REPO_CONFIG_DIR}; ./run_train.sh --help for usage)"
        )
    return config, dry_run, overrides


def override_values(overrides: list[str]) -> dict[str, str]:
    """``--section.key value`` / ``--section.key=value`` pairs as {"section.key": value}.
    A flag followed by another flag (or nothing) maps to "true"."""
    values: dict[str, str] = {}
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if arg.startswith("--") and "." in arg:
            key, eq, value = arg[2:].partition("=")
            key = key.replace("-", "_")
            if not eq:
                nxt = overrides[i + 1] if i + 1 < len(overrides) else None
                if nxt is not None and not nxt.startswith("--"):
                    value, i = nxt, i + 1
                else:
                    value = "true"
            values[key] = value
        i += 1
    return values


def parse_bool(key: str, value: str) -> bool:
    """A command-line boolean (``true/false``, ``1/0``, ``yes/no``, ``on/off``)."""
    try:
        return BOOL_WORDS[value.strip().lower()]
    except KeyError:
        flag = "--" + key.replace("_", "-")
        raise LaunchError(
            f"--{key} {value!r} is not a boolean; write {flag} true|false (or {flag} / "
            f"{flag.replace('.', '.no-', 1)})"
        ) from None


def tide_bool_keys() -> set[str]:
    """``tide.key`` of every boolean ``[tide]`` option (no TorchTitan import needed; every
    boolean of the job config: :func:`torchtitan_tide.job_args.bool_keys`)."""
    from torchtitan_tide.config import Tide

    return {f"tide.{f.name}" for f in fields(Tide) if f.type in (bool, "bool")}


def normalize_bool_flags(args: list[str], bool_keys: set[str]) -> list[str]:
    """Rewrite boolean options in ``args`` to the flag form TorchTitan's tyro parser takes:
    ``--s.key``, ``--s.key true``, ``--s.key=1`` -> ``--s.key``; ``--s.key false``,
    ``--s.key=no``, ``--s.no-key`` -> ``--s.no_key`` (nested keys alike:
    ``--a.b.no_key``). Other arguments pass unchanged.

    Raises:
        LaunchError: a boolean option followed by a value that is not a boolean.
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        raw_key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = raw_key.replace("-", "_")
        section, _, name = key.rpartition(".")
        negated = name.startswith("no_") and f"{section}.{name[3:]}" in bool_keys
        if key not in bool_keys and not negated:
            out.append(arg)
            i += 1
            continue
        if negated:
            key, name = f"{section}.{name[3:]}", name[3:]
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, eq, i = args[i + 1], "=", i + 1
        state = parse_bool(key, value) if eq else True
        out.append(f"--{section}.{name}" if state != negated else f"--{section}.no_{name}")
        i += 1
    return out


def effective_tide(config_path: Path, config: dict, overrides: dict[str, str]) -> Tide:
    """The ``[tide]`` options of the parsed TOML ``config`` after CLI overrides, validated."""
    from torchtitan_tide.config import Tide, check_config_table, validate_tide_table

    check_config_table(config, str(config_path))
    table = dict(config.get("tide", {}))
    types = {f.name: f.type for f in fields(Tide)}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if section != "tide":
            continue
        kind = types.get(name)
        if kind is None and name.startswith("no_") and types.get(name[3:]) in (bool, "bool"):
            table[name[3:]] = not parse_bool(f"tide.{name}", value)
            continue
        if kind in (int, "int"):
            try:
                table[name] = int(value)
            except ValueError:
                raise LaunchError(f"--tide.{name} {value!r} must be an integer") from None
        elif kind in (bool, "bool"):
            table[name] = parse_bool(f"tide.{name}", value)
        else:
            table[name] = value
    return validate_tide_table(table)


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
        from torchtitan_tide.comm.group_sizes import check_local_world_size, fsdp_group_sizes
        from torchtitan_tide.comm.options import TideOptionError

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


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} must be an integer") from None


def detect_world() -> World:
    """The world from NGPU/NNODES/NODE_RANK/MASTER_* or SLURM variables (module doc)."""
    forced_cpu = os.environ.get("TIDE_DEVICE", "").lower() == "cpu"
    gpus = 0 if forced_cpu else _cuda_device_count()
    device = "cuda" if gpus > 0 else "cpu"
    nproc = _env_int("NGPU", gpus if gpus > 0 else DEFAULT_CPU_PROCESSES)
    nnodes = _env_int("NNODES", _env_int("SLURM_NNODES", 1))
    node_rank = _env_int("NODE_RANK", _env_int("SLURM_NODEID", 0))
    if nproc < 1 or nnodes < 1:
        raise LaunchError(f"NGPU={nproc} and NNODES={nnodes} must be >= 1")
    if device == "cuda" and nproc > gpus:
        raise LaunchError(f"NGPU={nproc} but only {gpus} GPUs are visible on this node")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"NODE_RANK={node_rank} must be in [0, NNODES={nnodes})")
    master_addr = os.environ.get("MASTER_ADDR") or None
    if nnodes > 1 and master_addr is None:
        master_addr = _slurm_first_host()
    if nnodes > 1 and master_addr is None:
        raise LaunchError("multi-node runs need MASTER_ADDR (or SLURM_JOB_NODELIST with scontrol)")
    return World(
        nnodes=nnodes,
        nproc_per_node=nproc,
        node_rank=node_rank,
        device=device,
        master_addr=master_addr,
        master_port=_env_int("MASTER_PORT", 29500),
    )


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _slurm_first_host() -> str | None:
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    hosts = out.split()
    return hosts[0] if hosts else None


def torchrun_command(world: World, config_path: Path, overrides: list[str]) -> list[str]:
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
    cmd += ["--role=rank", "--tee=3", "-m", "torchtitan_tide.train"]
    return cmd + trainer_args(config_path, overrides)


def trainer_args(config_path: Path, overrides: list[str]) -> list[str]:
    """The arguments ``torchtitan_tide.train`` gets (after torchrun's own)."""
    return ["--job.config_file", str(config_path), *overrides]


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


def parallelism_line(par: dict, values: dict[str, str], world_size: int) -> str:
    """The degrees of :func:`parallel_degrees` as the summary prints them."""
    degrees = parallel_degrees(par, values, world_size)
    return " ".join(f"{name} {degree}" for name, degree in degrees.items())


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


def comm_for_world(tide: Tide, world: World) -> str:
    """The comm mode the ranks will run on ``world``: ``tide.comm``, or "fsdp2" where that
    cannot run there and ``[tide] fallback = "fsdp2"`` (the ranks then log the fallback).

    Raises:
        LaunchError: ``tide.comm`` cannot run on ``world`` and ``fallback`` is "none".
    """
    reason = unavailable_reason(tide.comm, world.backend)
    if reason is None:
        return tide.comm
    if tide.fallback != "fsdp2":
        raise LaunchError(
            f"--tide.comm {tide.comm} ([tide] comm) cannot run on this {world.device.upper()} "
            f"world: {reason}; use --tide.comm fsdp2 (or tide, which runs on gloo), or set "
            "[tide] fallback = 'fsdp2' (--tide.fallback fsdp2) to run stock FSDP2 instead"
        )
    return "fsdp2"


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


def summary(
    config_path: Path,
    world: World,
    overrides: list[str],
    *,
    table: dict | None = None,
    tide: Tide | None = None,
    env_notes: list[str] | None = None,
) -> str:
    """The run as the launcher prints it. ``table`` (the parsed TOML), ``tide`` and
    ``env_notes`` (from :func:`comm_env`) are derived when not given."""
    from torchtitan_tide.config import load_toml

    values = override_values(overrides)
    table = load_toml(str(config_path)) if table is None else table
    model = table.get("model", {})
    par = table.get("parallelism", {})
    tide = effective_tide(config_path, table, values) if tide is None else tide
    if env_notes is None:
        env_notes = comm_env(tide.comm, os.environ)[1]

    def pick(section: dict, section_name: str, key: str, default):
        return values.get(f"{section_name}.{key}", section.get(key, default))

    backend = world.backend
    unit = "GPUs" if world.device == "cuda" else "CPU processes"
    unavailable = unavailable_reason(tide.comm, backend)
    lines = [
        f"config      {config_path}",
        (
            f"model       {pick(model, 'model', 'name', 'llama3')} / flavor "
            f"{pick(model, 'model', 'flavor', 'debugmodel')}"
        ),
        f"world       {world.size} = {world.nnodes} node(s) x {world.nproc_per_node} {unit} "
        f"({backend}); this node rank {world.node_rank}"
        + (f", rendezvous {world.master_addr}:{world.master_port}" if world.nnodes > 1 else ""),
        "parallelism " + parallelism_line(par, values, world.size),
        f"comm        {tide.comm} (fallback {tide.fallback})"
        + (f", options {tide.comm_options()}" if tide.comm == "tide" else "")
        + (f"; the ranks will fall back to fsdp2: {unavailable}" if unavailable else ""),
        *([tide_layout_line(tide, world)] if tide.comm == "tide" else []),
        *(f"comm env    {note}" for note in env_notes),
    ]
    return "\n".join("[run_train] " + line for line in lines)


def tide_layout_line(tide: Tide, world: World) -> str:
    """How TIDE will group the ranks into nodes, as the summary prints it."""
    if tide.local_world_size:
        nodes = world.size // tide.local_world_size
        return (f"tide layout local_world_size {tide.local_world_size} (option): "
                f"{nodes} node(s) x {tide.local_world_size} rank(s) as TIDE sees them")
    return (f"tide layout local_world_size 0: nodes detected at start (kernel boot id + "
            f"launcher node rank) (this launch: {world.nnodes} node(s) x "
            f"{world.nproc_per_node} rank(s))")


def print_help() -> int:
    """Print the module docstring (standard library only: it works before the install). A
    reader that closes the pipe early (``--help | head``) ends it quietly."""
    try:
        sys.stdout.write(__doc__.strip() + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
    return 0


def _discard_stdout() -> None:
    """Point stdout at /dev/null: Python's flush at exit then cannot raise BrokenPipeError
    again (the recipe of Python's ``signal`` documentation)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        return print_help()
    try:
        config_name, dry_run, overrides = split_args(argv)
        config_path = resolve_config(config_name)
        world = detect_world()
        from torchtitan_tide.config import load_toml  # imports torch (torchtitan_tide.comm)

        table = load_toml(str(config_path))
        values = override_values(overrides)
        tide = effective_tide(config_path, table, values)
        check_run_values(table, values, world, tide)
        comm_for_world(tide, world)
        dump_folder, dump_folder_source = dump_folder_setting(config_path, table, values)
        if dump_folder is not None:
            check_dump_folder(dump_folder, dump_folder_source)
        # The whole job config as the trainer will parse it (imports TorchTitan: ~3 s more).
        from torchtitan_tide import job_args

        types = job_args.option_types(job_args.custom_config_module(table, values))
        overrides = normalize_bool_flags(overrides, job_args.bool_keys(types))
        job_config = job_args.check_job_args(config_path, table, overrides, types)
        if dump_folder is None:
            check_dump_folder(job_config.job.dump_folder, dump_folder_source)
        env_updates, env_notes = comm_env(tide.comm, os.environ)
        text = summary(config_path, world, overrides, table=table, tide=tide, env_notes=env_notes)
        print(text, flush=True)
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
    cmd = torchrun_command(world, config_path, overrides)
    print("[run_train] " + shlex.join(cmd), flush=True)
    if dry_run:
        print("[run_train] dry run: nothing started (drop --dry-run to train)", flush=True)
        return 0
    env = dict(os.environ)
    if world.device == "cpu":
        env["TIDE_DEVICE"] = "cpu"
        env.setdefault(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world.nproc_per_node))
        )
    # NVLink multicast stays off unless the caller's environment turns it on: on shared
    # hosts a multicast fault can take every GPU of the host out of service.
    for key, value in MULTICAST_OFF.items():
        env.setdefault(key, value)
    env.update(env_updates)
    print("[run_train] multicast: " + " ".join(f"{k}={env[k]}" for k in MULTICAST_OFF), flush=True)
    started = time.time()
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        from torchtitan_tide.comm.watchdog import failure_summary

        if cause := failure_summary(job_config.job.dump_folder, since=started):
            print(f"run_train.sh: cause: {cause}", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. `--dry-run | head`: the reader is gone, nothing to report
        _discard_stdout()
        sys.exit(1)
