"""Exchange the memory of two storages, every view following: how TIDE-AG in place points a
parameter's unsharded storage at window memory (``windows.py``; docs/design/2026-12-04-windows.md).

Two backends, the first that works on this torch is taken:

- ``native``: ``torch.UntypedStorage._swap_data_ptr_`` (torch 2.13 has it; 2.11, the GPU
  machine's, does not). It swaps ``c10::StorageImpl``'s data pointer, byte size and
  allocator fields.
- ``ctypes``: the same exchange of the two ``StorageImpl`` objects' ``DataPtr`` (address,
  owning context and deleter, device: 32 bytes) and byte size (a plain ``SymInt``: 8 bytes)
  by ``ctypes.memmove`` at ``storage._cdata``. The DataPtr carries its own deleter, so each
  storage frees what it holds when it dies, as after the native swap. The offset is not a
  documented ABI: it is found once per process by probing storages of known address, size,
  device and ``resizable()`` (every one of those must sit where the layout says, at one
  offset for all probes), then checked on the device it is asked for by a trial swap read
  back through the public API (``data_ptr()``, ``nbytes()``, a view's address and bytes)
  and swapped back. Any mismatch: no backend, and the reason says which check failed.
  Unlike the native swap it leaves ``resizable()`` and the allocator with each storage: a
  storage pointed at window memory stays resizable, and TIDE never resizes one while it is
  (FSDP2's reshard is wrapped to swap back first, ``fsdp_patch``).

Not thread-safe against a concurrent reader of the two storages (as the native swap): TIDE
swaps on the thread that runs the all-gather or the reshard.
"""

from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["swap_backend", "swap_missing_reason", "swap_storages"]

_DATA_PTR_BYTES = 32  # c10::DataPtr: data_, ctx_ (deleter, context), Device (+ padding)
_SPAN = _DATA_PTR_BYTES + 8  # and size_bytes_ (SymInt)
_SCAN_WORDS = 8  # data_ptr_ sits after intrusive_ptr_target's vtable and refcounts
_DEVICE_TYPE_CODES = {"cpu": 0, "cuda": 1}  # c10::DeviceType


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


def _layout_offsets(storage: torch.UntypedStorage) -> set[int]:
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
                and _byte(impl, offset + _SPAN) == 0
                and _byte(impl, offset + _SPAN + 1) == int(storage.resizable())):  # fmt: skip
            found.add(offset)
    return found


@functools.cache
def _probe_offset() -> tuple[int | None, str]:
    """(DataPtr offset in a StorageImpl, '') or (None, why): probed on CPU storages of
    distinct sizes, resizable and not (``_construct_storage_from_data_pointer``)."""
    why = _construct_missing()
    if why is not None:
        return None, why
    keep = [torch.UntypedStorage(1000 + 24 * k) for k in range(3)]
    keep += [torch._C._construct_storage_from_data_pointer(s.data_ptr(), s.device, 40 + k)
             for k, s in enumerate(keep)]  # fmt: skip
    common: set[int] | None = None
    for storage in keep:
        found = _layout_offsets(storage)
        common = found if common is None else common & found
    if not common or len(common) != 1:
        return None, (f"torch {torch.__version__}: no single StorageImpl offset holds the "
                      f"DataPtr and size of every probe storage (candidates {sorted(common or ())})")  # fmt: skip
    return common.pop(), ""


def _swap_raw(a: torch.UntypedStorage, b: torch.UntypedStorage, offset: int) -> None:
    held = ctypes.create_string_buffer(_SPAN)
    first, second = a._cdata + offset, b._cdata + offset
    ctypes.memmove(held, first, _SPAN)
    ctypes.memmove(first, second, _SPAN)
    ctypes.memmove(second, held, _SPAN)


@functools.cache
def _ctypes_offset(device_type: str, device_index: int | None) -> tuple[int | None, str]:
    """(the DataPtr offset, '') where the ctypes swap can be trusted on this device, else
    (None, why). A trial swap of a resizable storage and a storage over another one's
    memory, read back through the public API, then swapped back and read again."""
    offset, why = _probe_offset()
    if offset is None:
        return None, why
    device = torch.device(device_type, device_index)
    own = torch.arange(64, dtype=torch.uint8, device=device)
    other = torch.arange(100, 228, dtype=torch.uint8, device=device)
    a, b_owner = own.untyped_storage(), other.untyped_storage()
    b = torch._C._construct_storage_from_data_pointer(b_owner.data_ptr(), device, 128)
    view = torch.empty(0, dtype=torch.uint8, device=device).set_(a)
    before = (a.data_ptr(), a.nbytes(), b.data_ptr(), b.nbytes())
    expected = (before[2], before[3], before[0], before[1], before[2])  # the last: the view's
    _swap_raw(a, b, offset)
    swapped = (a.data_ptr(), a.nbytes(), b.data_ptr(), b.nbytes(), view.data_ptr())
    follows = bool(torch.equal(view, other[:64]))
    _swap_raw(a, b, offset)
    back = (a.data_ptr(), a.nbytes(), b.data_ptr(), b.nbytes())
    if swapped != expected or not follows:
        return None, (f"torch {torch.__version__}: the trial storage swap on {device} read "
                      f"back {swapped} (expected {expected}, view follows: {follows})")  # fmt: skip
    if back != before or not torch.equal(view, torch.arange(64, dtype=torch.uint8, device=device)):
        return None, f"torch {torch.__version__}: the trial storage swap on {device} did not swap back"
    return offset, ""


def swap_backend(device: torch.device | None = None) -> tuple[str | None, str]:
    """(``"native"`` | ``"ctypes"``, how) or (None, why neither works on ``device``)."""
    why = _construct_missing()
    if why is not None:
        return None, why
    if _native_available():
        return "native", "UntypedStorage._swap_data_ptr_"
    device = device if device is not None else torch.device("cpu")
    if device.type not in _DEVICE_TYPE_CODES:
        return None, f"torch {torch.__version__} lacks _swap_data_ptr_ (no ctypes swap on {device.type})"
    offset, why = _ctypes_offset(device.type, device.index)
    if offset is None:
        return None, f"torch {torch.__version__} lacks _swap_data_ptr_; {why}"
    return "ctypes", f"ctypes StorageImpl swap (DataPtr at +{offset}, checked on {device})"


def swap_missing_reason(device: torch.device | None = None) -> str | None:
    """Why this torch cannot point a storage at window memory on ``device`` (None: it can)."""
    backend, why = swap_backend(device)
    return None if backend is not None else why


def swap_storages(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange ``a``'s and ``b``'s memory (address, owner, size): every view of either
    follows. Both on one device, of the same size or one of size 0 (as the native swap
    demands); call only where :func:`swap_missing_reason` is None."""
    if a.device != b.device:
        raise ValueError(f"storage swap across devices: {a.device} and {b.device}")
    if a.nbytes() != b.nbytes() and 0 not in (a.nbytes(), b.nbytes()):
        raise ValueError(f"storage swap: storages must have the same nbytes or one must have "
                         f"0, got {a.nbytes()} and {b.nbytes()}")  # fmt: skip
    if _native_available():
        a._swap_data_ptr_(b)
        return
    offset, why = _ctypes_offset(a.device.type, a.device.index)
    if offset is None:
        raise RuntimeError(f"storage swap unavailable: {why}")
    _swap_raw(a, b, offset)
