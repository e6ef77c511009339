"""TIDE watchdog: every TIDE wait on a peer has a deadline; a missed one ends the process.

NCCL's watchdog only sees NCCL work. TIDE also waits on peers outside it: the
copy-engine slot barrier (``cuStreamWaitValue32`` on peers' flags, or torch's
symmetric-memory barrier kernel), the host-side run-ahead bound of TIDE-AG and
point-to-point work on gloo. Each of them is registered here:

- :func:`watch` appends ``(operation, group, peers, done, step)`` to a deque (no
  lock, no clock read, no thread wake-up: one append on the hot path). ``done`` is
  a non-blocking completion probe: a CUDA event's ``query`` or
  ``Work.is_completed``.
- A daemon thread polls every ``poll_s``: it stamps new entries with their
  deadline (``timeout`` after it first sees them, so at most ``poll_s`` late) and
  checks the oldest. Deadlines grow in registration order (one timeout for all),
  so only the head can be overdue first; completed entries are dropped. When the head's deadline
  passes and it is still not done, :meth:`Watchdog.fire` logs the cause at ERROR
  on this rank (operation, group, step, peers waited for, and which of them
  stopped sending heartbeats), writes it as torchrun's error file and into
  ``<dump_folder>/tide_failures.txt``, aborts the process groups (as NCCL's
  watchdog does under ``TORCH_NCCL_ASYNC_ERROR_HANDLING``) and ends the process
  with :data:`EXIT_CODE`.
- Heartbeats: a second daemon thread writes ``time.time()`` and the step under
  ``tide_watchdog/<rank>`` in the default process group's store every ``poll_s``.
  A stopped (``SIGSTOP``) or dead peer stops beating; the cause then names it
  instead of the survivor that timed out. Store reads happen only while a
  failure is reported, in a helper thread bounded by :data:`_STORE_READ_S`.
- Host waits are bounded too: :func:`wait_event` polls an event with the
  deadline (instead of ``Event.synchronize``), :func:`wait_works` waits gloo work
  with an explicit timeout (a gloo group's timeout lowered after start-up does
  not reach point-to-point waits; ``Work.wait(timeout)`` does). NCCL work is
  waited plainly (stream-ordered, no host block; NCCL's watchdog bounds it).

Without an active watchdog (library use, unit tests of the comm code) ``watch``
does nothing and the host waits fall back to :data:`DEFAULT_TIMEOUT_S`.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from .ranks import group_global_ranks

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "EXIT_CODE",
    "FAILURES_FILE",
    "Watchdog",
    "active",
    "explain_exception",
    "failure_summary",
    "group_ranks",
    "set_step",
    "start",
    "stop",
    "wait_event",
    "wait_works",
    "watch",
    "watch_stream",
]

logger = logging.getLogger(__name__)

EXIT_CODE = 124  # the process's exit status after a missed deadline (timeout(1)'s)
DEFAULT_TIMEOUT_S = 600.0  # host waits when no watchdog is active (torch's default pg timeout)
FAILURES_FILE = "tide_failures.txt"  # one line per failed rank, in the dump folder
_STORE_READ_S = 5.0  # bound on reading peers' heartbeats while reporting
_WAIT_GRACE_S = 5.0  # gloo waits time out this much after the watchdog would fire
# A second caller of ``fire`` waits this long for the first one to end the process (its
# report reads the store <= _STORE_READ_S, its abort is bounded to 10 s), then ends it.
_SECOND_FIRE_WAIT_S = 30.0
_HEARTBEAT_KEY = "tide_watchdog/"


class _Wait(NamedTuple):
    deadline: float
    operation: str
    group: str
    peers: tuple[int, ...]
    done: Callable[[], bool]
    step: int


def abort_process_groups() -> None:
    """Abort every process group (torch 2.11-2.13: ``_abort_process_group``, NCCL only;
    other backends: ``ProcessGroup.abort`` where it exists). Errors are logged, never
    raised: the process ends right after."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
            return
    except Exception as e:  # noqa: BLE001 - gloo has no abort; fall through
        logger.debug("TIDE watchdog: _abort_process_group: %s", e)
    group = dist.distributed_c10d._get_default_group()
    if hasattr(group, "abort"):
        try:
            group.abort()
        except Exception as e:  # noqa: BLE001
            logger.debug("TIDE watchdog: ProcessGroup.abort: %s", e)


