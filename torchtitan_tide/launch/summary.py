"""The run as the launcher prints it before starting it (``[run_train] ...`` lines)."""

from __future__ import annotations

import typing
from pathlib import Path

from torchtitan_tide.launch.checks import CheckedRun, parallel_degrees
from torchtitan_tide.launch.world import World

if typing.TYPE_CHECKING:
    from torchtitan_tide.config import Tide


def summary(config_path: Path, world: World, run: CheckedRun, env_notes: list[str]) -> str:
    """The checked ``run`` of ``config_path`` on ``world``: model, world, parallelism, the
    comm mode the ranks will run (``run.comm``: the fallback and why, where one is taken),
    TIDE's node layout, and ``env_notes`` (``command.comm_env``)."""
    values, table, tide = run.values, run.table, run.tide

    def pick(section_name: str, key: str, default):
        return values.get(f"{section_name}.{key}", table.get(section_name, {}).get(key, default))

    unit = "GPUs" if world.device == "cuda" else "CPU processes"
    fallback = run.comm.fallback_reason
    lines = [
        f"config      {config_path}",
        (f"model       {pick('model', 'name', 'llama3')} / flavor "
         f"{pick('model', 'flavor', 'debugmodel')}"),
        f"world       {world.size} = {world.nnodes} node(s) x {world.nproc_per_node} {unit} "
        f"({world.backend}); this node rank {world.node_rank}"
        + (f", rendezvous {world.master_addr}:{world.master_port}" if world.nnodes > 1 else ""),
        "parallelism " + parallelism_line(table.get("parallelism", {}), values, world.size),
        f"comm        {tide.comm} (fallback {tide.fallback})"
        + (f", options {tide.comm_options()}" if tide.comm == "tide" else "")
        + (f"; the ranks will fall back to {run.comm.mode}: {fallback}" if fallback else ""),
        *([tide_layout_line(tide, world)] if run.comm.mode == "tide" else []),
        *(f"comm env    {note}" for note in env_notes),
    ]  # fmt: skip
    return "\n".join("[run_train] " + line for line in lines)


def parallelism_line(par: dict, values: dict[str, str], world_size: int) -> str:
    """The degrees of ``checks.parallel_degrees`` as the summary prints them."""
    degrees = parallel_degrees(par, values, world_size)
    return " ".join(f"{name} {degree}" for name, degree in degrees.items())


def tide_layout_line(tide: Tide, world: World) -> str:
    """How TIDE will group the ranks into nodes, as the summary prints it."""
    if tide.local_world_size:
        nodes = world.size // tide.local_world_size
        return (f"tide layout local_world_size {tide.local_world_size} (option): "
                f"{nodes} node(s) x {tide.local_world_size} rank(s) as TIDE sees them")
    return (f"tide layout local_world_size 0: nodes detected at start (kernel boot id + "
            f"launcher node rank) (this launch: {world.nnodes} node(s) x "
            f"{world.nproc_per_node} rank(s))")
