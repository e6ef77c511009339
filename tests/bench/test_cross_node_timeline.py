"""bench_cross_node's timeline: the zoom panel finds the window with copies on the put and
fan-out streams, else on the most streams (one GPU shared by every rank: short bursts
between long waits); the fan-out's copy time beside the puts; the PNG is drawn with both
panels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_cross_node as bench


def _lane(stream: int, start: float, dur: float, kind: str = "memcpy") -> dict:
    return {"stream": stream, "kind": kind, "start_ms": start, "end_ms": start + dur}


def test_zoom_window_takes_the_first_burst_on_the_most_streams():
    lanes = [
        _lane(1, 0.0, 0.01),                       # one stream alone
        _lane(2, 10.0, 0.01), _lane(3, 10.05, 0.01),  # two streams
        _lane(7, 10.02, 0.05, "other_kernel"),     # kernels do not count
        _lane(2, 20.0, 0.01), _lane(3, 20.1, 0.01), _lane(4, 20.2, 0.01),  # three
        _lane(2, 30.0, 0.01), _lane(3, 30.1, 0.01), _lane(4, 30.2, 0.01),  # three, later
    ]  # fmt: skip
    assert bench._zoom_window(lanes, 0.3) == pytest.approx((20.0, 20.3))
    assert bench._zoom_window(lanes, 0.06) == pytest.approx((10.0, 10.06))
    assert bench._zoom_window([_lane(7, 0.0, 1.0, "other_kernel")], 0.3) is None


def test_zoom_window_prefers_the_put_and_fan_out_streams():
    """Named put and fan-out streams: the window with copies on both wins over one with
    copies on more streams; without names the most streams win."""
    lanes = [
        _lane(2, 10.0, 0.01), _lane(3, 10.1, 0.01), _lane(4, 10.2, 0.01),  # three others
        _lane(5, 20.0, 0.01), _lane(6, 20.1, 0.01),  # put and fan-out
        _lane(5, 30.0, 0.01), _lane(5, 30.1, 0.01),  # puts only
    ]  # fmt: skip
    assert bench._zoom_window(lanes, 0.3, ("5", "6")) == pytest.approx((20.0, 20.3))
    assert bench._zoom_window(lanes, 0.3) == pytest.approx((10.0, 10.3))


def test_fan_beside_puts_counts_the_time_both_streams_copy():
    """Copy time on the fan-out stream, on the put stream, and both at once: overlapping
    copies of one stream counted once; a kernel on either stream is no copy."""
    names = {"5": "tide_one_sided", "6": "tide_fan", "7": "compute"}
    lanes = [
        _lane(5, 0.0, 1.0), _lane(5, 0.5, 1.0),  # put busy 0.0-1.5
        _lane(6, 1.0, 1.0),                       # fan busy 1.0-2.0: 0.5 beside puts
        _lane(6, 3.0, 0.5), _lane(5, 3.2, 0.1),   # 0.1 beside
        _lane(6, 5.0, 1.0, "other_kernel"), _lane(7, 0.0, 9.0),
    ]  # fmt: skip
    got = bench._fan_beside_puts(lanes, names)
    assert got["put_ms"] == pytest.approx(1.6)
    assert got["fan_ms"] == pytest.approx(1.5)
    assert got["fan_beside_put_ms"] == pytest.approx(0.6)
    assert bench._fan_beside_puts(lanes, {"5": "tide_one_sided"}) == {}  # no fan-out named


def test_timeline_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    lanes = [_lane(2, 10.0, 0.01), _lane(3, 10.05, 0.01), _lane(7, 0.0, 0.2, "other_kernel")]
    path = tmp_path / "timeline.png"
    assert bench._timeline_png(path, lanes, "test")
    assert path.stat().st_size > 1000
    named = tmp_path / "named.png"
    assert bench._timeline_png(named, lanes, "test", {"2": "tide_fan", "3": "tide_one_sided"})
    assert named.stat().st_size > 1000


def test_in_place_compare_adds_both_arena_settings_at_one_rank_per_node():
    names = {v["name"]: v for v in bench._variants("one_node", ["float32"], in_place_compare=True)}
    assert names["tide_one_sided_in_place_fp32_wire"]["ag_in_place_groups"] == 4
    assert names["tide_one_sided_placement_fp32_wire"]["ag_in_place_groups"] == 0
    assert all("ag_in_place_groups" not in v for v in bench._variants("one_node", ["float32"]))
    # emulated nodes over sockets have no windows: nothing to compare
    assert not any("in_place" in v["name"] for v in bench._variants("nodes", ["float32"], True))


def test_in_place_compare_needs_the_windows(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_cross_node.py", "--emulation", "nodes",
                                      "--in-place-compare"])  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert "--in-place-compare: TIDE-AG in place runs on the windows" in capsys.readouterr().err


def test_host_issue_time_is_per_call():
    """Host ms per all-gather counts the bind and the rounds; per reduce the whole reduce."""
    host = {"ag_s": 0.003, "ag_n": 3, "bind_s": 0.003, "rs_s": 0.004, "rs_n": 2}
    timed = bench._host_ms(host)
    assert timed["host_ms_per_ag"] == pytest.approx(2.0)
    assert timed["host_ms_per_rs"] == pytest.approx(2.0)
    assert (timed["all_gathers"], timed["reduces"]) == (3, 2)
    assert bench._host_ms({})["host_ms_per_ag"] == 0.0


def test_result_names_differ_per_layout():
    names = {bench._result_name("one_node", n, l) for n, l in ((2, 1), (4, 1), (2, 2), (3, 1))}
    assert len(names) == 4
    assert bench._result_name("one_node", 2, 1) == "cross_node_one_node"  # the simulator's input
    assert bench._result_name("one_node", 4, 1) == "cross_node_one_node_4x1"


def test_marker_copies_name_the_streams_and_the_lanes_carry_the_names():
    """A profile of one marker copy per stream (``MARKER_BYTES + i`` bytes for the i-th
    name) names the stream numbers; other copies, kernels and a number two names claim are
    left out; the plot labels the step's lanes by them."""
    names = ["compute", "tide_fan", "tide_one_sided"]
    marker = bench.MARKER_BYTES

    def row(name: str, stream: int, nbytes: int | None = None) -> dict:
        args = {"stream": stream} | ({"bytes": nbytes} if nbytes is not None else {})
        return {"name": name, "ts": 1.0, "dur": 1.0, "args": args}

    events = [
        row("Memcpy DtoD (Device -> Device)", 7, marker),
        row("Memcpy DtoD (Device -> Device)", 21, marker + 1),
        row("Memcpy DtoD (Device -> Device)", 22, marker + 2),
        row("Memcpy DtoD (Device -> Device)", 23, marker + 3),  # no such name
        row("Memcpy DtoD (Device -> Device)", 24, 4096),  # not a marker
        row("void at::elementwise_kernel", 25, marker),  # a kernel, not a copy
        row("Memcpy DtoD (Device -> Device)", 30, marker),  # stream 30 claimed twice
        row("Memcpy DtoD (Device -> Device)", 30, marker + 1),
    ]
    got = bench._marker_names(events, names)
    assert got == {"7": "compute", "21": "tide_fan", "22": "tide_one_sided"}
    step = [row("Memcpy PtoP (Device -> Device)", 21, 64), row("Memcpy PtoP", 22, 64),
            row("Memcpy DtoD", 40, 64)]  # fmt: skip
    lanes = bench._copy_lanes(step)
    streams = sorted({str(x["stream"]) for x in lanes})
    assert bench._lane_labels(streams, got) == ["tide_fan (21)", "tide_one_sided (22)",
                                                "stream 40"]  # fmt: skip


def test_sixteen_ranks_on_one_gpu_get_small_nccl_buffers(monkeypatch):
    """From 16 ranks on the GPU the bench adds 1 MiB buffers and 4 channels (2x8 in place ran
    out of GPU memory in ncclSignal without); fewer ranks get nothing, and a variable the
    caller set is left alone."""
    monkeypatch.delenv("NCCL_BUFFSIZE", raising=False)
    monkeypatch.delenv("NCCL_MAX_NCHANNELS", raising=False)
    assert bench._shared_gpu_env(8) == ()
    assert dict(bench._shared_gpu_env(16)) == {"NCCL_BUFFSIZE": "1048576",
                                               "NCCL_MAX_NCHANNELS": "4"}  # fmt: skip
    monkeypatch.setenv("NCCL_BUFFSIZE", "4194304")
    assert dict(bench._shared_gpu_env(16)) == {"NCCL_MAX_NCHANNELS": "4"}
