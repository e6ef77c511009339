"""The storage swap TIDE-AG in place stands on (``comm/transports/windows/storage_swap.py``): the
native ``UntypedStorage._swap_data_ptr_`` and the ctypes exchange of the ``StorageImpl``
fields that torch 2.11 (no native swap) gets where ``[tide] ag_storage_swap = "ctypes"`` asks
for it, each checked through the public API on fresh random data: views follow for reads and
writes, sizes, ``resizable()`` and the allocator move with the memory (a ``resize_`` of a
storage over window memory raises instead of detaching it), a swap back restores both, each
storage frees what it holds. The ctypes fields are checked against what the native swap moves;
a layout the probe cannot confirm, a lazily cloned storage and a swap without the option are
refused with their reason; a signal that arrives inside a swap is delivered after it."""

from __future__ import annotations

import ctypes
import gc
import os
import signal

import pytest
import torch

from torchtitan_tide.comm.transports.windows import storage_swap

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]  # fmt: skip


@pytest.fixture
def backend(request, monkeypatch):
    """``native`` where this torch has it (else skipped); ``ctypes`` as on torch 2.11."""
    if request.param == "native":
        if not storage_swap._native_available():
            pytest.skip(f"torch {torch.__version__} has no native storage swap")
    else:
        monkeypatch.setattr(storage_swap, "_native_available", lambda: False)
    return request.param


def _clear_caches() -> None:
    storage_swap._probe_layout.cache_clear()
    storage_swap._ctypes_layout.cache_clear()


def _window_like(device: str, numel: int) -> tuple[torch.Tensor, torch.UntypedStorage]:
    """Memory owned elsewhere (as a window's arena) and a non-owning storage over it."""
    owner = torch.randn(numel + 16, device=device)
    held = torch._C._construct_storage_from_data_pointer(
        owner.data_ptr() + 16 * owner.element_size(), owner.device, numel * owner.element_size()
    )
    return owner, held


@pytest.mark.parametrize("backend", ["native", "ctypes"], indirect=True)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("freed", [False, True], ids=["same-size", "freed-first"])
def test_swap_moves_memory_views_follow_and_swap_back_restores(backend, device, freed):
    """``freed``: as TIDE-AG binds, the parameter's storage resized to 0 before the swap."""
    kind, how = storage_swap.swap_backend(torch.device(device), allow_ctypes=True)
    assert kind == backend, how
    param = torch.randn(24, device=device)  # the parameter's own memory (FSDP2's all-gather output)
    own_values = param.clone()
    storage = param.untyped_storage()
    views = [param.view(4, 6), param[5:17], param.view(2, 12).t()]  # autograd keeps such views
    if freed:
        storage.resize_(0)
    own_address, own_nbytes = storage.data_ptr(), storage.nbytes()
    owner, held = _window_like(device, 24)
    arena_values = owner.clone()
    arena_address = held.data_ptr()

    storage_swap.swap_storages(storage, held)

    assert (storage.data_ptr(), storage.nbytes()) == (arena_address, 24 * 4)
    assert (held.data_ptr(), held.nbytes()) == (own_address, own_nbytes)
    assert (storage.resizable(), held.resizable()) == (False, True)  # as the memory's owners
    with pytest.raises(RuntimeError, match="not resizable"):
        storage.resize_(0)  # a bound storage is never silently detached from the arena
    assert storage.data_ptr() == arena_address
    assert param.data_ptr() == arena_address
    torch.testing.assert_close(param, arena_values[16:], rtol=0, atol=0)
    torch.testing.assert_close(views[1], arena_values[21:33], rtol=0, atol=0)
    torch.testing.assert_close(views[2], arena_values[16:].view(2, 12).t(), rtol=0, atol=0)
    written = torch.randn(4, 6, device=device)
    views[0].copy_(written)  # a write through a view lands in the arena
    torch.testing.assert_close(owner[16:], written.flatten(), rtol=0, atol=0)
    torch.testing.assert_close(owner[:16], arena_values[:16], rtol=0, atol=0)  # nothing else

    storage_swap.swap_storages(storage, held)

    assert (storage.data_ptr(), storage.nbytes()) == (own_address, own_nbytes)
    assert (held.data_ptr(), held.nbytes()) == (arena_address, 24 * 4)
    assert (storage.resizable(), held.resizable()) == (True, False)
    if not freed:
        torch.testing.assert_close(param, own_values, rtol=0, atol=0)
        torch.testing.assert_close(views[1], own_values[5:17], rtol=0, atol=0)
    del views, param, storage, held
    gc.collect()
    torch.testing.assert_close(owner[16:], written.flatten(), rtol=0, atol=0)  # still owned


