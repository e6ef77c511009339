"""FSDP2 communication modes of torchtitan-tide: one switch per model.

``apply(model, mode, **options)`` on a model already sharded with
``fully_shard`` (inside or outside TorchTitan); ``remove(model)`` undoes it.

Modes: ``"fsdp2"`` (stock, no-op), ``"tide"`` (TIDE-AG: zero-copy all-gather
into per-parameter storage, and TIDE-RS; options in :class:`TideOptions`) and
``"symm_mem"`` (stock FSDP2 with its all-gather / reduce-scatter buffers in
NCCL symmetric memory, zero-CTA copy-engine all-gather; ``comm/symm_mem.py``,
options in :class:`~.symm_mem.SymmMemOptions`, registered below with
:func:`register_mode`).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .options import TideOptions

if TYPE_CHECKING:
    from torch import nn

# torch, FSDP2 and the installers load on the first apply/remove, not on import: the
# pure-Python parts of this package (options, plan, memory_plan) serve the simulator and
# the memory report without torch.

__all__ = [
    "TideOptions",
    "apply",
    "available_modes",
    "register_mode",
    "remove",
]

logger = logging.getLogger(__name__)

_MODE_ATTR = "_tide_comm_mode"
ApplyFn = Callable[..., None]  # (model, **options) -> None
RemoveFn = Callable[["nn.Module"], None]


def _lazy(module: str, name: str) -> Callable[..., None]:
    """``<package>.<module>.<name>``, imported when first called."""

    def call(*args: object, **kwargs: object) -> None:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{module}.{name}"
    return call


def _apply_fsdp2(model: nn.Module, **options: object) -> None:
    if options:
        raise ValueError(f"comm mode 'fsdp2' takes no options, got {sorted(options)}")
    logger.info("comm mode fsdp2: stock FSDP2 collectives (nothing installed)")


def _remove_fsdp2(model: nn.Module) -> None:
    return None


def _apply_tide(model: nn.Module, **options: object) -> None:
    from .fsdp import install

    install.install(model, TideOptions.from_kwargs(**options))


# mode -> (apply_fn, remove_fn); other modules add modes with register_mode.
_MODES: dict[str, tuple[ApplyFn, RemoveFn]] = {
    "fsdp2": (_apply_fsdp2, _remove_fsdp2),
    "tide": (_apply_tide, _lazy("fsdp.install", "uninstall")),
}
def register_mode(name: str, apply_fn: ApplyFn, remove_fn: RemoveFn) -> None:
    """Register (or replace) a comm mode. ``apply_fn(model, **options)`` must
    raise ``ValueError`` on bad options; ``remove_fn(model)`` must undo it."""
    _MODES[name] = (apply_fn, remove_fn)


register_mode("symm_mem", _lazy("symm_mem", "apply"), _lazy("symm_mem", "remove"))


def available_modes() -> tuple[str, ...]:
    return tuple(sorted(_MODES))


def apply(model: nn.Module, mode: str = "tide", **options: object) -> None:
    """Switch the FSDP2 communication of ``model`` (already ``fully_shard``-ed)
    to ``mode``. Call on every rank, in the same order, before the first
    forward or between steps (never while an all-gather is pending)."""
    if mode not in _MODES:
        raise ValueError(f"unknown comm mode {mode!r}; choose one of {available_modes()}")
    current = getattr(model, _MODE_ATTR, None)
    if current is not None and current != "fsdp2":
        raise ValueError(
            f"comm mode {current!r} is already applied to this model; call remove(model) first"
        )
    apply_fn, _ = _MODES[mode]
    apply_fn(model, **options)
    setattr(model, _MODE_ATTR, mode)


def remove(model: nn.Module) -> None:
    """Undo :func:`apply`: the model uses stock FSDP2 collectives again."""
    mode = getattr(model, _MODE_ATTR, None)
    if mode is None:
        return
    _, remove_fn = _MODES[mode]
    remove_fn(model)
    delattr(model, _MODE_ATTR)
