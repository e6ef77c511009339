"""A test hook: fill every buffer TIDE-RS writes with a value before it writes it.

With a value set (NaN, say), an element TIDE-RS fails to write shows in the
output. Off by default (``None``); set only by tests, never by training.
Used by ``reduce_scatter`` (outputs, partials, send buffers) and the point-to-point
cross-node transport (receive buffers; the one-sided transport's receive regions are
written by peers' puts and not poisoned).
"""

from __future__ import annotations

import torch

__all__ = ["poison_value", "poisoned", "set_poison"]

_poison: dict[str, float | None] = {"value": None}


def set_poison(value: float | None) -> None:
    """Fill every TIDE-RS output/partial/send/receive buffer with ``value`` right
    after it is taken (None: off, the default). For tests only."""
    _poison["value"] = value


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """``t``, filled with the poison value when one is set (on the current stream)."""
    if _poison["value"] is not None:
        t.fill_(_poison["value"])
    return t


def poison_value() -> float | None:
    """The poison value set by a test, or None (off)."""
    return _poison["value"]
