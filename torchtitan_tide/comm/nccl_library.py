"""Which NCCL library this process runs, and its version, read from the library itself.

``torch.cuda.nccl.version()`` reports the version torch was built against; after the
library file in torch's place is replaced (docs/2026-12-02-emulation.md: NCCL 2.30.7 over
the bundled 2.28.9), it can still print the old one. The library mapped into the process
answers for itself: :func:`loaded_library` finds it in ``/proc/self/maps`` and
:func:`library_version` calls its ``ncclGetVersion``.

Standard library only at import (ctypes); :func:`torch_nccl` imports torch.
"""

from __future__ import annotations

import ctypes
import os

__all__ = [
    "MULTI_RANK_GPU_MIN",
    "bundled_library_path",
    "decode_version",
    "library_version",
    "loaded_library",
    "multi_rank_gpu_unsupported",
    "torch_nccl",
]

# NCCL_MULTI_RANK_GPU_ENABLE (several ranks of one communicator on one GPU) is honoured
# from NCCL 2.30 on; 2.28.9 answers "Duplicate GPU detected" (measured, docs/2026-12-02-emulation.md).
MULTI_RANK_GPU_MIN = (2, 30, 0)
_LIBRARY_NAME = "libnccl.so"


def decode_version(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s integer as (major, minor, patch): nccl.h's ``NCCL_VERSION``,
    ``X*1000 + Y*100 + Z`` up to 2.8, ``X*10000 + Y*100 + Z`` from 2.9 on."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def loaded_library(maps: str | None = None) -> str | None:
    """Path of the ``libnccl.so*`` mapped into this process (``maps``: the text of
    ``/proc/self/maps``, read when None); None when no NCCL is mapped."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return None
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith(_LIBRARY_NAME):
            return fields[5].removesuffix(" (deleted)")
    return None


def bundled_library_path() -> str | None:
    """The ``libnccl.so.2`` of the ``nvidia-nccl`` wheel torch depends on (the file torch
    loads through its RPATH); None where that package is not installed."""
    try:
        import nvidia.nccl
    except ImportError:
        return None
    for folder in nvidia.nccl.__path__:
        path = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.isfile(path):
            return path
    return None


def library_version(path: str) -> tuple[int, int, int]:
    """The version the NCCL library at ``path`` reports (``ncclGetVersion``). Loading an
    already mapped library returns the mapped one.

    Raises:
        OSError: ``path`` cannot be loaded; RuntimeError: ``ncclGetVersion`` failed.
    """
    lib = ctypes.CDLL(path)
    code = ctypes.c_int(0)
    result = lib.ncclGetVersion(ctypes.byref(code))
    if result != 0:
        raise RuntimeError(f"ncclGetVersion of {path} returned ncclResult {result}")
    return decode_version(code.value)


def torch_nccl() -> tuple[str, tuple[int, int, int]] | None:
    """(path, version) of the NCCL library torch runs in this process (imports torch;
    where ``/proc/self/maps`` shows none yet, the nvidia-nccl wheel's file); None without
    CUDA or NCCL."""
    import torch

    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        return None
    path = loaded_library() or bundled_library_path()
    if path is None:
        return None
    return path, library_version(path)


def multi_rank_gpu_unsupported() -> str | None:
    """Why several ranks of one NCCL communicator cannot share a GPU in this process's
    NCCL (``NCCL_MULTI_RANK_GPU_ENABLE=1`` needs :data:`MULTI_RANK_GPU_MIN`); None when
    they can."""
    found = torch_nccl()
    if found is None:
        return "no CUDA or no NCCL in this torch"
    path, version = found
    if version < MULTI_RANK_GPU_MIN:
        have, need = ".".join(map(str, version)), ".".join(map(str, MULTI_RANK_GPU_MIN[:2]))
        return (
            f"NCCL {have} ({path}) refuses two ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE "
            f"needs >= {need}); scripts/gpu/nccl_swap.sh swaps a newer build in "
            "(docs/2026-12-02-emulation.md)"
        )
    return None
