"""Several processes on ONE GPU as the ranks of a multi-node job
(docs/design/2026-12-02-emulation.md).

Two modes (:data:`MODES`), each process one rank and its own launcher "node" (as
``scripts/gpu/emulate.sh`` starts ``run_train.sh`` once per node with ``NGPU=1``):

- ``"nodes"``: every process is its own NCCL node: its own ``NCCL_HOSTID``, NCCL's
  socket transport on the loopback interface, InfiniBand off. NCCL builds N nodes over
  NET/Socket (about 1.7 GiB/s); the bundled NCCL 2.28.9 does it.
- ``"one_node"``: NCCL sees ONE node whose ranks share a GPU
  (``NCCL_MULTI_RANK_GPU_ENABLE=1``, no host ids): NCCL >= 2.30 in torch's place
  (``nccl_rma.multi_rank_gpu_missing_reason`` says why not: the tests' skip reason).

TIDE sees one node per process in both modes (torchrun's ``GROUP_RANK`` differs): its
cross-node path runs. torch's CUDA symmetric memory refuses two ranks on one device, so
TIDE's copy engine cannot run here.

:func:`spawn_emulated` is ``_harness.spawn`` for these processes: every rank on cuda:0
(``CUDA_VISIBLE_DEVICES`` = the first visible GPU), its environment set before
``init_process_group``, NCCL's INFO log in a folder when asked (:func:`nccl_comms` reads
the node counts NCCL built, :func:`nccl_versions` its version lines), bounded in time.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _harness import free_port

from torchtitan_tide.launch.command import MULTICAST_OFF

MODES = ("nodes", "one_node")
HOST_ID_PREFIX = "emunode"
_COMM_LINE = re.compile(r"nRanks (\d+) nNodes (\d+) localRanks (\d+)")
_VERSION_LINE = re.compile(r"NCCL version (\S+)")


def emulated_env(node: int, mode: str) -> dict[str, str]:
    """The NCCL variables of the process of emulated node ``node`` in ``mode`` (what a
    user sets; ``scripts/gpu/emulate.sh`` sets the same, a CPU test checks they agree)."""
    if mode not in MODES:
        raise ValueError(f"emulation mode {mode!r}: choose one of {list(MODES)}")
    env = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
    if mode == "nodes":
        env["NCCL_HOSTID"] = f"{HOST_ID_PREFIX}{node}"
    else:
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    return env


def launcher_node_env(node: int) -> dict[str, str]:
    """What torchrun sets for the one process of launcher node ``node`` (TIDE reads
    ``GROUP_RANK`` as the node; TorchTitan and DeviceMesh read ``LOCAL_RANK``)."""
    return {"GROUP_RANK": str(node), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def first_visible_gpu(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """The GPU every emulated rank runs on: the first of ``CUDA_VISIBLE_DEVICES``, else 0."""
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def nccl_log_env(folder: str) -> dict[str, str]:
    """NCCL's INFO log of the init phase into one file per process in ``folder``."""
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT",
        "NCCL_DEBUG_FILE": os.path.join(folder, "nccl.%h.%p.log"),
    }


def _entry(rank: int, world_size: int, port: int, mode: str, log_dir: str | None, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for key in ("NCCL_HOSTID", "NCCL_MULTI_RANK_GPU_ENABLE"):  # the other mode's, if inherited
        os.environ.pop(key, None)
    os.environ.update(emulated_env(rank, mode))
    os.environ.update(launcher_node_env(rank))
    if log_dir is not None:
        os.environ.update(nccl_log_env(log_dir))
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(2)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world_size, device_id=device, timeout=timedelta(seconds=180)
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set ``values`` in this process's environment for the block (children started in it
    inherit them; this process's CUDA, already initialized, is not affected)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def spawn_emulated(
    fn: Callable,
    world_size: int,
    *args,
    mode: str = "nodes",
    timeout_s: float = 240.0,
    nccl_log_dir: str | None = None,
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes on GPU 0, one
    emulated node each (``mode``, module docstring), with an NCCL process group. An
    exception in any rank fails the call; so does not finishing within ``timeout_s``
    (every process is killed then). ``nccl_log_dir``: NCCL's INIT log goes there."""
    emulated_env(0, mode)  # checks the mode before anything starts
    with _environ(CUDA_VISIBLE_DEVICES=first_visible_gpu()):
        ctx = mp.start_processes(
            _entry,
            args=(world_size, free_port(), mode, nccl_log_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{world_size} emulated ranks ({mode}) did not finish within {timeout_s:.0f} s"
                    + (f"; NCCL logs in {nccl_log_dir}" if nccl_log_dir else "")
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)


def _log_lines(folder: str | Path) -> Iterator[str]:
    for path in sorted(Path(folder).glob("nccl.*.log")):
        yield from path.read_text(errors="replace").splitlines()


def nccl_comms(folder: str | Path) -> list[tuple[int, int, int]]:
    """(ranks, nodes, local ranks) of every communicator NCCL's INIT log in ``folder``
    reports (its "comm ... nRanks R nNodes N localRanks L" line, one per rank and comm)."""
    out = []
    for line in _log_lines(folder):
        m = _COMM_LINE.search(line)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), int(m.group(3))))
    return out


def nccl_versions(folder: str | Path) -> set[str]:
    """The versions in NCCL's "NCCL version X" lines of the logs in ``folder``."""
    return {m.group(1) for line in _log_lines(folder) if (m := _VERSION_LINE.search(line))}


def log_tail(folder: str | Path, lines: int = 40) -> str:
    """The last ``lines`` lines of every NCCL log in ``folder`` (for failure messages)."""
    out = []
    for path in sorted(Path(folder).glob("nccl.*.log")):
        text = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.name}\n" + "\n".join(text))
    return "\n".join(out)
