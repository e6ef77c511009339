"""Exchange the memory of two storages, every view following: how TIDE-AG in place points a
parameter's unsharded storage at window memory (``transport.py``;
docs/design/2026-12-04-windows.md).

Two backends:

- ``native``: ``torch.UntypedStorage._swap_data_ptr_`` (torch 2.12+; 2.11, the GPU machine's,
  lacks it). c10's ``StorageImpl::swap_data_ptr`` materializes a lazy (copy-on-write) storage
  first, then exchanges the data pointer, byte size, ``resizable_``, the allocator and the
  data-pointer check flags.
- ``ctypes``: only where torch lacks the native swap AND ``[tide] ag_storage_swap =
  "ctypes"`` asks for it (``install`` decides; ``swap_backend(..., allow_ctypes=True)``).
  The same exchange done on the two ``c10::StorageImpl`` objects at ``storage._cdata``:
  their ``DataPtr`` (address, owning context and deleter, device: 32 bytes), byte size (a
  plain ``SymInt``: 8 bytes), ``resizable_`` flag and ``allocator_`` pointer. The DataPtr
  carries its own deleter, so each storage frees what it holds when it dies, as after the
  native swap; ``resizable_`` and the allocator move with the memory, so a ``resize_`` of a
  storage pointed at window memory raises as after the native swap instead of silently
  detaching it. The offsets are not a documented ABI: they are found once per process by
  probing storages of known address, size, device, ``resizable()`` and allocator (every field
  must sit where c10's layout puts it, one offset for all probes), then checked on the device
  it is asked for by a trial swap read back through the public API and swapped back. Every
  later swap checks both storages again (address, size, device, flags) and refuses storages
  with state it cannot move: a lazily cloned (copy-on-write) storage, a materializer, data
  pointer checks, a heap-allocated (symbolic) size, memory received from another process.
  The three ``memmove`` calls of an exchange run with Python's signal handlers held off
  (``_signals_held``): a Ctrl-C or a launcher's SIGTERM handler is delivered after the
  exchange, never between its halves (which would leave two owners of one allocation).

Not thread-safe against a concurrent reader of the two storages (as the native swap): TIDE
swaps on the thread that runs the all-gather or the reshard.
"""

from __future__ import annotations

import _signal  # signal's C module: signal.getsignal's enum conversion costs ~1 us a call
import contextlib
import ctypes
import functools
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["swap_backend", "swap_missing_reason", "swap_storage_pairs", "swap_storages"]

_DATA_PTR_BYTES = 32  # c10::DataPtr: data_, ctx_ (deleter, context), Device (+ padding)
_SPAN = _DATA_PTR_BYTES + 8  # and size_bytes_ (SymInt)
_SCAN_WORDS = 8  # data_ptr_ sits after intrusive_ptr_target's vtable and refcounts
_DEVICE_TYPE_CODES = {"cpu": 0, "cuda": 1}  # c10::DeviceType
# The bools after size_bytes_ (c10/core/StorageImpl.h): size_bytes_is_heap_allocated_,
# resizable_, received_cuda_, has_mutable_data_ptr_check_, throw_on_mutable_data_ptr_,
# throw_on_immutable_data_ptr_, warn_deprecated_on_mutable_data_ptr_.
_HEAP, _RESIZABLE, _RECEIVED_CUDA, _DATA_PTR_CHECK = 0, 1, 2, 3
_FLAG_BYTES = 7
_ALLOCATOR_SCAN_WORDS = 4  # allocator_ lies within these words after the flags


@dataclass(frozen=True)
class _Layout:
    """Byte offsets in a ``StorageImpl``: the DataPtr (size after it, flags after that) and
    the allocator pointer."""

    data_ptr: int
    allocator: int

    @property
    def flags(self) -> int:
        return self.data_ptr + _SPAN


