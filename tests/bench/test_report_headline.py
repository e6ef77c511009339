"""The report's headline image and name (issue 22, item 8): one machine label for file name,
header and image title (the machine of the step results), every panel naming its commit and
date, every bar labelled (fsdp2's with 1.000x), mode names level and inside the figure."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench"
DATA = Path(__file__).resolve().parent / "data"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import report

matplotlib_figure = pytest.importorskip("matplotlib.figure")
STEP = "2026-11-30_nvidia-h200-x-2_7334fb3_step_h200x2_qwen3_30b_a3b_4layers.json"


def results_of_two_machines(tmp_path: Path) -> Path:
    """A step result of "NVIDIA H200 x 2" and a newer floor result of "NVIDIA H200 x 1"."""
    out = tmp_path / "results"
    out.mkdir()
    shutil.copy(DATA / STEP, out / STEP)
    meta = {**json.loads((DATA / STEP).read_text())["metadata"], "machine": "NVIDIA H200 x 1",
            "date": "2026-12-01T11:48:25Z", "commit": "f100r00"}  # fmt: skip
    floor = {"kind": "floor", "metadata": meta, "config": "h200x2_qwen3_30b_a3b_4layers",
             "floor_ms": 122.0}  # fmt: skip
    name = "2026-12-01_nvidia-h200-x-1_f100r00_floor_h200x2_qwen3_30b_a3b_4layers.json"
    (out / name).write_text(json.dumps(floor))
    return out


def test_one_machine_label_and_every_bar_labelled(tmp_path, monkeypatch):
    out = results_of_two_machines(tmp_path)
    figures = []
    monkeypatch.setattr(matplotlib_figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    assert report.main(["--results-dir", str(out)]) == 0

    (md,) = out.glob("*_report.md")  # named after the step result, not the newer floor result
    assert md.name == "2026-11-30_nvidia-h200-x-2_7334fb3_report.md"
    text = md.read_text()
    assert text.startswith("# Benchmark report: NVIDIA H200 x 2, commit 7334fb3")
    assert "| newest result | 2026-12-01T11:48:25Z |" in text

    (fig,) = figures
    assert fig._suptitle.get_text().startswith("Training step time per comm mode, NVIDIA H200 x 2 (")
    (ax,) = fig.axes
    assert ax.get_title() == "Qwen3-30B-A3B, 4 layers\n@7334fb3, 2026-11-30"
    labels = [t.get_text() for t in ax.texts]
    modes = [t.get_text() for t in ax.get_xticklabels()]
    assert modes[0] == "fsdp2" and len(modes) >= 2
    assert sum(label.endswith(" ms") for label in labels) == len(modes)
    speedups = [label for label in labels if label.endswith("x") and label[:-1].replace(".", "").isdigit()]
    assert len(speedups) == len(modes) and speedups[0] == "1.000x"

    fig.canvas.draw()
    bottom = fig.get_window_extent().y0
    for tick in ax.get_xticklabels():
        assert tick.get_rotation() == 0
        assert tick.get_window_extent().y0 >= bottom  # inside the image


def test_panels_of_other_machines_name_theirs(tmp_path):
    out = results_of_two_machines(tmp_path)
    step = report.load_result(out / STEP)
    (panel,) = report.step_panels([step], machine="NVIDIA H200 x 8")
    assert panel["source"] == "@7334fb3, 2026-11-30, NVIDIA H200 x 2"
    assert report.step_panels([step], machine="NVIDIA H200 x 2")[0]["source"] == "@7334fb3, 2026-11-30"
