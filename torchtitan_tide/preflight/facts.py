"""Check 1, ``ranks``: what each rank has, and whether the ranks agree.

Each rank reports (:func:`rank_facts`) its host, torch, CUDA runtime, the NCCL library it
loaded (``ncclGetVersion`` of the mapped file: torch's own string names its build), the CUDA
driver, its GPU and what GPUDirect RDMA needs (``nvidia_peermem``, the GPU's GPUDirect RDMA
and DMA-BUF attributes, RDMA devices); rank 0 turns the gathered facts into rows
(:func:`rows`): a version that differs between ranks is a failure naming the odd ranks
(another NCCL on one node is the classic cause of a stall), two ranks on one GPU a warning,
and the nodes as the launcher started them beside the nodes TIDE resolves for each FSDP group.

Tests only: ``TIDE_PREFLIGHT_FAKE_VERSIONS="RANK:KEY=VALUE[,RANK:KEY=VALUE...]"`` makes rank
RANK report VALUE for KEY (``torch``, ``nccl``, ``driver``, ``cuda_runtime``), so a test can
plant a mismatch on a machine where every rank has the same library.
"""

from __future__ import annotations

import ctypes
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan_tide.preflight.report import Row, ranks_text

FAKE_VERSIONS_ENV = "TIDE_PREFLIGHT_FAKE_VERSIONS"
VERSION_KEYS = {
    "torch": (
        "torch",
        ("install the same torch on every node (FSDP2's internals, which TIDE patches, "
         "change between releases)"),
    ),
    "cuda_runtime": ("CUDA runtime (torch's build)", "install the same torch build on every node"),
    "nccl": (
        "NCCL (loaded library)",
        ("make every node load the same NCCL: another NCCL on one node is the classic cause "
         "of a stall; check LD_PRELOAD, LD_LIBRARY_PATH and site-packages/nvidia/nccl on the "
         "named node(s) (docs/guide/install.md, NCCL)"),
    ),
    "driver": ("CUDA driver", "install the same NVIDIA driver on every node"),
}
_CU_GPU_DIRECT_RDMA_SUPPORTED = 116  # CUdevice_attribute values (cuda.h)
_CU_DMA_BUF_SUPPORTED = 124


def fake_versions(rank: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """This rank's planted versions from :data:`FAKE_VERSIONS_ENV` (tests only).

    Raises:
        ValueError: a malformed entry or unknown key, naming the variable.
    """
    raw = environ.get(FAKE_VERSIONS_ENV, "").strip()
    out: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        who, _, pair = entry.partition(":")
        key, _, value = pair.partition("=")
        if not who.strip().isdigit() or key not in VERSION_KEYS or not value:
            raise ValueError(
                f"{FAKE_VERSIONS_ENV}: {entry!r} is not RANK:KEY=VALUE with KEY one of "
                f"{sorted(VERSION_KEYS)} (a test hook)"
            )
        if int(who) == rank:
            out[key] = value
    return out


def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _driver(lib: ctypes.CDLL | None) -> str:
    """The kernel module's version and the driver API's CUDA version, e.g. ``580.65.06
    (CUDA 13.0)``."""
    module = ""
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
        module = next((w for w in words if w[:1].isdigit() and "." in w), "")
    except OSError:
        pass
    api = ""
    if lib is not None:
        code = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(code)) == 0:
            api = f"CUDA {code.value // 1000}.{code.value % 1000 // 10}"
    return " ".join(filter(None, (module, f"({api})" if module and api else api))) or "unknown"


def _device_attribute(lib: ctypes.CDLL | None, index: int, attribute: int) -> bool | None:
    if lib is None:
        return None
    device, value = ctypes.c_int(0), ctypes.c_int(0)
    if lib.cuDeviceGet(ctypes.byref(device), index) != 0:
        return None
    if lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) != 0:
        return None
    return bool(value.value)


def _rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def rank_facts(device: torch.device, rank: int) -> dict[str, Any]:
    """What this rank has (module docstring), planted versions applied."""
    facts: dict[str, Any] = {
        "rank": rank,
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda or "none (CPU build)",
        "launcher_node": os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", "")),
        "local_rank": os.environ.get("LOCAL_RANK", ""),
    }
    if device.type == "cuda":
        from torchtitan_tide.comm.transports.windows import nccl_rma

        lib = _libcuda()
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        try:
            built = ".".join(str(v) for v in torch.cuda.nccl.version()[:3])
        except (RuntimeError, AttributeError) as exc:
            built = f"unknown ({exc})"
        try:
            path = nccl_rma.library_path()
        except nccl_rma.NcclError as exc:  # several libnccl mapped: which one torch calls
            path = f"ambiguous: {exc}"
        facts.update(
            nccl=nccl_rma.version_text(nccl_rma.nccl_version()),
            nccl_path=path,
            nccl_torch_build=built,
            driver=_driver(lib),
            gpu=props.name,
            gpu_uuid=str(props.uuid),
            gpu_direct_rdma=_device_attribute(lib, index, _CU_GPU_DIRECT_RDMA_SUPPORTED),
            dma_buf=_device_attribute(lib, index, _CU_DMA_BUF_SUPPORTED),
            nvidia_peermem=os.path.isdir("/sys/module/nvidia_peermem"),
            rdma_devices=_rdma_devices(),
        )
    else:
        facts.update(nccl="none (CPU: gloo)", driver="none (CPU)", gpu="none (CPU)", gpu_uuid="")
    facts.update(fake_versions(rank))
    return facts