def _native_available() -> bool:
    """Whether this torch has the native swap (tests replace this to take the ctypes path)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def _construct_missing() -> str | None:
    """Why this torch cannot build a storage over memory it does not own (what the window's
    arena ranges are wrapped in, whichever swap runs); None: it can."""
    if hasattr(torch._C, "_construct_storage_from_data_pointer"):
        return None
    return f"torch {torch.__version__} lacks _construct_storage_from_data_pointer"


def _word(address: int, offset: int) -> int:
    return int.from_bytes(ctypes.string_at(address + offset, 8), "little")


def _byte(address: int, offset: int) -> int:
    return ctypes.string_at(address + offset, 1)[0]


def _fields_mismatch(storage: torch.UntypedStorage, layout: _Layout) -> str | None:
    """What in ``storage``'s StorageImpl is not where ``layout`` puts it (or holds state the
    ctypes swap cannot move); None when all is as the public API says."""
    impl, at = storage._cdata, layout.data_ptr
    # The flags first: ``data_ptr()`` below would materialize a lazily cloned storage.
    flags = ctypes.string_at(impl + layout.flags, _FLAG_BYTES)
    if flags[_HEAP] or flags[_RECEIVED_CUDA] or any(flags[_DATA_PTR_CHECK:]):
        return ("it has state the ctypes swap cannot move (a lazily cloned / copy-on-write "
                "storage, a materializer or data pointer checks, a symbolic size, or memory "
                "received from another process)")  # fmt: skip
    device = storage.device
    if device.type not in _DEVICE_TYPE_CODES:
        return f"a storage on {device.type}"
    index = (device.index if device.index is not None else -1) & 0xFF
    if _word(impl, at) != storage.data_ptr() or _word(impl, at + _DATA_PTR_BYTES) != storage.nbytes():
        return "its address or size is not at the probed offset"
    if (_byte(impl, at + 24), _byte(impl, at + 25)) != (_DEVICE_TYPE_CODES[device.type], index):
        return "its device is not at the probed offset"
    if flags[_RESIZABLE] != int(storage.resizable()):
        return "its resizable flag is not at the probed offset"
    if storage.resizable() and not _word(impl, layout.allocator):
        return "it is resizable but no allocator sits at the probed offset"
    return None


def _data_ptr_offsets(storage: torch.UntypedStorage) -> set[int]:
    """The offsets in ``storage``'s StorageImpl where its DataPtr could start: the address,
    the device (type, index), the size and the flags ``size_bytes_is_heap_allocated_`` (0)
    and ``resizable_`` after it all sit where c10's layout puts them."""
    impl, address, nbytes = storage._cdata, storage.data_ptr(), storage.nbytes()
    device = storage.device
    index = (device.index if device.index is not None else -1) & 0xFF
    found = set()
    for offset in range(0, 8 * _SCAN_WORDS, 8):
        if (_word(impl, offset) == address
                and _byte(impl, offset + 24) == _DEVICE_TYPE_CODES[device.type]
                and _byte(impl, offset + 25) == index
                and _word(impl, offset + _DATA_PTR_BYTES) == nbytes
                and _byte(impl, offset + _SPAN + _HEAP) == 0
                and _byte(impl, offset + _SPAN + _RESIZABLE) == int(storage.resizable())):  # fmt: skip
            found.add(offset)
    return found