class Watchdog:
    """Deadlines of TIDE waits on one rank (module docstring).

    Args:
        timeout_s: deadline of every wait registered from now on.
        rank: this rank (global).
        world_size: ranks in the job (heartbeats of all of them are read on failure).
        exit_fn: ends the process (``os._exit``; tests inject a recorder).
        abort_fn: aborts the process groups before ``exit_fn``.
        store: where heartbeats go (the default group's store); None: no heartbeats.
        dump_folder: where :data:`FAILURES_FILE` is appended; None: not written.
        poll_s: polling period of both threads (default ``min(1, timeout_s / 10)``).
    """

    def __init__(
        self,
        timeout_s: float,
        rank: int = 0,
        world_size: int = 1,
        exit_fn: Callable[[int], None] = os._exit,
        abort_fn: Callable[[], None] = abort_process_groups,
        store: dist.Store | None = None,
        dump_folder: str | None = None,
        poll_s: float | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"TIDE watchdog timeout {timeout_s!r} must be > 0 seconds")
        self.timeout_s = float(timeout_s)
        self.rank, self.world_size = rank, world_size
        self.exit_fn, self.abort_fn = exit_fn, abort_fn
        self.store, self.dump_folder = store, dump_folder
        self.poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 10)
        self.step = 0
        self.pending: collections.deque[tuple] = collections.deque()  # appended by watch
        self._timed: collections.deque[_Wait] = collections.deque()  # polling thread only
        self.fired: str | None = None  # the cause, once fired
        self._fire_lock, self._firing = threading.Lock(), False
        self._fire_ended = threading.Event()  # the first fire's exit_fn returned (tests only)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ hot path
    def watch(
        self, operation: str, group: str, peers: tuple[int, ...], done: Callable[[], bool]
    ) -> None:
        """Register a wait on ``peers``; ``done()`` must not block. One deque append:
        the polling thread stamps the deadline when it first sees the entry (at most
        ``poll_s`` late), so no clock is read here."""
        self.pending.append((operation, group, peers, done, self.step))

    # ------------------------------------------------------------ polling
    def check(self, now: float | None = None) -> _Wait | None:
        """Stamp new entries, drop completed ones from the head; return the head if it
        is overdue."""
        now = time.monotonic() if now is None else now
        pending, timed, deadline = self.pending, self._timed, now + self.timeout_s
        while pending:
            operation, group, peers, done, step = pending.popleft()
            timed.append(_Wait(deadline, operation, group, peers, done, step))
        while timed:
            head = timed[0]
            if _probe(head.done):
                timed.popleft()
                continue
            return head if now >= head.deadline else None
        return None

    def outstanding(self) -> int:
        """Registered waits not yet seen complete."""
        return len(self.pending) + len(self._timed)

    def start(self) -> None:
        """Start the polling thread (and the heartbeat thread with a store)."""
        targets = [self._poll_loop] + ([self._beat_loop] if self.store is not None else [])
        for target in targets:
            thread = threading.Thread(target=target, name=f"tide-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5 * self.poll_s + 1)
        self._threads.clear()

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            overdue = self.check()
            if overdue is not None:
                self.fire(overdue)
                return

    def _beat_loop(self) -> None:
        assert self.store is not None
        key = f"{_HEARTBEAT_KEY}{self.rank}"
        while True:
            try:
                self.store.set(key, f"{time.time():.3f} {self.step}")
            except Exception as e:  # noqa: BLE001 - the store host may be gone
                logger.debug("TIDE watchdog heartbeat: %s", e)
            if self._stop.wait(self.poll_s):
                return

    # ------------------------------------------------------------ failure
    def silent_peers(self, ranks: Sequence[int]) -> list[str]:
        """For each of ``ranks`` whose heartbeat is older than ``max(5 s, 5 polls)``
        (or missing), ``"rank R (no heartbeat for S s, last in step N)"``. Bounded by
        :data:`_STORE_READ_S`; empty without a store."""
        if self.store is None or not ranks:
            return []
        found: dict[int, str | None] = {}

        def read() -> None:
            for r in ranks:
                key = f"{_HEARTBEAT_KEY}{r}"
                try:
                    found[r] = self.store.get(key).decode() if self.store.check([key]) else None
                except Exception:  # noqa: BLE001
                    found[r] = None

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(_STORE_READ_S)
        stale_s, now, out = max(5.0, 5 * self.poll_s), time.time(), []
        for r in ranks:
            if r not in found:
                continue  # the store did not answer in time
            beat = found[r]
            if beat is None:
                out.append(f"rank {r} (no heartbeat ever)")
                continue
            try:
                when, step = beat.split()
                age_s = now - float(when)
            except ValueError:
                out.append(f"rank {r} (unreadable heartbeat {beat!r})")
                continue
            if age_s > stale_s:
                out.append(f"rank {r} (no heartbeat for {age_s:.0f} s, last in step {step})")
        return out

    def cause(self, overdue: _Wait) -> str:
        """The one-line report of an overdue wait."""
        waited_for = sorted(set(overdue.peers) - {self.rank})  # a group's ranks include this one
        peers = ", ".join(str(p) for p in waited_for) or "?"
        silent = self.silent_peers(waited_for)
        who = (
            f"stopped answering: {'; '.join(silent)}"
            if silent
            else f"not answered by rank(s) {peers} (their heartbeats are current or unknown)"
        )
        return (
            f"TIDE watchdog: rank {self.rank} waited {self.timeout_s:.0f} s at step "
            f"{overdue.step} for rank(s) {peers} in {overdue.operation} (group {overdue.group}); "
            f"{who}. Aborting the process groups and exiting with {EXIT_CODE}."
        )

    def fire(self, overdue: _Wait) -> None:
        """Report ``overdue``, abort the process groups and end the process. One report,
        always the first: a second caller (the polling thread and a host wait can both
        see a deadline pass) blocks until the first one has ended the process, so it
        never raises past a deadline while the first report is unwritten (TorchTitan's
        ``@record`` would then write torchrun's error file, and the exit code would not
        be :data:`EXIT_CODE`). Should the first not end the process within
        :data:`_SECOND_FIRE_WAIT_S`, the second does, with the same code."""
        with self._fire_lock:
            first = not self._firing
            self._firing = True
        if not first:
            if not self._fire_ended.wait(_SECOND_FIRE_WAIT_S):
                self.exit_fn(EXIT_CODE)
            return
        try:
            try:
                self.fired = message = self.cause(overdue)
            except Exception as e:  # noqa: BLE001 - the report must still be written
                self.fired = message = (
                    f"TIDE watchdog: rank {self.rank} waited {self.timeout_s:.0f} s at step "
                    f"{overdue.step} in {overdue.operation} (group {overdue.group}); the "
                    f"peers could not be examined ({type(e).__name__}: {e}). Aborting the "
                    f"process groups and exiting with {EXIT_CODE}."
                )
            report(message, self.dump_folder)
            aborter = threading.Thread(target=self.abort_fn, daemon=True)
            aborter.start()
            aborter.join(10.0)  # an abort that hangs does not keep the process alive
        except BaseException:  # os._exit below would drop it unseen
            logger.exception("TIDE watchdog: writing the failure report failed")
        finally:
            try:
                self.exit_fn(EXIT_CODE)
            finally:
                self._fire_ended.set()


def _probe(done: Callable[[], bool]) -> bool:
    try:
        return bool(done())
    except Exception:  # noqa: BLE001 - a failed work reports itself; not a hang
        return True


def report(message: str, dump_folder: str | None) -> None:
    """Log ``message`` at ERROR, write it as torchrun's error file (what torchrun prints
    as the failure of this rank) and append it to ``<dump_folder>/tide_failures.txt``."""
    logger.error(message)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        data = {"message": {"message": message, "extraInfo": {
            "py_callstack": message + "\n" + "".join(traceback.format_stack(limit=8)),
            "timestamp": str(int(time.time())),
        }}}  # fmt: skip
        try:
            with open(error_file, "w") as f:
                json.dump(data, f)
        except OSError as e:
            logger.warning("TIDE watchdog: cannot write %s: %s", error_file, e)
    if dump_folder:
        try:
            os.makedirs(dump_folder, exist_ok=True)
            with open(os.path.join(dump_folder, FAILURES_FILE), "a", encoding="utf-8") as f:
                f.write(f"{time.time():.3f} " + message.replace("\n", " ") + "\n")
        except OSError as e:
            logger.warning("TIDE watchdog: cannot write %s: %s", FAILURES_FILE, e)


def failure_summary(dump_folder: str, since: float = 0.0) -> str | None:
    """The causes recorded in ``<dump_folder>/tide_failures.txt`` at or after ``since``
    (``time.time()``; for the launcher to print after torchrun failed: pass the time it
    started torchrun), one per line, or None if there are none."""
    path = os.path.join(dump_folder, FAILURES_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip().split(" ", 1) for line in f if line.strip()]
    except OSError:
        return None
    causes = []
    for parts in lines:
        try:
            if len(parts) == 2 and float(parts[0]) >= since:
                causes.append(parts[1])
        except ValueError:
            continue
    return "\n".join(causes) or None


# ---------------------------------------------------------------- the active one
_active: Watchdog | None = None


def active() -> Watchdog | None:
    return _active


def start(watchdog: Watchdog) -> Watchdog:
    """Make ``watchdog`` the one :func:`watch` registers with, and start it."""
    global _active
    stop()
    _active = watchdog
    watchdog.start()
    logger.info(
        "TIDE watchdog: rank %d, deadline %.0f s on TIDE waits, polled every %.2f s%s",
        watchdog.rank, watchdog.timeout_s, watchdog.poll_s,
        ", heartbeats in the process group store" if watchdog.store is not None else "",
    )  # fmt: skip
    return watchdog


def stop() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def set_step(step: int, timeout_s: float | None = None) -> None:
    """The training step (reported with a failure); optionally a new deadline."""
    if _active is not None:
        _active.step = step
        if timeout_s is not None:
            _active.timeout_s = float(timeout_s)


def watch(operation: str, group: str, peers: tuple[int, ...], done: Callable[[], bool]) -> None:
    """Register a wait with the active watchdog (none: no-op)."""
    if _active is not None:
        _active.watch(operation, group, peers, done)


def _timeout_s() -> float:
    return _active.timeout_s if _active is not None else DEFAULT_TIMEOUT_S


def wait_event(event: torch.Event, operation: str, group: str, peers: tuple[int, ...]) -> None:
    """Block the host until ``event`` completes, polling ``query`` with the deadline
    (no unbounded ``synchronize``). Past it: the watchdog's failure path (or
    ``TimeoutError`` without a watchdog)."""
    if event.query():
        return
    deadline = time.monotonic() + _timeout_s()
    pause = 2e-5
    while not event.query():
        if time.monotonic() >= deadline:
            overdue = _Wait(deadline, operation, group, peers, event.query,
                            _active.step if _active else -1)  # fmt: skip
            if _active is not None:
                _active.fire(overdue)
            raise TimeoutError(f"{operation} (group {group}) waited past its deadline")
        time.sleep(pause)
        pause = min(pause * 2, 2e-4)


def watch_stream(
    operation: str, group: str, peers: tuple[int, ...], device: torch.device | None = None
) -> None:
    """Register what ``device``'s current CUDA stream has enqueued so far (e.g. a
    barrier's stream waits): an event recorded now must complete before the deadline."""
    if _active is not None:
        event = torch.cuda.current_stream(device).record_event()
        _active.watch(operation, group, peers, event.query)


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """Global ranks of ``group`` (the transports' cache, keyed by the group object and
    cleared with the last TIDE model: no stale ranks for a group at a reused address)."""
    return group_global_ranks(group)


def wait_works(
    works: list[dist.Work],
    operation: str,
    group: dist.ProcessGroup,
    peers: tuple[int, ...],
    device: torch.device,
) -> None:
    """Register ``works`` (one entry) and wait them. Tensors on ``device`` CPU (gloo):
    with an explicit timeout, ``_WAIT_GRACE_S`` after the watchdog's deadline (``wait``
    blocks the host there). CUDA (NCCL, also under a ``cuda:nccl,cpu:gloo`` group): into
    the current stream, no host block (``wait(timeout)`` would block the host)."""
    if not works:
        return
    if _active is not None:
        done = works[0].is_completed if len(works) == 1 else (
            lambda: all(w.is_completed() for w in works))  # fmt: skip
        _active.watch(operation, group.group_name, peers, done)
    if device.type == "cuda":
        for work in works:
            work.wait()
    else:
        timeout = timedelta(seconds=_timeout_s() + _WAIT_GRACE_S)
        for work in works:
            work.wait(timeout=timeout)


def explain_exception(exc: BaseException, dump_folder: str | None = None) -> str | None:
    """After training raised (e.g. a gloo or NCCL timeout in a stock collective): if
    some peer stopped sending heartbeats, report which (module docstring) and return
    the line; None when every peer looks alive or no watchdog ran."""
    wd = _active
    if wd is None or wd.fired is not None:
        return None
    silent = wd.silent_peers([r for r in range(wd.world_size) if r != wd.rank])
    if not silent:
        return None
    message = (
        f"TIDE watchdog: rank {wd.rank} failed at step {wd.step} with "
        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
        f"stopped answering: {'; '.join(silent)}"
    )
    wd.fired = message
    report(message, dump_folder if dump_folder is not None else wd.dump_folder)
    return message
