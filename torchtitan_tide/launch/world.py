"""The world the launcher starts: nodes, processes per node, device, rendezvous.

Read from the environment (``NGPU``, ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TIDE_DEVICE``), else SLURM's variables (``SLURM_NNODES``,
``SLURM_NODEID``, the first host of ``SLURM_JOB_NODELIST``), else this machine: its GPUs,
or :data:`DEFAULT_CPU_PROCESSES` CPU processes.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from torchtitan_tide.launch.errors import LaunchError

DEFAULT_CPU_PROCESSES = 2


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


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} must be an integer") from None


def detect_world() -> World:
    """The world from NGPU/NNODES/NODE_RANK/MASTER_* or SLURM variables (module doc).

    Raises:
        LaunchError: naming the variable, its value and the fix.
    """
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
