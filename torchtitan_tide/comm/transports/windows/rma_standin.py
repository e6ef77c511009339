"""A CPU stand-in of NCCL's one-sided host calls (``nccl_rma.RmaComm``) for several processes.

Where no GPU exists (CI, the CPU preflight) TIDE's window transports run their real code
against this class: the same methods as :class:`~.nccl_rma.RmaComm` (``register``,
``put_signal``, ``signal``, ``wait_signal``, ``destroy``, ``abort``), the same rules NCCL
enforces (a put reads a registered window of its own rank, fits the peer's window; signal
index and context 0), and the semantics the one-sided protocol relies on, as NCCL documents
and implements them for its copy-engine path (docs/design/2026-12-04-windows.md):

- a put's data is visible to the peer before the signal that follows it;
- signals from one peer are counted, cumulatively: ``wait_signal(peer, count)`` returns once
  ``count`` more signals than all earlier waits on ``peer`` asked for have arrived;
- a put has read its source when the call returns (NCCL: once the put completed on its stream).

Memory: every window and the signal counters are files under the communicator's folder
(``/dev/shm`` by default), mapped by every rank of the communicator, so the processes need not
be forked from one parent. Signal cell ``[receiver][sender]`` has one writer (the sender).
On CPU every call runs on the host when it is made; ``stream`` arguments are accepted and
ignored. A wait spins with a deadline (:class:`StandinTimeout` names the peer).

Collective calls block as NCCL's do: :meth:`StandinRma.create` and :meth:`StandinRma.register`
return once every rank of the communicator made the same call (a file per rank and call in
the folder), or raise once a rank aborted the communicator or gave its id up
(:func:`abandon_unique_id`: an ``aborted`` file), or the folder is gone. :data:`LEDGER` counts
what this process made and ended (ids, communicators, allocations; tests assert nothing leaks).

:class:`Faults` breaks one of the semantics on purpose (a signal that overtakes its data, a
source read after the put returned), so checks of those assumptions can be shown to fail.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass

import torch

from .nccl_rma import RmaMemory, RmaWindow

__all__ = [
    "LEDGER", "Faults", "StandinError", "StandinRma", "StandinTimeout", "abandon_unique_id",
    "new_unique_id",
]  # fmt: skip

_UNIQUE_ID_BYTES = 128  # as ncclUniqueId: the folder's path, NUL-padded
_POLL_S = 0.0002
_MAP_TIMEOUT_S = 60.0
_ABORTED = "aborted"
# What this process made and ended: "ids" / "ids_removed" (folders), "comms" / "comms_ended",
# "allocations" / "frees" (window memory, registered or not).
LEDGER: collections.Counter = collections.Counter()
_REMOVING = threading.Lock()  # an abandoned step's thread and the main thread may both remove


def _remove(folder: str) -> None:
    """Delete a communicator's folder (once: counted in :data:`LEDGER`)."""
    with _REMOVING:
        if not os.path.isdir(folder):
            return
        for _ in range(100):  # a peer may add a file (a join, the abort mark) while it goes
            shutil.rmtree(folder, ignore_errors=True)
            if not os.path.isdir(folder):
                break
            time.sleep(0.01)
        LEDGER["ids_removed"] += 1


class StandinError(RuntimeError):
    """A call the real NCCL would refuse (the message says which rule)."""


class StandinTimeout(StandinError):
    """A wait for a peer's signals passed its deadline."""


@dataclass(frozen=True)
class Faults:
    """Deliberate violations of what the protocol relies on (checks must catch them).

    ``signal_before_data``: each put raises the peer's signal, sleeps ``delay_s``, then writes
    the data. ``late_source_read``: each put returns at once and reads its source ``delay_s``
    later (from a thread), so a source rewritten right after the put is what the peer gets."""

    signal_before_data: bool = False
    late_source_read: bool = False
    delay_s: float = 0.05


def new_unique_id(root: str | None = None) -> bytes:
    """A fresh communicator id: a new folder under ``root`` (default ``/dev/shm``, else the
    temporary folder), as 128 bytes, handed to every rank like an ``ncclUniqueId``."""
    base = root or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    if base is None:
        import tempfile

        base = tempfile.gettempdir()
    folder = os.path.join(base, f"tide-rma-{secrets.token_hex(8)}")
    raw = folder.encode()
    if len(raw) >= _UNIQUE_ID_BYTES:
        raise StandinError(f"stand-in folder path too long: {folder}")
    os.makedirs(folder)
    LEDGER["ids"] += 1
    return raw.ljust(_UNIQUE_ID_BYTES, b"\0")


def _folder_of(unique_id: bytes) -> str:
    return unique_id.rstrip(b"\0").decode()


def abandon_unique_id(unique_id: bytes) -> None:
    """The id's maker gives it up (a communicator of it failed somewhere): ranks blocked in
    a collective call of it raise at once, and its folder goes."""
    folder = _folder_of(unique_id)
    with contextlib.suppress(OSError), open(os.path.join(folder, _ABORTED), "w") as f:
        f.write("abandoned")
    _remove(folder)


