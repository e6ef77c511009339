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
==============  ==============================================================

``comm = "symm_mem"`` also gets ``NCCL_CTA_POLICY=2`` (NCCL's zero-CTA policy, read when a
communicator is created: the all-gather then runs on copy engines) unless the environment
sets another value, which is kept with a warning (:func:`comm_env`).

``--dry-run`` prints the summary and the command without running it.
"""

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from torchtitan_tide.config import Tide, check_config_table, load_toml, validate_tide_table

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
            f"(configs live in {REPO_CONFIG_DIR})"
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


def effective_tide(config_path: Path, config: dict, overrides: dict[str, str]) -> Tide:
    """The ``[tide]`` options of the parsed TOML ``config`` after CLI overrides, validated."""
    check_config_table(config, str(config_path))
    table = dict(config.get("tide", {}))
    types = {f.name: f.type for f in fields(Tide)}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if section != "tide":
            continue
        kind = types.get(name)
        if kind in (int, "int"):
            try:
                table[name] = int(value)
            except ValueError:
                raise LaunchError(f"--tide.{name} {value!r} must be an integer") from None
        elif kind in (bool, "bool"):
            table[name] = value.lower() in ("1", "true", "yes")
        else:
            table[name] = value
    return validate_tide_table(table)


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
        "torch.distributed.run",
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
    return cmd + ["--job.config_file", str(config_path), *overrides]


def parallelism_line(par: dict, values: dict[str, str], world_size: int) -> str:
    """Degrees after overrides; a dp_shard of -1 is resolved as TorchTitan does."""
    keys = (
        ("dp_shard", "data_parallel_shard_degree", -1),
        ("dp_replicate", "data_parallel_replicate_degree", 1),
        ("tp", "tensor_parallel_degree", 1),
        ("pp", "pipeline_parallel_degree", 1),
        ("cp", "context_parallel_degree", 1),
    )
    degrees = {
        short: int(values.get(f"parallelism.{key}", par.get(key, default)))
        for short, key, default in keys
    }
    if degrees["dp_shard"] == -1:
        others = degrees["dp_replicate"] * degrees["tp"] * degrees["pp"] * degrees["cp"]
        degrees["dp_shard"] = world_size // others
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
    values = override_values(overrides)
    table = load_toml(str(config_path)) if table is None else table
    model = table.get("model", {})
    par = table.get("parallelism", {})
    tide = effective_tide(config_path, table, values) if tide is None else tide
    if env_notes is None:
        env_notes = comm_env(tide.comm, os.environ)[1]

    def pick(section: dict, section_name: str, key: str, default):
        return values.get(f"{section_name}.{key}", section.get(key, default))

    backend = "nccl" if world.device == "cuda" else "gloo"
    unit = "GPUs" if world.device == "cuda" else "CPU processes"
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
        + (f", options {tide.comm_options()}" if tide.comm == "tide" else ""),
        *(f"comm env    {note}" for note in env_notes),
    ]
    return "\n".join("[run_train] " + line for line in lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config_name, dry_run, overrides = split_args(argv)
        config_path = resolve_config(config_name)
        world = detect_world()
        table = load_toml(str(config_path))
        tide = effective_tide(config_path, table, override_values(overrides))
        env_updates, env_notes = comm_env(tide.comm, os.environ)
        text = summary(config_path, world, overrides, table=table, tide=tide, env_notes=env_notes)
        print(text, flush=True)
        for note in env_notes:
            if note.startswith("WARNING"):
                print(f"run_train.sh: {note}", file=sys.stderr, flush=True)
    except (LaunchError, ValueError, FileNotFoundError) as exc:
        print(f"run_train.sh: error: {exc}", file=sys.stderr)
        return 2
    cmd = torchrun_command(world, config_path, overrides)
    print("[run_train] " + shlex.join(cmd), flush=True)
    if dry_run:
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
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