def _groups(values: Mapping[int, Any]) -> list[tuple[Any, list[int]]]:
    """(value, ranks holding it), the most common value first."""
    by_value: dict[str, tuple[Any, list[int]]] = {}
    for rank, value in sorted(values.items()):
        by_value.setdefault(repr(value), (value, []))[1].append(rank)
    return sorted(by_value.values(), key=lambda vr: (-len(vr[1]), vr[1][0]))


def _agreement(what: str, values: Mapping[int, Any], fix: str, status_if_differs: str) -> Row:
    groups = _groups(values)
    if len(groups) == 1:
        return Row("ranks", what, "ok", f"{groups[0][0]} on all {len(values)} ranks")
    odd = [r for _, ranks in groups[1:] for r in ranks]
    detail = "; ".join(f"{ranks_text(ranks)}: {value}" for value, ranks in groups)
    return Row("ranks", what, status_if_differs, f"ranks differ: {detail}", odd, fix)


def rows(facts: list[dict[str, Any]], layouts: list[dict[str, Any]]) -> list[Row]:
    """Rank 0's rows of the gathered ``facts`` (one per rank) and ``layouts`` (each rank's
    FSDP group and TIDE's nodes of it: ``main._layout_summary``)."""
    out: list[Row] = []
    hosts: dict[str, list[int]] = {}
    for f in facts:
        hosts.setdefault(f["host"], []).append(f["rank"])
    launcher_nodes = {f["launcher_node"] for f in facts}
    out.append(Row("ranks", "world", "info",
                   f"{len(facts)} ranks on {len(launcher_nodes)} launcher node(s); hosts: "
                   + "; ".join(f"{h} ({ranks_text(r)})" for h, r in hosts.items())))  # fmt: skip
    for key, (label, fix) in VERSION_KEYS.items():
        out.append(_agreement(label, {f["rank"]: f[key] for f in facts}, fix, "FAIL"))
    out.append(_agreement("GPU", {f["rank"]: f["gpu"] for f in facts},
                          "check that every node has the GPUs the job expects", "warn"))  # fmt: skip
    shared: dict[tuple[str, str], list[int]] = {}
    for f in facts:
        if f.get("gpu_uuid"):
            shared.setdefault((f["host"], f["gpu_uuid"]), []).append(f["rank"])
    for (host, uuid), ranks in shared.items():
        if len(ranks) > 1:
            out.append(Row(
                "ranks", "one GPU per rank", "warn",
                f"{ranks_text(ranks)} share GPU {uuid} on {host} (the one-GPU emulation does "
                "this on purpose; on a cluster it is a CUDA_VISIBLE_DEVICES / LOCAL_RANK slip)",
                ranks, "give every rank of a node its own GPU",
            ))  # fmt: skip
    if any("nccl_path" in f for f in facts):
        out.append(_agreement("NCCL library file", {f["rank"]: f.get("nccl_path") for f in facts},
                              VERSION_KEYS["nccl"][1], "warn"))  # fmt: skip
        gdr = {f["rank"]: (f"GPUDirect RDMA {_yes(f['gpu_direct_rdma'])}, DMA-BUF "
                           f"{_yes(f['dma_buf'])}, nvidia_peermem "
                           f"{'loaded' if f['nvidia_peermem'] else 'not loaded'}, RDMA devices "
                           f"{','.join(f['rdma_devices']) or 'none'}") for f in facts}  # fmt: skip
        out.append(_agreement("GPUDirect RDMA (GPU, driver)", gdr,
                              "load nvidia_peermem (or use a DMA-BUF capable driver) and the same "
                              "RDMA devices on every node", "warn"))  # fmt: skip
    else:
        out.append(Row("ranks", "GPUDirect RDMA (GPU, driver)", "skip", "CPU world (gloo)"))
    out += _tide_node_rows(layouts)
    return out


def _yes(value: bool | None) -> str:
    return "unknown" if value is None else "yes" if value else "no"


def _tide_node_rows(layouts: list[dict[str, Any]]) -> list[Row]:
    """One row per distinct (FSDP group size, TIDE's layout, how it was found)."""
    seen: dict[tuple, list[tuple[int, ...]]] = {}
    for item in layouts:
        key = (len(item["shard_ranks"]), item["tide_shape"], item["tide_source"])
        groups = seen.setdefault(key, [])
        if tuple(item["shard_ranks"]) not in groups:
            groups.append(tuple(item["shard_ranks"]))
    out = []
    for (size, shape, source), groups in seen.items():
        which = (f"FSDP group {ranks_text(list(groups[0]))}" if len(groups) == 1
                 else f"{len(groups)} FSDP groups of {size} ranks")  # fmt: skip
        if shape is None:  # (under comm = "tide" the launcher refuses such a local_world_size)
            status = "skip" if size == 1 else "warn"
            out.append(Row("ranks", "TIDE nodes", status, f"{which}: {source}",
                           [] if size == 1 else [r for g in groups for r in g],
                           "" if size == 1 else "set [tide] local_world_size to a divisor of "
                           "every FSDP group, or 0 (detect)"))  # fmt: skip
            continue
        status = "warn" if source.startswith("ranks of a node are not") else "ok"
        out.append(Row("ranks", "TIDE nodes", status, f"{which}: {shape} ({source})"))
    return out
