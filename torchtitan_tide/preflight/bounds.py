"""Every preflight check is bounded in time; ranks talk over one gloo control group.

:func:`bounded` runs a check under a deadline (``TIDE_PREFLIGHT_TIMEOUT_S``, default
:data:`DEFAULT_TIMEOUT_S` seconds per check). Checks bound their own waits on peers where they
can (one-sided waits, gloo timeouts); the deadline is the last resort: past it the rank
reports the check that did not finish (``comm.watchdog.report``: its log, torchrun's error
file and ``<dump_folder>/tide_failures.txt``, which ``run_train.sh`` prints as the cause),
lets ``on_timeout`` print what it has, aborts its process groups and exits with
``report.EXIT_TIMEOUT``: a broken network ends the preflight, never hangs it.

:class:`Control` is a gloo group over every rank, made once: the checks exchange their
findings over it (also on GPU jobs, so a stuck device or NCCL communicator cannot hold the
exchange of what went wrong).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torchtitan_tide.comm.base import watchdog
from torchtitan_tide.preflight.report import EXIT_TIMEOUT

TIMEOUT_ENV = "TIDE_PREFLIGHT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
_ABORT_WAIT_S = 10.0


def check_timeout_s() -> float:
    """Seconds each check may take (``TIDE_PREFLIGHT_TIMEOUT_S``).

    Raises:
        ValueError: the variable is not a positive number (naming it).
    """
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def _expire(check: str, budget_s: float, rank: int, dump_folder: str,
            on_timeout: Callable[[str], None] | None) -> None:  # fmt: skip
    message = (
        f"preflight: rank {rank}: check '{check}' did not finish within {budget_s:.0f} s "
        "(a peer stopped answering, or the network or a device is stuck: see the other "
        f"ranks' reports); fix: the node of the rank(s) named, or raise {TIMEOUT_ENV} for "
        "a slow but healthy cluster"
    )
    if on_timeout is not None:
        with contextlib.suppress(Exception):  # the report below must still be written
            on_timeout(message)
    end_rank(message, dump_folder, EXIT_TIMEOUT)


def end_rank(message: str, dump_folder: str, status: int) -> None:
    """Report ``message`` (log, torchrun's error file, ``tide_failures.txt``), abort the
    process groups (bounded: an abort that hangs does not keep the rank alive) and exit
    with ``status``."""
    watchdog.report(message, dump_folder)
    aborter = threading.Thread(target=watchdog.abort_process_groups, daemon=True)
    aborter.start()
    aborter.join(_ABORT_WAIT_S)
    os._exit(status)


@contextlib.contextmanager
def bounded(
    check: str, budget_s: float, rank: int, dump_folder: str,
    on_timeout: Callable[[str], None] | None = None,
) -> Iterator[None]:  # fmt: skip
    """Run the body as check ``check``; past ``budget_s`` seconds end this process as the
    module docstring says (``on_timeout(message)`` first: rank 0 prints its rows so far)."""
    timer = threading.Timer(budget_s, _expire, (check, budget_s, rank, dump_folder, on_timeout))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class Control:
    """The gloo group of every rank (module docstring), bounded by ``timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def gather(self, value: Any, tag: str = "") -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank. ``tag`` names the exchange:
        ranks at different exchanges (out of step) raise instead of mixing their data."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, (tag, value), group=self.group)
        tags = {t for t, _ in out}
        if len(tags) > 1:
            at = {t: [r for r, (u, _) in enumerate(out) if u == t] for t in tags}
            raise RuntimeError(f"preflight ranks out of step: {at}")
        return [v for _, v in out]

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def agree_error(self, error: str | None) -> str | None:
        """Every rank's error of one step (None: none), joined with their ranks; None
        when every rank succeeded."""
        bad = [(r, e) for r, e in enumerate(self.gather(error)) if e]
        return "; ".join(f"rank {r}: {e}" for r, e in bad) or None
