"""NCCL's one-sided host API (NCCL >= 2.29) through ctypes, on the library torch loaded.

TIDE's zero-SM cross-node transports (``windows.transport``, ``windows.ring``) put data
straight into a peer's registered memory with ``ncclPutSignal`` and wait with
``ncclWaitSignal``; NCCL moves the bytes with the copy engine between GPUs it reaches by
load/store (NVLink, one node) and by its RMA proxy over the network (IB/RoCE with GPUDirect),
no send/recv kernel on the SMs.
Docs: docs/design/2026-12-02-one-sided.md.

Contract:

- The library is the ``libnccl.so*`` already mapped into this process by torch (found in
  ``/proc/self/maps``; torch binds its own copy, so ``LD_PRELOAD`` cannot replace it),
  loaded lazily: importing this module needs neither CUDA nor NCCL.
- :class:`RmaComm` is a communicator of TIDE's own (``ncclCommInitRank[Config]`` over a
  unique id the caller distributed), beside torch's process groups. Windows are
  ``ncclMemAlloc`` buffers registered with ``ncclCommWindowRegister`` (collective, equal
  size on every rank), allocated as a local step of its own (:meth:`RmaComm.allocate`:
  one rank's out-of-memory is an outcome to exchange before anyone enters the collective
  registration). :class:`RmaWindow` owns its memory; ``tensor`` is a ``uint8`` view of it
  (no copy) that must not outlive the window.
- Signals: NCCL up to 2.30 accepts only signal index 0 and context 0, so every signal of
  one communicator from one peer lands on one counter, and ``wait_signal(peer, count)``
  waits for ``count`` more of them. A communicator must therefore carry ONE stream-ordered
  protocol (TIDE uses one for TIDE-AG, one for TIDE-RS's cross-node phase).
- Every call that returns an error raises :class:`NcclError` naming the call, the result
  and ``ncclGetLastError``.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_VERSION",
    "NcclError",
    "RmaComm",
    "RmaMemory",
    "RmaWindow",
    "library_path",
    "multi_rank_gpu_missing_reason",
    "nccl_version",
    "one_sided_missing_reason",
    "version_text",
]

MIN_VERSION = 22900  # ncclPutSignal / ncclWaitSignal / ncclCommWindowRegister
# NCCL_MULTI_RANK_GPU_ENABLE (ranks of one communicator sharing a GPU) is honoured from 2.30;
# 2.28.9 answers "Duplicate GPU detected" (docs/design/2026-12-02-emulation.md).
MULTI_RANK_GPU_MIN_VERSION = 23000
_CONFIG_VERSION = 23000  # the ncclConfig_t layout below (2.30) and CTA policy ZERO
_UNIQUE_ID_BYTES = 128
_NCCL_INT8 = 0
_WIN_COLL_SYMMETRIC = 0x01
_CTA_POLICY_ZERO = 0x02
_API_MAGIC = 0xCAFEBEEF
_UNDEF_INT = -(2**31)
WINDOW_ALIGNMENT = 4096  # NCCL_WIN_REQUIRED_ALIGNMENT


class NcclError(RuntimeError):
    """An NCCL call of the one-sided transport failed."""


class NcclLibraryAmbiguous(NcclError):
    """Several NCCL libraries are mapped and which one torch calls cannot be told."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * _UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    """``ncclConfig_t`` as of NCCL 2.30 (``ncclConfig_v23000``); NCCL reads a config by the
    version it carries, so a newer library accepts it."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
        ("trafficClass", ctypes.c_int),
        ("commName", ctypes.c_char_p),
        ("collnetEnable", ctypes.c_int),
        ("CTAPolicy", ctypes.c_int),
        ("shrinkShare", ctypes.c_int),
        ("nvlsCTAs", ctypes.c_int),
        ("nChannelsPerNetPeer", ctypes.c_int),
        ("nvlinkCentricSched", ctypes.c_int),
        ("graphUsageMode", ctypes.c_int),
        ("numRmaCtx", ctypes.c_int),
        ("maxP2pPeers", ctypes.c_int),
        ("graphStreamOrdering", ctypes.c_int),
    ]


