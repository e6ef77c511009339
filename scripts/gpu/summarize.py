"""Print the short table that ends scripts/gpu/check.sh: training runs per comm mode.

Usage: python scripts/gpu/summarize.py OUT_DIR   (reads OUT_DIR/train_<mode>_metrics.jsonl)
Step time is the median of ``time_metrics/end_to_end(s)`` after the first 5 steps.
"""

import json
import statistics
import sys
from pathlib import Path

WARMUP_STEPS = 5


def summarize(out_dir: Path) -> str:
    rows = ["| mode | steps | median step (ms) | tokens/s | peak mem (GiB) | first loss | last loss |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for path in sorted(out_dir.glob("train_*_metrics.jsonl")):
        mode = path.name.removeprefix("train_").removesuffix("_metrics.jsonl")
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        timed = [r for r in records if r["step"] > WARMUP_STEPS] or records
        step_ms = 1000 * statistics.median(r["time_metrics/end_to_end(s)"] for r in timed)
        tps = statistics.median(r["throughput(tps)"] for r in timed)
        peak = max(r["memory/max_reserved(GiB)"] for r in records)
        rows.append(
            f"| {mode} | {len(records)} | {step_ms:.1f} | {tps:,.0f} | {peak:.2f} | "
            f"{records[0]['loss_metrics/global_avg_loss']:.4f} | "
            f"{records[-1]['loss_metrics/global_avg_loss']:.4f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1])))
