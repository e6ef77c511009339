"""scripts/gpu/clocks.py: check.sh's nvidia-smi samples in one line."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))

import clocks


def test_busy_samples_only_and_throttle_reasons_other_than_idle():
    lines = [
        "2026/12/03 10:00:00.000, 0, 1980 MHz, 690.10 W, 0x0000000000000004, 100 %",
        "2026/12/03 10:00:01.000, 0, 1755 MHz, 700.00 W, 0x0000000000000004, 99 %",
        "2026/12/03 10:00:02.000, 0, 1890 MHz, 650.00 W, 0x0000000000000000, 98 %",
        "2026/12/03 10:00:03.000, 0, 345 MHz, 80.00 W, 0x0000000000000001, 0 %",  # idle
        "2026/12/03 10:00:04.000, 1, [N/A], [N/A], [N/A], [N/A]",  # unreadable
        "2026/12/03 10:00:05.000, 1, 1900 MHz",  # a cut last line
    ]
    assert clocks.summarize(lines) == (
        "gpu 0: SM 1755-1980 MHz (median 1890), <= 700 W, throttled 2/3"
    )


def test_no_busy_sample_is_said():
    assert clocks.summarize(["x, 0, 345 MHz, 80 W, 0x1, 0 %"]) == "no busy sample"


def test_temperature_column_when_sampled():
    lines = ["2026/12/03 10:00:00.000, 0, 1740 MHz, 690.00 W, 0x4, 100 %, 71"]
    assert (
        clocks.summarize(lines)
        == "gpu 0: SM 1740-1740 MHz (median 1740), <= 690 W, <= 71 C, throttled 1/1"
    )
