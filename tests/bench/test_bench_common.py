"""CPU tests of scripts/bench/common.py and the pure helpers of bench_ag.py.

The GPU measurement itself runs only on the GPU machine; ``test_smoke_cpu``
runs the whole bench_ag orchestration (stock and TIDE variants, profiler,
exactness check, result files) on 2 gloo ranks with tiny shapes.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import common


def _load_bench_ag():
    spec = importlib.util.spec_from_file_location("bench_ag", BENCH / "bench_ag.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_ag"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


bench_ag = _load_bench_ag()

META = {
    "date": "2026-11-30T19:00:00Z",
    "machine": "NVIDIA H200 x 2",
    "hostname": "h",
    "torch": "2.11.0+cu130",
    "nccl": "2.28.9",
    "cuda": "13.0",
    "commit": "a356e7f",
    "world_size": 2,
}


# ---------------------------------------------------------------- common


def test_metadata_schema(tmp_path):
    now = dt.datetime(2026, 11, 30, 19, 5, 7, tzinfo=dt.timezone.utc)
    meta = common.metadata(2, machine="NVIDIA H200 x 2", now=now)
    assert tuple(meta) == common.METADATA_KEYS
    assert meta["date"] == "2026-11-30T19:05:07Z"
    assert meta["machine"] == "NVIDIA H200 x 2"
    assert meta["world_size"] == 2
    assert meta["torch"] == torch.__version__
    assert meta["commit"] and " " not in meta["commit"]
    json.dumps(meta)  # JSON-serializable
    # not a repo -> "unknown"
    assert common.metadata(1, repo_dir=tmp_path, machine="x")["commit"] == "unknown"


def test_metadata_default_machine_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only expectation")
    assert common.metadata(1)["machine"] == "cpu"


def test_git_commit_of_this_repo(monkeypatch):
    monkeypatch.delenv("TIDE_COMMIT", raising=False)
    commit = common.git_commit(REPO).removesuffix("-dirty")
    assert commit == "unknown" or (4 <= len(commit) <= 40 and commit.isalnum())


def test_git_commit_says_dirty_when_a_tracked_file_differs(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.delenv("TIDE_COMMIT", raising=False)

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "untracked.json").write_text("{}")  # results being written: not dirty
    assert common.git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert common.git_commit(tmp_path) == f"{head}-dirty"
    monkeypatch.setenv("TIDE_COMMIT", "abc1234")
    assert common.git_commit(tmp_path) == "abc1234"


def test_slugify():
    assert common.slugify("NVIDIA H200 x 2") == "nvidia-h200-x-2"
    assert common.slugify("  --A/B__c  ") == "a-b-c"
    assert common.slugify("***") == "unknown"


def test_result_stem(tmp_path):
    stem = common.result_stem(tmp_path / "res", "ag", META)
    assert stem == tmp_path / "res" / "2026-11-30_nvidia-h200-x-2_a356e7f_ag"
    assert common.result_stem("o", "ag", {**META, "commit": "unknown"}).name.endswith("_unknown_ag")


def test_median():
    assert common.median([3.0, 1.0, 2.0]) == 2.0
    assert common.median([4, 1, 2, 3]) == 2.5
    with pytest.raises(ValueError):
        common.median([])


def test_write_json_roundtrip(tmp_path):
    path = common.write_json(
        tmp_path / "a" / "b.json", {"x": 1.5, "nan": float("nan"), "t": torch.tensor(2.0)}
    )
    assert json.loads(path.read_text()) == {"x": 1.5, "nan": None, "t": 2.0}


def test_format_cell():
    assert common.format_cell(None) == "-"
    assert common.format_cell(True) == "yes"
    assert common.format_cell(False) == "no"
    assert common.format_cell(1.23456) == "1.235"
    assert common.format_cell(float("nan")) == "-"
    assert common.format_cell(3) == "3"
    assert common.format_cell("a|b") == "a\\|b"


def test_markdown_table(tmp_path):
    rows = [{"v": "stock", "ms": 1.0}, {"v": "tide", "ms": 0.5, "extra": 1}]
    text = common.format_markdown_table(rows, [("v", "variant"), "ms", ("gone", "missing")])
    lines = text.splitlines()
    assert lines[0] == "| variant | ms | missing |"
    assert lines[1] == "| --- | --- | --- |"
    assert lines[2] == "| stock | 1.000 | - |"
    assert lines[3] == "| tide | 0.500 | - |"
    assert text.endswith("\n")
    out = common.write_markdown_table(tmp_path / "t.md", rows, ["v", "ms"], title="T", extra="more")
    assert (tmp_path / "t.md").read_text() == out
    assert out.startswith("# T\n") and out.rstrip().endswith("more")


def test_bar_png_written(tmp_path):
    pytest.importorskip("matplotlib")
    charts = [
        common.BarChart("a", ["x", "y"], [1.0, None], "ms"),
        common.BarChart("b", ["z"], [float("nan")], "GiB/s"),
    ]
    path = tmp_path / "c.png"
    assert common.write_bar_png(path, charts, "title") is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bar_png_skipped_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    path = tmp_path / "c.png"
    assert common.write_bar_png(path, [common.BarChart("a", ["x"], [1.0], "ms")]) is False
    assert not path.exists()
    assert "WARNING" in capsys.readouterr().out


# ---------------------------------------------------------------- bench_ag helpers


def test_layer_numel_matches_module():
    s = bench_ag.SMOKE_SHAPE
    assert bench_ag.layer_numel(s) == sum(p.numel() for p in bench_ag.Layer(s).parameters())
    # Llama-3.1-70B layer: ~855.6M parameters
    assert bench_ag.layer_numel(bench_ag.LLAMA_70B) == 855_654_400


def test_layer_params_random_nonzero():
    torch.manual_seed(0)
    for p in bench_ag.Layer(bench_ag.SMOKE_SHAPE).parameters():
        assert p.abs().sum() > 0 and p.std() > 0


def test_bus_gibps():
    assert bench_ag.bus_gibps(2**30, 2, 1000.0) == pytest.approx(0.5)
    assert bench_ag.bus_gibps(2**30, 2, None) is None
    assert bench_ag.bus_gibps(2**30, 2, 0.0) is None


def test_classify_and_breakdown():
    c = bench_ag.classify_device_event
    assert c("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl_kernel"
    assert c("Memcpy PtoP (Device -> Device)") == "memcpy"
    assert c("Memcpy DtoD (Device -> Device)") == "memcpy"
    assert c("Memset (Device)") == "memset"
    assert c("void at::native::split_with_sizes_copy_out_contiguous_no_cast_kernel") == (
        "other_kernel"
    )
    events = [
        ("ncclDevKernel_AllGather_RING_LL", 3000.0),
        ("void at::native::split_with_sizes_copy_out_kernel<...>", 600.0),
        ("Memcpy PtoP (Device -> Device)", 1500.0),
        ("Memcpy PtoP (Device -> Device)", 1500.0),
    ]
    b = bench_ag.breakdown(events, steps=3)
    assert b["nccl_kernel_ms"] == pytest.approx(1.0)
    assert b["other_kernel_ms"] == pytest.approx(0.2)
    assert b["memcpy_ms"] == pytest.approx(1.0)
    assert b["memset_ms"] == 0.0
    assert b["by_name"]["memcpy"] == {"Memcpy PtoP (Device -> Device)": pytest.approx(1.0)}
    assert b["copy_out_kernels"] == ["void at::native::split_with_sizes_copy_out_kernel<...>"]


def test_device_rows_skips_cpu_and_annotations():
    cuda = torch.autograd.DeviceType.CUDA
    cpu = torch.autograd.DeviceType.CPU

    def ev(name, dev, us, ann=False):
        rng = SimpleNamespace(elapsed_us=lambda: us)
        return SimpleNamespace(name=name, device_type=dev, time_range=rng, is_user_annotation=ann)

    prof = SimpleNamespace(
        events=lambda: [
            ev("aten::copy_", cpu, 50),
            ev("FSDP::all_gather", cuda, 900, ann=True),
            ev("ncclDevKernel_AllGather", cuda, 700),
            ev("Memcpy PtoP (Device -> Device)", cuda, 300),
        ]
    )
    assert bench_ag.device_rows(prof) == [
        ("ncclDevKernel_AllGather", 700.0),
        ("Memcpy PtoP (Device -> Device)", 300.0),
    ]


def _round(ms, queued=None, prof=None, exact=None):
    r = {"median_ms": ms, "queued_median_ms": queued or ms, "host_median_ms": 0.1}
    if prof is not None:
        r["profile"] = prof
    if exact is not None:
        r["exact_vs_stock"] = exact
    return r


def _fake_results():
    prof = bench_ag.breakdown([("ncclDevKernel_AllGather", 3000.0)], 3)
    nbytes = 2 * 2**30
    return {
        "metadata": META,
        "config": {"iters": 20, "stem": "x"},
        "status": "complete",
        "layer": {
            "layers": 1,
            "unsharded_bf16_bytes": nbytes,
            "variants": {
                "stock": {"rounds": [_round(4.0, prof=prof), _round(5.0)]},
                "tide_auto": {"rounds": [_round(3.0, prof=prof, exact=True), _round(2.0)]},
                "tide_nccl_p2p_2x1": {"rounds": [{"error": "RuntimeError: boom\nmore"}]},
            },
        },
        "copy_engine": {
            "bytes": 576 * 466032,
            "copies": 576,
            "chunk_bytes": 466032,
            "modes": {
                "one_copy": {"median_ms": 1.0, "GiBps": 340.0, "exact": True},
                "loop": {"median_ms": 4.0, "GiBps": 70.0, "exact": True},
                "batch": {"error": "ImportError: no cuda.bindings"},
            },
            "batch_vs_one_copy": None,
        },
    }


def test_summarize_and_rows():
    results = _fake_results()
    rows = bench_ag.table_rows(results)
    assert [r["variant"] for r in rows] == [
        "1 layer stock",
        "1 layer tide_auto",
        "1 layer tide_nccl_p2p_2x1",
    ]
    stock, auto, p2p = rows
    assert (stock["round1_ms"], stock["round2_ms"], stock["best_ms"]) == (4.0, 5.0, 4.0)
    assert stock["ratio_vs_stock"] == pytest.approx(1.0)
    assert auto["best_ms"] == 2.0 and auto["ratio_vs_stock"] == pytest.approx(2.0)
    assert auto["bus_GiBps"] == pytest.approx(2 * 2**30 / 2 / 2e-3 / 2**30)
    assert auto["nccl_kernel_ms"] == pytest.approx(1.0)
    assert auto["exact_vs_stock"] is True
    assert p2p["best_ms"] is None and p2p["ratio_vs_stock"] is None
    assert p2p["error"] == "r1: RuntimeError: boom"
    crows = bench_ag.ce_rows(results["copy_engine"])
    assert crows[0]["vs_one_copy"] == pytest.approx(1.0)
    assert crows[1]["vs_one_copy"] == pytest.approx(70 / 340)
    assert crows[2]["GiBps"] is None and "ImportError" in crows[2]["error"]


def test_write_outputs(tmp_path):
    pytest.importorskip("matplotlib")
    results = _fake_results()
    results["config"]["stem"] = str(tmp_path / "2026-11-30_x_abc_ag")
    md = bench_ag.write_outputs(results, final=True)
    text = md.read_text()
    assert text.startswith("# TIDE-AG vs stock FSDP2 all-gather")
    assert "| 1 layer tide_auto | 3.000 | 2.000 | 2.000 |" in text
    assert "(a) one copy_" in text
    assert json.loads((tmp_path / "2026-11-30_x_abc_ag.json").read_text())["status"] == "complete"
    assert (tmp_path / "2026-11-30_x_abc_ag.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_smoke_cpu(tmp_path):
    """The whole script on 2 CPU gloo ranks, tiny shapes (about 15-30 s)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_ag.py"), "--out-dir", str(tmp_path), "--smoke-cpu",
         "--iters", "2"],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*_ag_smoke.json")
    res = json.loads(js.read_text())
    assert res["status"] == "complete"
    assert tuple(res["metadata"]) == common.METADATA_KEYS
    for key in ("layer", "model4"):
        for name in ("stock", "tide_auto", "tide_nccl_p2p_2x1"):
            rounds = res[key]["variants"][name]["rounds"]
            assert len(rounds) == 2 and all("error" not in r for r in rounds), rounds
        assert res[key]["variants"]["tide_auto"]["rounds"][0]["exact_vs_stock"] is True
    assert "| variant |" in proc.stdout
    # the Markdown report is printed last (it ends with the per-variant device rows)
    assert proc.stdout.rstrip().splitlines()[-1].startswith("- 4 layers tide_nccl_p2p_2x1")


def test_short_error_names_the_error_of_a_spawned_process():
    """A spawned process's error text starts empty and holds the child's traceback: the
    short form is its type and the traceback's last line, not an empty string."""
    raised = ("ProcessRaisedException: \n\n-- Process 3 terminated with the following error:\n"
              "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
              "RuntimeError: NCCL error: out of memory\n")  # fmt: skip
    assert common.short_error(raised, 300) == (
        "ProcessRaisedException: RuntimeError: NCCL error: out of memory"
    )
    assert common.short_error("ValueError: bad\nmore") == "ValueError: bad"
    assert common.short_error("x" * 100, 10) == "xxxxxxx..."
    assert common.short_error(None) is None