@pytest.mark.parametrize("backend", ["native", "ctypes"], indirect=True)
@pytest.mark.parametrize("device", DEVICES)
def test_swapped_storages_free_what_they_hold(backend, device):
    """After the swap each storage owns the other's memory: the one over the arena frees the
    parameter's block when it dies, the parameter's storage frees nothing of the arena."""
    param = torch.randn(1 << 16, device=device)
    owner, held = _window_like(device, 1 << 16)
    storage_swap.swap_storages(param.untyped_storage(), held)
    expected = owner[16:].clone()
    del held  # frees the parameter's original block (its DataPtr moved here)
    gc.collect()
    filler = torch.full((1 << 16,), 7.0, device=device)  # may reuse the freed block
    torch.testing.assert_close(param, expected, rtol=0, atol=0)  # the arena was not freed
    del param, filler
    gc.collect()
    torch.testing.assert_close(owner[16:], expected, rtol=0, atol=0)


def test_ctypes_fields_are_what_the_native_swap_moves():
    """The ctypes exchange (DataPtr and size, ``resizable_``, ``allocator_``) moves exactly the
    bytes ``_swap_data_ptr_`` exchanges there: after a native swap each storage's fields hold
    the other's former ones (but the Device's padding, bytes 26-31, which a move does not
    copy), and a ctypes swap of the same two storages gives the same bytes."""
    if not storage_swap._native_available():
        pytest.skip(f"torch {torch.__version__} has no native storage swap to compare with")
    layout, why = storage_swap._probe_layout()
    assert layout is not None, why

    def fields(storage) -> bytes:  # data_, ctx_ (deleter, context), Device; size; flags; allocator
        span = ctypes.string_at(storage._cdata + layout.data_ptr, storage_swap._SPAN)
        flags = ctypes.string_at(storage._cdata + layout.flags, storage_swap._FLAG_BYTES)
        allocator = ctypes.string_at(storage._cdata + layout.allocator, 8)
        return span[:26] + span[32:] + flags + allocator

    a = torch.randn(30).untyped_storage()
    _, b = _window_like("cpu", 30)
    before_a, before_b = fields(a), fields(b)
    assert before_a != before_b
    a._swap_data_ptr_(b)
    assert (fields(a), fields(b)) == (before_b, before_a)
    a._swap_data_ptr_(b)
    with storage_swap._signals_held():
        storage_swap._exchange(a, b, layout)
    assert (fields(a), fields(b)) == (before_b, before_a)
    with storage_swap._signals_held():
        storage_swap._exchange(a, b, layout)
    assert (fields(a), fields(b)) == (before_a, before_b)


def test_ctypes_swap_only_where_asked_for(monkeypatch):
    """A torch without the native swap gets none unless ``[tide] ag_storage_swap = "ctypes"``
    asks for it; the reason names the option."""
    monkeypatch.setattr(storage_swap, "_native_available", lambda: False)
    kind, why = storage_swap.swap_backend(torch.device("cpu"))
    assert kind is None and "ag_storage_swap = 'ctypes'" in why, why
    assert storage_swap.swap_missing_reason(torch.device("cpu")) == why
    kind, how = storage_swap.swap_backend(torch.device("cpu"), allow_ctypes=True)
    assert kind == "ctypes" and "allocator at" in how, how


