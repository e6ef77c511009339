"""Where TIDE-AG's in-place deliveries sit in a window, and when a range may be written again.

Across nodes (any N x L), TIDE-AG on NCCL windows puts every shard straight into the unsharded
storage of its parameter: that storage lives in the window's ``arena`` from the all-gather
until FSDP2 reshards the group (``transports/windows/transport.py``). This module is the host-side
allocator of that arena. Pure Python (no torch): every rank of the process group runs the
same unshard / reshard sequence (SPMD), so every rank takes the same ranges in the same
order, and a range's offset is the same in every rank's window (a put names the peer's
offset).

Reuse: a range may be written again only after every rank that held it resharded. Each
release is numbered (``releases``: 1, 2, ...); after the k-th release a rank sends every
rank that writes into it its k-th credit. A writer that takes a range whose last release
was the k-th waits, per peer, until it has received k credits from that peer before it
puts there (``FreeRange.credit``; ranges merged on release keep the larger number, which
is what waiting for "at least k" needs). ``events`` are the release points on the releasing
rank's own streams, for its own writes into the range (the cast of its own shard): opaque
here, one per stream key (the latest release on a stream covers the earlier ones).
Decisions: docs/design/2026-12-04-windows.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["ARENA_ALIGN", "FreeRange", "Taken", "WindowArena", "aligned", "arena_bytes"]

ARENA_ALIGN = 256  # bytes: every range (and every parameter inside one) starts on this


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ARENA_ALIGN`."""
    return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN


def arena_bytes(group_bytes: Iterable[int], groups: int) -> int:
    """The arena of a window: room for the ``groups`` largest of the window's groups
    (``group_bytes``: each group's unsharded bytes, every parameter :func:`aligned`). The
    one sizing rule of ``install`` and ``memory_plan``."""
    return sum(sorted(group_bytes, reverse=True)[:groups])


@dataclass(frozen=True)
class FreeRange:
    """Free bytes ``[start, start + nbytes)``; ``credit``: the number of the last release
    that freed any of them (0: never used); ``events``: ``{stream key: (release, event)}``."""

    start: int
    nbytes: int
    credit: int = 0
    events: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Taken:
    """A range handed out by :meth:`WindowArena.take`: write into it only after the own
    ``events`` and, per peer, ``credit`` credits from that peer."""

    start: int
    nbytes: int
    credit: int
    events: tuple
    by_stream: dict = field(default_factory=dict)  # the free range's ``events``, for untake


def _merge_events(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, (release, event) in b.items():
        if key not in out or out[key][0] < release:
            out[key] = (release, event)
    return out


class WindowArena:
    """First-fit allocator of ``[base, base + nbytes)`` with numbered releases (module
    docstring). Not thread-safe: FSDP2's hooks call it from the thread that runs them."""

    def __init__(self, base: int, nbytes: int) -> None:
        if base % ARENA_ALIGN or nbytes < 0:
            raise ValueError(f"arena at {base} of {nbytes} B (base must be {ARENA_ALIGN}-aligned)")
        self.base, self.nbytes = base, nbytes
        self.free: list[FreeRange] = [FreeRange(base, nbytes)] if nbytes else []
        self.releases = 0
        self.in_use = 0

    def take(self, nbytes: int) -> Taken | None:
        """The lowest free range of ``aligned(nbytes)`` bytes, or None when none fits."""
        size = aligned(nbytes)
        for i, r in enumerate(self.free):
            if r.nbytes < size:
                continue
            if r.nbytes == size:
                del self.free[i]
            else:
                self.free[i] = FreeRange(r.start + size, r.nbytes - size, r.credit, r.events)
            self.in_use += size
            return Taken(r.start, size, r.credit, tuple(e for _, e in r.events.values()),
                         r.events)  # fmt: skip
        return None

    def untake(self, taken: Taken) -> None:
        """Undo :meth:`take` of a range nobody wrote (not a release: no credit is owed)."""
        self.in_use -= taken.nbytes
        self._insert(FreeRange(taken.start, taken.nbytes, taken.credit, taken.by_stream))

    def give(self, start: int, nbytes: int, event: object = None, stream_key: object = None) -> int:
        """Free a range from :meth:`take` (its ``start`` and requested size); returns this
        release's number (the credit a rank sends for it). ``event``: where the releasing
        rank's last use of the range sits on stream ``stream_key``."""
        size = aligned(nbytes)
        if start < self.base or start + size > self.base + self.nbytes:
            raise ValueError(f"range [{start}, {start + size}) is not in this arena")
        if any(r.start < start + size and start < r.start + r.nbytes for r in self.free):
            raise ValueError(f"range [{start}, {start + size}) is already free")
        self.releases += 1
        self.in_use -= size
        events = {stream_key: (self.releases, event)} if event is not None else {}
        self._insert(FreeRange(start, size, self.releases, events))
        return self.releases

    def _insert(self, new: FreeRange) -> None:
        """Add a free range, merging it with its free neighbours."""
        ranges = sorted([*self.free, new], key=lambda r: r.start)
        merged: list[FreeRange] = []
        for r in ranges:
            last = merged[-1] if merged else None
            if last is not None and last.start + last.nbytes == r.start:
                merged[-1] = FreeRange(last.start, last.nbytes + r.nbytes,
                                       max(last.credit, r.credit),
                                       _merge_events(last.events, r.events))  # fmt: skip
            else:
                merged.append(r)
        self.free = merged
