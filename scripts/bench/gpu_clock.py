"""The GPU's SM clock, temperature and power while a benchmark times something.

The H200s we measure on are power-capped: the same kernels run at different SM clocks
depending on the power the work around them draws (on one H200 a Wan2.2 trace ran at ~1900
MHz and 640 W, the same kernels in a training step at ~1740 MHz and 690 W;
docs/design/2026-12-02-simulator.md, 2026-12-03). A timing is only comparable with another
when the clock state beside it is known. :class:`ClockSampler` runs ``nvidia-smi`` (a
read-only query, every ``period_ms``) in a child process; :meth:`ClockSampler.window`
summarizes the samples between two wall-clock times. Without ``nvidia-smi`` (CPU
machines) it samples nothing and every summary is None.

    sampler = ClockSampler(gpu_index())
    t0 = time.time(); ...timed work...; t1 = time.time()
    summary = sampler.window(t0, t1)   # {"sm_mhz_median": ..., "temp_c_max": ...} or None
    sampler.stop()
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

QUERY = "timestamp,clocks.sm,temperature.gpu,power.draw,utilization.gpu"
BUSY_UTIL_PCT = 50.0  # a sample counts as busy from this utilization on


def gpu_index() -> str:
    """nvidia-smi's index of the process's first visible GPU: the first entry of
    ``CUDA_VISIBLE_DEVICES`` when it is a number, else "0"."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return first if first.isdigit() else "0"


Sample = tuple[float, float, float, float, float]  # unix s, SM MHz, C, W, utilization %


def parse_sample(line: str) -> Sample | None:
    """(unix seconds, SM MHz, degrees C, W, utilization %) of one ``nvidia-smi
    --format=csv,noheader,nounits`` line of :data:`QUERY`; None for a line that does not
    parse ("[N/A]", cut)."""
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != 5:
        return None
    try:
        stamp = time.mktime(time.strptime(cells[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
        frac = float("0." + cells[0].split(".")[1]) if "." in cells[0] else 0.0
        return stamp + frac, float(cells[1]), float(cells[2]), float(cells[3]), float(cells[4])
    except (ValueError, IndexError):
        return None


def summarize(samples: list[Sample]) -> dict[str, Any] | None:
    """Median / min / max SM MHz, max temperature, median power of ``samples``; None
    for no sample."""
    if not samples:
        return None
    clocks = [s[1] for s in samples]
    return {
        "samples": len(samples),
        "sm_mhz_median": statistics.median(clocks),
        "sm_mhz_min": min(clocks),
        "sm_mhz_max": max(clocks),
        "temp_c_max": max(s[2] for s in samples),
        "power_w_median": statistics.median(s[3] for s in samples),
    }


class ClockSampler:
    """``nvidia-smi`` sampling GPU ``index`` into a temporary file until :meth:`stop`."""

    def __init__(self, index: str, period_ms: int = 250) -> None:
        self._proc: subprocess.Popen | None = None
        self._folder = tempfile.TemporaryDirectory()
        self._path = Path(self._folder.name) / "clocks.csv"
        if shutil.which("nvidia-smi") is None:
            return
        with open(self._path, "w") as out:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 "-i", index, "-lms", str(period_ms)],
                stdout=out, stderr=subprocess.DEVNULL,
            )  # fmt: skip

    def window(
        self, start_s: float, end_s: float, busy_only: bool = False
    ) -> dict[str, Any] | None:
        """:func:`summarize` of the samples taken from ``start_s`` to ``end_s`` (unix
        seconds; ``busy_only``: those at :data:`BUSY_UTIL_PCT` utilization or more, e.g.
        a training run's steps without its start-up); None without a sampler or a sample."""
        if self._proc is None or not self._path.exists():
            return None
        parsed = [parse_sample(line) for line in self._path.read_text().splitlines()]
        return summarize([
            s for s in parsed
            if s is not None and start_s <= s[0] <= end_s and (not busy_only or s[4] >= BUSY_UTIL_PCT)
        ])  # fmt: skip

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._proc = None
        self._folder.cleanup()
