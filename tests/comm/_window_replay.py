"""Replay every rank's window ops (``comm/plans/window_rounds.py``) as the GPU would run them, and
check them: no data race, every read sees the bytes it expects, no deadlock.

Semantics replayed (NCCL's, docs/design/2026-12-04-windows.md): the ops of one (rank, stream) run in
issue order; ``Fork(src, dst)``: ``dst`` waits for what was issued on ``src`` before it; a
put writes the peer's window, then raises one signal; signals from one rank to a peer are
numbered in issue order; a ``Wait``'s target is the peer's cumulative signal count, fixed
when the wait is issued (NCCL's host-side expectation) and it returns once that signal was
raised. Happens-before is tracked with vector clocks over (rank, stream): a write and any
other access to the same bytes of a window must be ordered, else it is a race. Every read
(a put's source, a placement, an accumulate) names the tag it expects; the bytes must hold
it. The simulation picks executable ops round-robin; it fails on a deadlock.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from torchtitan_tide.comm.plans.window_rounds import (
    Accumulate,
    Fork,
    PackOwn,
    PackSlices,
    Place,
    Put,
    Signal,
    Wait,
)


class ReplayError(AssertionError):
    pass


@dataclass
class _Access:
    start: int
    end: int
    write: bool
    node: tuple
    clock: int  # the accessing (rank, stream)'s own component
    what: str


def _leq(node: tuple, clock: int, vc: dict) -> bool:
    return vc.get(node, 0) >= clock


class Replay:
    """Run ``programs[rank]`` (lists of ops) for windows of ``window_bytes`` each."""

    def __init__(self, programs: list[list], window_bytes: int) -> None:
        self.world = len(programs)
        self.queues: dict[tuple, deque] = defaultdict(deque)
        self.expect: dict[tuple, int] = defaultdict(int)  # (me, peer, comm) -> cumulative
        issued: dict[tuple, int] = defaultdict(int)
        self.signal_stream: dict[tuple, str] = {}
        for rank, ops in enumerate(programs):
            for op in ops:
                if isinstance(op, Fork):
                    self.queues[(rank, op.dst)].append(("fork", (rank, op.src), issued[(rank, op.src)]))
                    issued[(rank, op.dst)] += 1
                    continue
                if isinstance(op, Wait):
                    self.expect[(rank, op.peer, op.comm)] += op.count
                    item = ("wait", op, self.expect[(rank, op.peer, op.comm)])
                else:
                    item = ("op", op, None)
                    if isinstance(op, (Put, Signal)):
                        first = self.signal_stream.setdefault((rank, op.peer, op.comm), op.stream)
                        if first != op.stream:
                            raise ReplayError(
                                f"rank {rank} signals rank {op.peer} from streams {first} and "
                                f"{op.stream}: their signals could arrive out of order"
                            )
                self.queues[(rank, op.stream)].append(item)
                issued[(rank, op.stream)] += 1
        self.vc: dict[tuple, dict] = defaultdict(dict)
        self.history: dict[tuple, list[dict]] = defaultdict(list)  # VC after each op
        self.done: dict[tuple, int] = defaultdict(int)
        self.sent: dict[tuple, list[dict]] = defaultdict(list)  # (src, dst, comm) -> VCs
        self.content = [[None] * window_bytes for _ in range(self.world)]
        self.accesses: list[list[_Access]] = [[] for _ in range(self.world)]
        self.ops_run = 0
        # (rank, stream, index of the op in its queue, op, vector clock when it ran)
        self.ran: list[tuple[int, str, int, object, dict]] = []

    # ------------------------------------------------------------ memory

    def _access(self, rank: int, start: int, nbytes: int, write: bool, node: tuple, what: str):
        if nbytes <= 0:
            return
        end = start + nbytes
        if start < 0 or end > len(self.content[rank]):
            raise ReplayError(f"{what}: bytes [{start}, {end}) outside rank {rank}'s window")
        vc = self.vc[node]
        keep = []
        for acc in self.accesses[rank]:
            if acc.end <= start or end <= acc.start or not (write or acc.write):
                keep.append(acc)
                continue
            if not _leq(acc.node, acc.clock, vc):
                raise ReplayError(
                    f"race on rank {rank}'s window bytes [{max(start, acc.start)}, "
                    f"{min(end, acc.end)}): {what} is not ordered after {acc.what}"
                )
            if not (write and start <= acc.start and acc.end <= end):
                keep.append(acc)  # a write that covers it supersedes it
        keep.append(_Access(start, end, write, node, vc[node], what))
        self.accesses[rank] = keep

    def _write(self, rank, start, nbytes, tag, node, what):
        self._access(rank, start, nbytes, True, node, what)
        self.content[rank][start : start + nbytes] = [tag] * nbytes

    def _read(self, rank, start, nbytes, tag, node, what):
        self._access(rank, start, nbytes, False, node, what)
        held = set(self.content[rank][start : start + nbytes])
        if held != {tag}:
            raise ReplayError(f"{what}: rank {rank}'s bytes [{start}, {start + nbytes}) hold "
                              f"{sorted(map(str, held))}, expected {tag}")  # fmt: skip

    # ------------------------------------------------------------ execution

    def _ready(self, key: tuple, item) -> bool:
        kind, payload, target = item
        if kind == "fork":
            return self.done[payload] >= target
        if kind == "wait":
            return len(self.sent[(payload.peer, key[0], payload.comm)]) >= target
        return True

    def _tick(self, key: tuple) -> dict:
        vc = self.vc[key]
        vc[key] = vc.get(key, 0) + 1
        return vc

    def _join(self, key: tuple, other: dict) -> None:
        vc = self.vc[key]
        for node, clock in other.items():
            if vc.get(node, 0) < clock:
                vc[node] = clock

    def _run(self, key: tuple, item) -> None:
        rank = key[0]
        kind, op, target = item
        if kind == "fork":
            if target:
                self._join(key, self.history[op][target - 1])
        elif kind == "wait":
            self._join(key, self.sent[(op.peer, rank, op.comm)][target - 1])
        self._tick(key)
        what = f"rank {rank} {type(op).__name__ if kind != 'fork' else 'Fork'} on {key[1]}"
        if kind == "op":
            self._effect(rank, key, op, what)
            self.ran.append((rank, key[1], self.done[key], op, dict(self.vc[key])))
        self.history[key].append(dict(self.vc[key]))
        self.done[key] += 1
        self.ops_run += 1

    def _effect(self, rank: int, key: tuple, op, what: str) -> None:
        if isinstance(op, PackOwn):
            self._write(rank, op.dst, op.nbytes, op.tag, key, what)
        elif isinstance(op, PackSlices):
            for start, nbytes, tag in op.rows:
                self._write(rank, start, nbytes, tag, key, what)
        elif isinstance(op, Put):
            sizes = op.piece_bytes or (op.nbytes // len(op.tags),) * len(op.tags)
            if sum(sizes) != op.nbytes or len(sizes) != len(op.tags):
                raise ReplayError(f"{what}: {op.nbytes} B is not its pieces {sizes}")
            at = 0
            for size, tag in zip(sizes, op.tags):
                self._read(rank, op.src + at, size, tag, key, what + " (source)")
                at += size
            at = 0
            for size, tag in zip(sizes, op.tags):
                self._write(op.peer, op.dst + at, size, tag, key, what + f" into rank {op.peer}")
                at += size
            self.sent[(rank, op.peer, op.comm)].append(dict(self.vc[key]))
        elif isinstance(op, Signal):
            self.sent[(rank, op.peer, op.comm)].append(dict(self.vc[key]))
        elif isinstance(op, Place):
            for start, _, tag in op.entries:
                self._read(rank, start, op.entry_bytes, tag, key, what)
        elif isinstance(op, Accumulate):
            for i, tag in enumerate(op.tags):
                self._read(rank, op.start + i * op.row_bytes, op.row_bytes, tag, key, what)
        elif not isinstance(op, Wait):
            raise ReplayError(f"unknown op {op!r}")

    def happened_before(self, first: tuple[int, str, int], then: tuple[int, str, int]) -> bool:
        """Whether op ``first`` (rank, stream, queue index) is ordered before op ``then``
        (vector clocks of the run)."""
        clocks = {(r, st, i): vc for r, st, i, _, vc in self.ran}
        rank, stream, _ = first
        return clocks[then].get((rank, stream), 0) >= clocks[first][(rank, stream)]

    def run(self, all_waited: bool = True) -> int:
        """Run everything; returns the number of ops run. Raises :class:`ReplayError`
        (``all_waited``: also when a signal was sent that no wait consumed)."""
        keys = sorted(self.queues)
        while True:
            progressed = False
            for key in keys:
                queue = self.queues[key]
                while queue and self._ready(key, queue[0]):
                    self._run(key, queue.popleft())
                    progressed = True
            if not progressed:
                break
        stuck = {k: q[0] for k, q in self.queues.items() if q}
        if stuck:
            lines = "; ".join(f"rank {k[0]} {k[1]}: {item[0]} {item[1]}" for k, item in
                              sorted(stuck.items())[:6])  # fmt: skip
            raise ReplayError(f"deadlock: {len(stuck)} stream(s) cannot progress: {lines}")
        unconsumed = {
            (src, dst, comm): len(sig) for (src, dst, comm), sig in self.sent.items()
            if len(sig) != self.expect.get((dst, src, comm), 0)
        }  # fmt: skip
        if unconsumed and all_waited:
            raise ReplayError(f"signals sent but not waited for (src, dst, comm): {unconsumed}")
        return self.ops_run
