"""Summarize check.sh's nvidia-smi samples (``clocks.csv``): per GPU, over the busy
samples (utilization >= 50%), the SM clock's range and median, the largest power draw, the
highest temperature (a 7th column, when sampled) and how many samples had a throttle
reason other than idle (0x1) set.

    python3 scripts/gpu/clocks.py /tmp/tide_logs/clocks.csv
"""

import statistics
import sys


def summarize(lines: list[str], busy_util_pct: float = 50.0) -> str:
    """One line: ``gpu I: SM a-b MHz (median m), <= P W[, <= T C], throttled t/n`` per GPU."""
    by_gpu: dict[str, list[tuple[float, float, int, float | None]]] = {}
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 6:
            continue
        try:
            index, clock = cells[1], float(cells[2].split()[0])
            power, reasons = float(cells[3].split()[0]), int(cells[4], 16)
            util = float(cells[5].split()[0])
            temp = float(cells[6]) if len(cells) > 6 else None
        except ValueError:
            continue  # "[N/A]" or a partial last line
        if util >= busy_util_pct:
            by_gpu.setdefault(index, []).append((clock, power, reasons, temp))
    if not by_gpu:
        return "no busy sample"
    parts = []
    for index, samples in sorted(by_gpu.items()):
        clocks = [s[0] for s in samples]
        throttled = sum(1 for s in samples if s[2] & ~0x1)
        temps = [s[3] for s in samples if s[3] is not None]
        parts.append(
            f"gpu {index}: SM {min(clocks):.0f}-{max(clocks):.0f} MHz (median "
            f"{statistics.median(clocks):.0f}), <= {max(s[1] for s in samples):.0f} W, "
            + (f"<= {max(temps):.0f} C, " if temps else "")
            + f"throttled {throttled}/{len(samples)}"
        )
    return "; ".join(parts)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(summarize(f.read().splitlines()))
