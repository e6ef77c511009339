"""scripts/bench/harness.spawn's deadline: a hung worker is killed and named, a finished
one is not (the cross-node bench's variants run under it)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import harness


def _sleeps_on_rank_1(rank: int, world: int, seconds: float) -> None:
    if rank == 1:
        time.sleep(seconds)


def test_a_hung_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    # rank 0 waits in the closing barrier for rank 1: both still run
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\] still running were killed"):
        harness.spawn(_sleeps_on_rank_1, 2, "cpu", (600.0,), start_method="fork", timeout_s=3.0)
    assert time.monotonic() - start < 60.0


def test_a_worker_that_ends_in_time_returns():
    harness.spawn(_sleeps_on_rank_1, 2, "cpu", (0.1,), start_method="fork", timeout_s=60.0)