@functools.cache
def _probe_layout() -> tuple[_Layout | None, str]:
    """(the StorageImpl layout, '') or (None, why): probed on CPU storages of distinct sizes,
    resizable (the CPU allocator) and not (``_construct_storage_from_data_pointer``: no
    allocator). The allocator is the one word after the flags that every resizable probe
    holds alike (non-zero) and every constructed probe holds as 0."""
    why = _construct_missing()
    if why is not None:
        return None, why
    owning = [torch.UntypedStorage(1000 + 24 * k) for k in range(3)]
    constructed = [torch._C._construct_storage_from_data_pointer(s.data_ptr(), s.device, 40 + k)
                   for k, s in enumerate(owning)]  # fmt: skip
    common: set[int] | None = None
    for storage in owning + constructed:
        found = _data_ptr_offsets(storage)
        common = found if common is None else common & found
    if not common or len(common) != 1:
        return None, (f"torch {torch.__version__}: no single StorageImpl offset holds the "
                      f"DataPtr and size of every probe storage (candidates {sorted(common or ())})")  # fmt: skip
    data_ptr = common.pop()
    first = -(-(data_ptr + _SPAN + _FLAG_BYTES) // 8) * 8
    allocators = [
        at for at in range(first, first + 8 * _ALLOCATOR_SCAN_WORDS, 8)
        if len({_word(s._cdata, at) for s in owning}) == 1 and _word(owning[0]._cdata, at)
        and not any(_word(s._cdata, at) for s in constructed)
    ]  # fmt: skip
    if len(allocators) != 1:
        return None, (f"torch {torch.__version__}: no single StorageImpl offset after the flags "
                      f"holds the allocator of every probe storage (candidates {allocators})")  # fmt: skip
    layout = _Layout(data_ptr, allocators[0])
    for storage in owning + constructed:
        if (bad := _fields_mismatch(storage, layout)) is not None:
            return None, f"torch {torch.__version__}: a probe storage does not check out: {bad}"
    return layout, ""


_MAIN_THREAD_HANDLED: tuple[int, ...] = ()


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Python's signal handlers run only on the main thread, between bytecodes: there, every
    signal with a Python handler is recorded instead while the block runs, then delivered
    (``signal.raise_signal``) to its handler once the block is done. Elsewhere no handler can
    interrupt the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    handlers: dict[int, object] = {}
    for sig in _python_handled_signals():
        handler = _signal.getsignal(sig)
        if callable(handler):
            handlers[sig] = handler
            _signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            _signal.signal(sig, handler)
        for sig in held:
            signal.raise_signal(sig)


def _python_handled_signals() -> tuple[int, ...]:
    """Signals that may carry a Python handler (SIGKILL and SIGSTOP cannot)."""
    global _MAIN_THREAD_HANDLED
    if not _MAIN_THREAD_HANDLED:
        blocked = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}
        _MAIN_THREAD_HANDLED = tuple(s for s in signal.valid_signals() if s not in blocked)
    return _MAIN_THREAD_HANDLED


def _exchange(a: torch.UntypedStorage, b: torch.UntypedStorage, layout: _Layout) -> None:
    """Swap the DataPtr and size, ``resizable_`` and ``allocator_`` of ``a`` and ``b`` (both
    checked by the caller); the caller holds signals off."""
    spans = ((layout.data_ptr, _SPAN), (layout.flags + _RESIZABLE, 1), (layout.allocator, 8))
    for offset, nbytes in spans:
        held = ctypes.create_string_buffer(nbytes)
        first, second = a._cdata + offset, b._cdata + offset
        ctypes.memmove(held, first, nbytes)
        ctypes.memmove(first, second, nbytes)
        ctypes.memmove(second, held, nbytes)


@functools.cache
def _ctypes_layout(device_type: str, device_index: int | None) -> tuple[_Layout | None, str]:
    """(the layout, '') where the ctypes swap can be trusted on this device, else (None, why).
    A trial swap of a resizable storage and a storage over another one's memory, read back
    through the public API (address, size, ``resizable()``, a view's address and bytes), then
    swapped back and read again."""
    layout, why = _probe_layout()
    if layout is None:
        return None, why
    device = torch.device(device_type, device_index)
    own = torch.arange(64, dtype=torch.uint8, device=device)
    other = torch.arange(100, 228, dtype=torch.uint8, device=device)
    a, b_owner = own.untyped_storage(), other.untyped_storage()
    b = torch._C._construct_storage_from_data_pointer(b_owner.data_ptr(), device, 128)
    for storage in (a, b):
        if (bad := _fields_mismatch(storage, layout)) is not None:
            return None, f"torch {torch.__version__}: a trial storage on {device}: {bad}"
    view = torch.empty(0, dtype=torch.uint8, device=device).set_(a)
    before = (a.data_ptr(), a.nbytes(), a.resizable(), b.data_ptr(), b.nbytes(), b.resizable())
    expected = (*before[3:], *before[:3], before[3])  # the last: the view's address
    with _signals_held():
        _exchange(a, b, layout)
    swapped = (a.data_ptr(), a.nbytes(), a.resizable(), b.data_ptr(), b.nbytes(), b.resizable(),
               view.data_ptr())  # fmt: skip
    follows = bool(torch.equal(view, other[:64]))
    with _signals_held():
        _exchange(a, b, layout)
    back = (a.data_ptr(), a.nbytes(), a.resizable(), b.data_ptr(), b.nbytes(), b.resizable())
    if swapped != expected or not follows:
        return None, (f"torch {torch.__version__}: the trial storage swap on {device} read "
                      f"back {swapped} (expected {expected}, view follows: {follows})")  # fmt: skip
    if back != before or not torch.equal(view, torch.arange(64, dtype=torch.uint8, device=device)):
        return None, f"torch {torch.__version__}: the trial storage swap on {device} did not swap back"
    return layout, ""