class _CommProperties(ctypes.Structure):
    """``ncclCommProperties_t`` of ``ncclCommQueryProperties`` (NCCL 2.30's layout,
    ``nccl_device/core.h``); only ``hostRmaSupport`` is read."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("rank", ctypes.c_int),
        ("nRanks", ctypes.c_int),
        ("cudaDev", ctypes.c_int),
        ("nvmlDev", ctypes.c_int),
        ("deviceApiSupport", ctypes.c_bool),
        ("multimemSupport", ctypes.c_bool),
        ("ginType", ctypes.c_int),
        ("nLsaTeams", ctypes.c_int),
        ("hostRmaSupport", ctypes.c_bool),
        ("railedGinType", ctypes.c_int),
    ]


class _WaitDesc(ctypes.Structure):
    _fields_ = [
        ("opCnt", ctypes.c_int),
        ("peer", ctypes.c_int),
        ("sigIdx", ctypes.c_int),
        ("ctx", ctypes.c_int),
    ]


_lib: ctypes.CDLL | None = None
_lib_path: str | None = None


def _mapped_nccl_ranges() -> list[tuple[int, int, str]]:
    """(start, end, path) of every mapping of a ``libnccl.so*`` file in this process."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and "/libnccl.so" in fields[-1] and os.path.exists(fields[-1]):
                    start, end = (int(a, 16) for a in fields[0].split("-"))
                    ranges.append((start, end, fields[-1]))
    except OSError:
        return []
    return ranges


def _symbol_address(handle: ctypes.CDLL) -> int | None:
    try:
        return ctypes.cast(handle.ncclGetVersion, ctypes.c_void_p).value
    except AttributeError:
        return None


def _torch_nccl_symbol() -> int | None:
    """Address of ``ncclGetVersion`` as looked up from ``libtorch_cuda.so`` (the library
    and its dependencies: the NCCL its ``libnccl.so.2`` dependency was bound to), or None
    when libtorch_cuda is not mapped or sees no NCCL."""
    try:
        with open("/proc/self/maps") as maps:
            words = maps.read().split()
    except OSError:
        return None
    path = next((w for w in words if w.endswith("/libtorch_cuda.so")), None)
    if path is None:
        return None
    try:
        handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    return _symbol_address(handle)


def _global_nccl_symbol() -> int | None:
    """Address of ``ncclGetVersion`` in the dynamic linker's global scope (LD_PRELOAD
    first, then libraries loaded RTLD_GLOBAL), or None when none there defines it."""
    return _symbol_address(ctypes.CDLL(None))


def library_path() -> str | None:
    """Path of the NCCL library torch's NCCL calls go to, or None when none is mapped
    (CPU torch, or NCCL linked statically). Loads torch's CUDA library first so its NCCL
    is mapped. With more than one libnccl mapped (a second copy from another wheel, or an
    LD_PRELOAD), the one holding ``ncclGetVersion`` as libtorch_cuda sees it, else as the
    global scope does (measured on the H200, 2026-12-03: with an LD_PRELOAD of another
    build both rules name the preloaded file, and a torch communicator reports its
    version); raises :class:`NcclLibraryAmbiguous` naming them when neither does."""
    try:
        torch._C._cuda_getDeviceCount()  # maps libtorch_cuda and with it libnccl
    except Exception:  # noqa: BLE001 - CPU-only torch: no NCCL
        return None
    ranges = _mapped_nccl_ranges()
    paths = list(dict.fromkeys(path for _, _, path in ranges))
    if len(paths) <= 1:
        return paths[0] if paths else None
    for address in (_torch_nccl_symbol(), _global_nccl_symbol()):
        for start, end, path in ranges:
            if address is not None and start <= address < end:
                return path
    raise NcclLibraryAmbiguous(
        f"{len(paths)} NCCL libraries are mapped ({', '.join(paths)}) and neither "
        "libtorch_cuda nor the global scope resolves ncclGetVersion to one of them: which "
        "one torch calls is unknown. Keep one, or put the one to use first with LD_PRELOAD"
    )


