"""scripts/bench/harness.spawn: a hung worker is killed and named at the deadline, a
finished one is not (the cross-node bench's variants run under it); a finished rank ends
without the interpreter's finalization, a failed one still raises."""

from __future__ import annotations

import atexit
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

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


def _marks_its_exit(rank: int, world: int, folder: str) -> None:
    Path(folder, f"worked.{rank}").write_text("done")
    atexit.register(Path(folder, f"finalized.{rank}").write_text, "finalized")


def test_a_finished_rank_ends_without_finalization(tmp_path):
    # "spawn": a forked child never finalizes (multiprocessing ends it with os._exit)
    harness.spawn(_marks_its_exit, 2, "cpu", (str(tmp_path),), start_method="spawn",
                  timeout_s=120.0)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worked.0", "worked.1"]


def _fails(rank: int, world: int) -> None:
    raise ValueError(f"rank {rank} failed on purpose")


def test_a_failing_worker_still_raises():
    # every rank fails: whichever the spawn reports first names its own error
    with pytest.raises(mp.ProcessRaisedException, match=r"ValueError: rank [01] failed on purpose"):
        harness.spawn(_fails, 2, "cpu", start_method="fork", timeout_s=60.0)