def swap_backend(device: torch.device | None = None,
                 allow_ctypes: bool = False) -> tuple[str | None, str]:  # fmt: skip
    """(``"native"`` | ``"ctypes"``, how) or (None, why neither may run on ``device``).
    ``allow_ctypes``: ``[tide] ag_storage_swap = "ctypes"`` (the ctypes swap where torch
    lacks the native one); otherwise a torch without the native swap gets None."""
    why = _construct_missing()
    if why is not None:
        return None, why
    if _native_available():
        return "native", "UntypedStorage._swap_data_ptr_"
    lacks = f"torch {torch.__version__} lacks UntypedStorage._swap_data_ptr_ (torch >= 2.12)"
    if not allow_ctypes:
        return None, (f"{lacks}; [tide] ag_storage_swap = 'ctypes' swaps the storage fields "
                      "with ctypes instead (checked at start-up and at every swap)")  # fmt: skip
    device = device if device is not None else torch.device("cpu")
    if device.type not in _DEVICE_TYPE_CODES:
        return None, f"{lacks} (no ctypes swap on {device.type})"
    layout, why = _ctypes_layout(device.type, device.index)
    if layout is None:
        return None, f"{lacks}; {why}"
    return "ctypes", (f"ctypes StorageImpl swap (DataPtr at +{layout.data_ptr}, allocator at "
                      f"+{layout.allocator}, checked on {device})")  # fmt: skip


def swap_missing_reason(device: torch.device | None = None,
                        allow_ctypes: bool = False) -> str | None:  # fmt: skip
    """Why this torch cannot point a storage at window memory on ``device`` (None: it can)."""
    backend, why = swap_backend(device, allow_ctypes)
    return None if backend is not None else why


def _check_pair(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    if a.device != b.device:
        raise ValueError(f"storage swap across devices: {a.device} and {b.device}")
    if a.nbytes() != b.nbytes() and 0 not in (a.nbytes(), b.nbytes()):
        raise ValueError(f"storage swap: storages must have the same nbytes or one must have "
                         f"0, got {a.nbytes()} and {b.nbytes()}")  # fmt: skip


def swap_storage_pairs(pairs: Sequence[tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> None:
    """Exchange the memory (address, owner, size, resizable, allocator) of each pair: every
    view of either follows. Each pair on one device, of the same size or one of size 0 (as the
    native swap demands). Natively where torch has it, else by ctypes (where install found it
    allowed and checked): every storage is checked first, and all pairs are exchanged with
    signals held off (module docstring); a pair that does not check out raises before any
    pair is exchanged."""
    for a, b in pairs:
        _check_pair(a, b)
    if _native_available():
        for a, b in pairs:
            a._swap_data_ptr_(b)
        return
    layouts = []
    for a, b in pairs:
        layout, why = _ctypes_layout(a.device.type, a.device.index)
        if layout is None:
            raise RuntimeError(f"storage swap unavailable: {why}")
        for storage in (a, b):
            if (bad := _fields_mismatch(storage, layout)) is not None:
                raise RuntimeError(f"ctypes storage swap refused: {bad}")
        layouts.append(layout)
    with _signals_held():
        for (a, b), layout in zip(pairs, layouts):
            _exchange(a, b, layout)


def swap_storages(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """:func:`swap_storage_pairs` of one pair."""
    swap_storage_pairs(((a, b),))