def test_ctypes_swap_refuses_a_lazily_cloned_storage(monkeypatch):
    """A copy-on-write storage shares its memory with its sibling behind state the ctypes swap
    cannot move: refused (nothing exchanged), the sibling untouched."""
    monkeypatch.setattr(storage_swap, "_native_available", lambda: False)
    original = torch.randn(10)
    expected = original.clone()
    lazy = original._lazy_clone()
    other = torch.randn(10)
    other_address = other.data_ptr()
    with pytest.raises(RuntimeError, match="copy-on-write"):
        storage_swap.swap_storages(lazy.untyped_storage(), other.untyped_storage())
    assert other.data_ptr() == other_address
    other.fill_(3.0)
    torch.testing.assert_close(original, expected, rtol=0, atol=0)


def test_a_signal_inside_a_ctypes_swap_is_delivered_after_it(monkeypatch):
    """Ctrl-C (SIGINT) that arrives between the halves of an exchange is delivered once every
    pair is exchanged: both storages have one owner each, and a swap back restores them."""
    monkeypatch.setattr(storage_swap, "_native_available", lambda: False)
    real = storage_swap._exchange
    calls = {"n": 0}

    def interrupted(a, b, layout):
        calls["n"] += 1
        if calls["n"] == 1:
            os.kill(os.getpid(), signal.SIGINT)  # held off: recorded, not raised here
        real(a, b, layout)

    monkeypatch.setattr(storage_swap, "_exchange", interrupted)
    params = [torch.randn(8) for _ in range(3)]
    addresses = [p.data_ptr() for p in params]
    arenas = [_window_like("cpu", 8) for _ in params]
    pairs = [(p.untyped_storage(), held) for p, (_, held) in zip(params, arenas)]
    arena_addresses = [held.data_ptr() for _, held in pairs]
    with pytest.raises(KeyboardInterrupt):
        storage_swap.swap_storage_pairs(pairs)
    assert calls["n"] == 3, "a pair was left unswapped"
    assert [p.data_ptr() for p in params] == arena_addresses
    assert [held.data_ptr() for _, held in pairs] == addresses
    monkeypatch.setattr(storage_swap, "_exchange", real)
    storage_swap.swap_storage_pairs(pairs)
    assert [p.data_ptr() for p in params] == addresses


def test_a_layout_the_probe_cannot_confirm_is_refused(monkeypatch):
    monkeypatch.setattr(storage_swap, "_native_available", lambda: False)
    monkeypatch.setattr(storage_swap, "_SCAN_WORDS", 2)  # the DataPtr lies beyond the scan
    _clear_caches()
    try:
        kind, why = storage_swap.swap_backend(torch.device("cpu"), allow_ctypes=True)
        assert kind is None and "no single StorageImpl offset" in why, why
        assert storage_swap.swap_missing_reason(torch.device("cpu"), allow_ctypes=True) == why
        a = torch.randn(4).untyped_storage()
        _, b = _window_like("cpu", 4)
        with pytest.raises(RuntimeError, match="storage swap unavailable"):
            storage_swap.swap_storages(a, b)
    finally:
        _clear_caches()


@pytest.mark.parametrize("backend", ["native", "ctypes"], indirect=True)
def test_swaps_the_native_swap_refuses_are_refused(backend):
    a = torch.randn(4).untyped_storage()
    with pytest.raises(ValueError, match="across devices"):
        storage_swap.swap_storages(a, torch.empty(4, device="meta").untyped_storage())
    with pytest.raises((ValueError, RuntimeError), match="same nbytes or one must have 0"):
        storage_swap.swap_storages(a, torch.randn(5).untyped_storage())


@pytest.mark.parametrize("backend", ["native", "ctypes"], indirect=True)
def test_no_swap_without_storages_over_foreign_memory(backend, monkeypatch):
    """The arena's ranges are wrapped by ``_construct_storage_from_data_pointer``: a torch
    without it gets no swap, native or not, and the reason names it."""
    monkeypatch.delattr(torch._C, "_construct_storage_from_data_pointer")
    _clear_caches()
    try:
        kind, why = storage_swap.swap_backend(torch.device("cpu"), allow_ctypes=True)
        assert kind is None and "lacks _construct_storage_from_data_pointer" in why, why
    finally:
        _clear_caches()