def _join(folder: str, call: str, rank: int, size: int, timeout_s: float) -> None:
    """Block until every rank of the communicator in ``folder`` made ``call`` (as NCCL's
    collective calls do); raise once the communicator was aborted or its folder is gone."""
    try:
        with open(os.path.join(folder, f"join.{call}.{rank}"), "w"):
            pass
    except FileNotFoundError:
        raise StandinError(f"{call}: the communicator's folder {folder} is gone (aborted)") from None
    deadline = time.monotonic() + timeout_s
    paths = [os.path.join(folder, f"join.{call}.{r}") for r in range(size)]
    while not all(os.path.exists(p) for p in paths):
        if os.path.exists(os.path.join(folder, _ABORTED)) or not os.path.isdir(folder):
            raise StandinError(f"{call}: a rank aborted the communicator")
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
            raise StandinTimeout(f"{call}: ranks {missing} did not join within {timeout_s:.0f} s")
        time.sleep(0.001)


def _map(path: str, nbytes: int, create: bool) -> torch.Tensor:
    if create:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    else:
        deadline = time.monotonic() + _MAP_TIMEOUT_S
        while not os.path.exists(path) or os.path.getsize(path) < nbytes:
            if time.monotonic() > deadline:
                raise StandinTimeout(f"stand-in file {path} did not appear (a peer did not register)")
            time.sleep(0.001)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class StandinRma:
    """One rank of a stand-in communicator of ``size`` ranks (see the module docstring)."""

    def __init__(
        self, folder: str, rank: int, size: int, faults: Faults | None = None,
        timeout_s: float = 120.0,
    ) -> None:  # fmt: skip
        self.folder, self.rank, self.size = folder, rank, size
        self.device = torch.device("cpu")
        self.faults = faults or Faults()
        self.timeout_s = timeout_s
        self.windows: list[RmaWindow] = []
        self._peer_windows: dict[tuple[int, int], torch.Tensor] = {}
        self._expected = [0] * size  # cumulative signals waited for, per peer
        self._sent = [0] * size  # cumulative signals sent, per peer
        self._signals = _map(self._signal_path(rank), 8 * size, create=True).view(torch.int64)
        self._peer_signals: dict[int, torch.Tensor] = {}
        self._allocated: dict[int, tuple[torch.Tensor, int]] = {}  # ptr -> (memory, file)
        self._files = 0  # window files made: every rank allocates in the same order
        self._threads: list[threading.Thread] = []
        self.closed = False

    @classmethod
    def create(
        cls, unique_id: bytes, rank: int, size: int, device: torch.device | None = None,
        faults: Faults | None = None,
    ) -> StandinRma:  # fmt: skip
        """As ``RmaComm.create``: every rank of the communicator passes the same id."""
        del device  # CPU only
        folder = _folder_of(unique_id)
        if not os.path.isdir(folder):
            raise StandinError(f"stand-in communicator folder {folder} does not exist")
        comm = cls(folder, rank, size, faults)
        LEDGER["comms"] += 1
        try:
            _join(folder, "create", rank, size, comm.timeout_s)
        except BaseException:
            comm.abort()
            raise
        return comm

    def _signal_path(self, rank: int) -> str:
        return os.path.join(self.folder, f"signals.{rank}")

    def host_rma_supported(self) -> bool:
        return True

    def allocate(self, nbytes: int) -> RmaMemory:
        """This rank's next window's memory (a file of the communicator's folder; a peer
        finds it by the allocation's index: every rank allocates its windows in one order)."""
        index = self._files
        self._files += 1
        path = os.path.join(self.folder, f"window{index}.{self.rank}")
        tensor = _map(path, nbytes, create=True)
        self._allocated[tensor.data_ptr()] = (tensor, index)
        LEDGER["allocations"] += 1
        return RmaMemory(tensor.data_ptr(), nbytes)

    def free(self, memory: RmaMemory) -> None:
        """Free memory from :meth:`allocate` that was not registered."""
        if self._allocated.pop(memory.ptr, None) is not None:
            LEDGER["frees"] += 1

    def register(self, memory: RmaMemory | int) -> RmaWindow:
        """Register memory from :meth:`allocate` (or allocate ``nbytes`` first) as the next
        window (collective by convention: every rank in the same order and size)."""
        if isinstance(memory, int):
            memory = self.allocate(memory)
        index = self._allocated[memory.ptr][1]
        try:
            _join(self.folder, f"register{index}", self.rank, self.size, self.timeout_s)
        except BaseException:
            self.free(memory)  # as NCCL's registration frees on failure (nccl_rma)
            raise
        tensor, _ = self._allocated.pop(memory.ptr)
        window = RmaWindow(memory.ptr, memory.nbytes, ctypes.c_void_p(index), tensor)
        self.windows.append(window)
        return window

    def _peer_window(self, window: RmaWindow, peer: int) -> torch.Tensor:
        index = window.handle.value or 0
        key = (index, peer)
        if key not in self._peer_windows:
            path = os.path.join(self.folder, f"window{index}.{peer}")
            self._peer_windows[key] = _map(path, window.nbytes, create=False)
        return self._peer_windows[key]

    def _peer_signal_cells(self, peer: int) -> torch.Tensor:
        if peer not in self._peer_signals:
            cells = _map(self._signal_path(peer), 8 * self.size, create=False)
            self._peer_signals[peer] = cells.view(torch.int64)
        return self._peer_signals[peer]

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise StandinError(f"peer {peer} is not another rank of this {self.size}-rank comm")

    def _own_window_of(self, src: torch.Tensor) -> RmaWindow:
        start, nbytes = src.data_ptr(), src.numel() * src.element_size()
        for window in self.windows:
            if window.ptr <= start and start + nbytes <= window.ptr + window.nbytes:
                return window
        raise StandinError(
            "ncclPutSignal: srcWinHost is not in a valid symmetric window (a put must read "
            "a registered window of its own rank)"
        )

    def _raise_signal(self, peer: int) -> None:
        self._sent[peer] += 1
        self._peer_signal_cells(peer)[self.rank] = self._sent[peer]

    def put_signal(
        self, src: torch.Tensor, peer: int, window: RmaWindow, dst_offset: int,
        stream: object = None,
    ) -> None:  # fmt: skip
        """Write ``src``'s bytes into ``peer``'s copy of ``window`` at ``dst_offset``, then one
        signal to ``peer``."""
        del stream
        self._check_peer(peer)
        if not src.is_contiguous():
            raise StandinError("a put reads a contiguous source")
        self._own_window_of(src)
        nbytes = src.numel() * src.element_size()
        if dst_offset < 0 or dst_offset + nbytes > window.nbytes:
            raise StandinError(f"put of {nbytes} B at {dst_offset} overflows a {window.nbytes} B window")
        dst = self._peer_window(window, peer).narrow(0, dst_offset, nbytes)
        data = src.reshape(-1).view(torch.uint8)
        if self.faults.late_source_read:
            thread = threading.Thread(target=self._late_put, args=(dst, data, peer), daemon=True)
            self._threads.append(thread)
            thread.start()
            return
        if self.faults.signal_before_data:
            self._raise_signal(peer)
            time.sleep(self.faults.delay_s)
            dst.copy_(data)
            return
        dst.copy_(data)
        self._raise_signal(peer)

    def _late_put(self, dst: torch.Tensor, data: torch.Tensor, peer: int) -> None:
        time.sleep(self.faults.delay_s)
        dst.copy_(data)
        self._raise_signal(peer)

    def signal(self, peer: int, stream: object = None) -> None:
        """One signal to ``peer``, no data (``ncclSignal``)."""
        del stream
        self._check_peer(peer)
        self._raise_signal(peer)

    def wait_signal(self, peer: int, count: int, stream: object = None) -> None:
        """Return once ``count`` more signals from ``peer`` have arrived (cumulative)."""
        del stream
        self._check_peer(peer)
        if count <= 0:
            raise StandinError(f"ncclWaitSignal: opCnt {count} must be > 0")
        self._expected[peer] += count
        target = self._expected[peer]
        deadline = time.monotonic() + self.timeout_s
        while int(self._signals[peer].item()) < target:
            if time.monotonic() > deadline:
                raise StandinTimeout(
                    f"stand-in wait for signal {target} from rank {peer} passed "
                    f"{self.timeout_s:.0f} s (it sent {int(self._signals[peer].item())})"
                )
            time.sleep(_POLL_S)

    def signals_from(self, peer: int) -> int:
        """Signals received from ``peer`` so far (tests and checks read it)."""
        return int(self._signals[peer].item())

    def destroy(self) -> None:
        """Collective, as ``ncclCommFinalize``: once every rank of the communicator got here
        (each one's last signals, e.g. in-place credits, sent), drop the mappings and free
        what this rank holds; rank 0 unlinks the communicator's files (a rank that mapped
        them keeps its mappings valid). A peer that aborted or never comes ends the wait."""
        if not self.closed:
            with contextlib.suppress(StandinError):
                _join(self.folder, "destroy", self.rank, self.size, self.timeout_s)
        self._end(aborted=False)

    def abort(self) -> None:
        """As :meth:`destroy`, and every rank blocked in a collective call of this
        communicator raises at once (the ``aborted`` file)."""
        self._end(aborted=True)

    def _end(self, aborted: bool) -> None:
        if self.closed:
            return
        for thread in self._threads:
            thread.join(self.faults.delay_s * 10 + 1)
        self._threads.clear()
        self._peer_windows.clear()
        self._peer_signals.clear()
        LEDGER["frees"] += len(self._allocated) + len(self.windows)
        self._allocated.clear()
        self.windows.clear()
        self.closed = True
        LEDGER["comms_ended"] += 1
        if aborted and os.path.isdir(self.folder):
            path = os.path.join(self.folder, _ABORTED)
            with contextlib.suppress(OSError), open(path, "w") as f:
                f.write(f"rank {self.rank}")
        if self.rank == 0:
            self.remove_folder()

    def remove_folder(self) -> None:
        """Delete the communicator's files."""
        _remove(self.folder)