def _library() -> ctypes.CDLL:
    global _lib, _lib_path
    if _lib is None:
        path = library_path()
        if path is None:
            raise NcclError("no NCCL library is loaded in this process (CPU torch build?)")
        _lib, _lib_path = ctypes.CDLL(path), path
        _lib.ncclGetErrorString.restype = ctypes.c_char_p
        _lib.ncclGetLastError.restype = ctypes.c_char_p
    return _lib


def nccl_version() -> int | None:
    """The loaded NCCL's version code (e.g. 23007 for 2.30.7) from ``ncclGetVersion``
    (torch's own report can name the version it was built with instead), or None."""
    try:
        lib = _library()
    except NcclLibraryAmbiguous as exc:
        logger.warning("NCCL version unknown: %s", exc)
        return None
    except NcclError:
        return None
    code = ctypes.c_int(0)
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        return None
    return code.value


def version_text(code: int | None) -> str:
    """``23007`` -> ``"2.30.7"`` (None -> ``"none"``)."""
    if code is None:
        return "none"
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def one_sided_missing_reason() -> str | None:
    """Why this process cannot use NCCL's one-sided API at all, or None (whether the
    job's nodes support host RMA is known only on a communicator: ``host_rma_supported``)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    code = nccl_version()
    if code is None:
        return "no NCCL library is loaded in this process"
    if code < MIN_VERSION:
        return (
            f"NCCL {version_text(code)} is loaded; the one-sided API needs NCCL >= 2.29 "
            "(torch 2.12/2.13 bundle 2.29.7; under torch 2.11 see docs/guide/install.md, NCCL)"
        )
    lib = _library()
    missing = [
        name
        for name in ("ncclPutSignal", "ncclWaitSignal", "ncclCommWindowRegister", "ncclMemAlloc")
        if not hasattr(lib, name)
    ]
    if missing:
        return f"NCCL {version_text(code)} at {_lib_path} lacks {missing}"
    return None


def _check(result: int, what: str, comm: ctypes.c_void_p | None = None) -> None:
    if result == 0:
        return
    lib = _library()
    text = lib.ncclGetErrorString(result)
    last = lib.ncclGetLastError(comm if comm is not None else None)
    raise NcclError(
        f"{what} failed: NCCL error {result} ({text.decode() if text else '?'})"
        + (f": {last.decode()}" if last else "")
    )


def new_unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` (128 bytes) for :meth:`RmaComm.create` on every rank."""
    uid = _UniqueId()
    _check(_library().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    # all 128 bytes: a c_char array field reads only up to its first NUL byte
    return ctypes.string_at(ctypes.addressof(uid), _UNIQUE_ID_BYTES)


class _CudaArray:
    """``__cuda_array_interface__`` of raw device memory, so ``torch.as_tensor`` wraps it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }  # fmt: skip


@dataclass
class RmaMemory:
    """``nbytes`` of ``ncclMemAlloc`` memory at ``ptr``, not registered yet."""

    ptr: int
    nbytes: int


@dataclass
class RmaWindow:
    """A registered window: ``nbytes`` of ``ncclMemAlloc`` memory on ``device``. ``tensor``
    (``uint8``) views it; the comm that registered it frees it in :meth:`RmaComm.destroy`."""

    ptr: int
    nbytes: int
    handle: ctypes.c_void_p
    tensor: torch.Tensor


class RmaComm:
    """A TIDE-owned NCCL communicator for one-sided puts (see the module contract)."""

    def __init__(self, comm: ctypes.c_void_p, rank: int, size: int, device: torch.device):
        self.comm, self.rank, self.size, self.device = comm, rank, size, device
        self.windows: list[RmaWindow] = []

    @classmethod
    def create(cls, unique_id: bytes, rank: int, size: int, device: torch.device) -> RmaComm:
        """Collective over the ``size`` ranks that got ``unique_id`` (blocking; run it
        bounded, e.g. in ``setup_steps``). CTA policy ZERO where the library knows it."""
        lib = _library()
        if len(unique_id) != _UNIQUE_ID_BYTES:
            raise ValueError(f"an ncclUniqueId has {_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, _UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            if (nccl_version() or 0) >= _CONFIG_VERSION:
                config = _Config(
                    size=ctypes.sizeof(_Config), magic=_API_MAGIC, version=_CONFIG_VERSION,
                    **{name: _UNDEF_INT for name, kind in _Config._fields_[3:]
                       if kind is ctypes.c_int},
                )  # fmt: skip
                config.blocking = 1
                config.CTAPolicy = _CTA_POLICY_ZERO
                config.numRmaCtx = 1
                result = lib.ncclCommInitRankConfig(
                    ctypes.byref(comm), size, uid, rank, ctypes.byref(config)
                )
                _check(result, "ncclCommInitRankConfig(CTA policy ZERO)")
            else:
                _check(lib.ncclCommInitRank(ctypes.byref(comm), size, uid, rank),
                       "ncclCommInitRank")  # fmt: skip
        return cls(comm, rank, size, device)

    def host_rma_supported(self) -> bool | None:
        """``hostRmaSupport`` of ``ncclCommQueryProperties``; None where the library has
        no such call (then a NULL window after registration is the sign of no support)."""
        lib = _library()
        if not hasattr(lib, "ncclCommQueryProperties"):
            return None
        props = _CommProperties(size=ctypes.sizeof(_CommProperties), magic=_API_MAGIC,
                                version=_CONFIG_VERSION)  # fmt: skip
        _check(lib.ncclCommQueryProperties(self.comm, ctypes.byref(props)),
               "ncclCommQueryProperties", self.comm)  # fmt: skip
        # The struct's layout is NCCL 2.30's (not a documented ABI): the fields NCCL fills
        # that TIDE knows must read back right, or hostRmaSupport cannot be trusted.
        if (props.rank, props.nRanks) != (self.rank, self.size):
            raise NcclError(
                f"ncclCommProperties_t of NCCL {version_text(nccl_version())} does not have "
                f"the layout TIDE reads (rank {props.rank} of {props.nRanks} read back for "
                f"{self.rank} of {self.size}); the one-sided path is not used"
            )
        return bool(props.hostRmaSupport)

    def allocate(self, nbytes: int) -> RmaMemory:
        """``nbytes`` (rounded up to 4 KiB) of ``ncclMemAlloc`` memory on this comm's device.
        Local: it may fail on one rank alone (out of memory), so callers exchange its outcome
        before the collective :meth:`register`; :meth:`free` releases it unregistered."""
        lib = _library()
        nbytes = max(WINDOW_ALIGNMENT, -(-nbytes // WINDOW_ALIGNMENT) * WINDOW_ALIGNMENT)
        ptr = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _check(lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)),
                   f"ncclMemAlloc({nbytes} B)")  # fmt: skip
        return RmaMemory(ptr.value, nbytes)

    def free(self, memory: RmaMemory) -> None:
        """Free memory from :meth:`allocate` that was not registered."""
        _library().ncclMemFree(ctypes.c_void_p(memory.ptr))

    def register(self, memory: RmaMemory | int) -> RmaWindow:
        """Register ``memory`` (from :meth:`allocate`; a byte count: allocate it here first)
        as a symmetric window. Collective: every rank, same size, same order. The window owns
        the memory from here on (:meth:`destroy` / :meth:`abort` free it). Raises
        :class:`NcclError` when NCCL returns a NULL window (it does so, with success, where
        the communicator has no host RMA), after freeing the memory."""
        if isinstance(memory, int):
            memory = self.allocate(memory)
        lib = _library()
        handle = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            try:
                _check(lib.ncclCommWindowRegister(
                    self.comm, ctypes.c_void_p(memory.ptr), ctypes.c_size_t(memory.nbytes),
                    ctypes.byref(handle), _WIN_COLL_SYMMETRIC,
                ), "ncclCommWindowRegister", self.comm)  # fmt: skip
            except NcclError:
                self.free(memory)
                raise
        if not handle.value:
            self.free(memory)
            raise NcclError(
                "ncclCommWindowRegister returned a NULL window: this communicator has no "
                "host RMA between its ranks"
            )
        tensor = torch.as_tensor(_CudaArray(memory.ptr, memory.nbytes), device=self.device)
        window = RmaWindow(memory.ptr, memory.nbytes, handle, tensor)
        self.windows.append(window)
        return window

    def put_signal(
        self, src: torch.Tensor, peer: int, window: RmaWindow, dst_offset: int,
        stream: torch.cuda.Stream,
    ) -> None:  # fmt: skip
        """Enqueue on ``stream``: put ``src``'s bytes (contiguous, inside one of this
        comm's windows) into ``peer``'s copy of ``window`` at byte ``dst_offset``, then
        one signal to ``peer``. The peer's signal becomes visible after the data."""
        nbytes = src.numel() * src.element_size()
        if dst_offset + nbytes > window.nbytes:
            raise ValueError(
                f"put of {nbytes} B at {dst_offset} overflows a {window.nbytes} B window"
            )
        _check(_library().ncclPutSignal(
            ctypes.c_void_p(src.data_ptr()), ctypes.c_size_t(nbytes), _NCCL_INT8, peer,
            window.handle, ctypes.c_size_t(dst_offset), 0, 0, 0, self.comm,
            ctypes.c_void_p(stream.cuda_stream),
        ), f"ncclPutSignal({nbytes} B to rank {peer})", self.comm)  # fmt: skip

    def signal(self, peer: int, stream: torch.cuda.Stream) -> None:
        """Enqueue on ``stream`` one signal to ``peer`` with no data (``ncclSignal``); it is
        counted with the puts' signals of this communicator from this rank."""
        _check(_library().ncclSignal(peer, 0, 0, 0, self.comm,
                                     ctypes.c_void_p(stream.cuda_stream)),
               f"ncclSignal(to rank {peer})", self.comm)  # fmt: skip

    def wait_signal(self, peer: int, count: int, stream: torch.cuda.Stream) -> None:
        """Enqueue on ``stream`` a wait for ``count`` more signals from ``peer``."""
        desc = _WaitDesc(opCnt=count, peer=peer, sigIdx=0, ctx=0)
        _check(_library().ncclWaitSignal(1, ctypes.byref(desc), self.comm,
                                         ctypes.c_void_p(stream.cuda_stream)),
               f"ncclWaitSignal({count} from rank {peer})", self.comm)  # fmt: skip

    def destroy(self) -> None:
        """Deregister and free every window, then finalize and destroy the communicator.
        Call after the device finished every put/wait of this comm on every rank."""
        if not self.comm:
            return
        lib = _library()
        for window in self.windows:
            lib.ncclCommWindowDeregister(self.comm, window.handle)
            lib.ncclMemFree(ctypes.c_void_p(window.ptr))
        self.windows.clear()
        lib.ncclCommFinalize(self.comm)
        lib.ncclCommDestroy(self.comm)
        self.comm = ctypes.c_void_p()

    def abort(self) -> None:
        """End the communicator without waiting for peers (a failed set-up), then free
        its windows' memory (the abort released their registrations)."""
        if self.comm:
            lib = _library()
            lib.ncclCommAbort(self.comm)
            for window in self.windows:
                lib.ncclMemFree(ctypes.c_void_p(window.ptr))
            self.windows.clear()
            self.comm = ctypes.c_void_p()


def multi_rank_gpu_missing_reason() -> str | None:
    """Why ranks of one NCCL communicator cannot share a GPU in this process's NCCL
    (``NCCL_MULTI_RANK_GPU_ENABLE=1``: the one-node emulation, docs/design/2026-12-02-emulation.md),
    or None when they can."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    code = nccl_version()
    if code is None:
        return "no NCCL library is loaded in this process"
    if code < MULTI_RANK_GPU_MIN_VERSION:
        return (
            f"NCCL {version_text(code)} ({library_path()}) refuses two ranks on one GPU "
            "(NCCL_MULTI_RANK_GPU_ENABLE needs >= 2.30); scripts/gpu/nccl_swap.sh runs a "
            "command with a newer build in torch's place"
        )
    return None
