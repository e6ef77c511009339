"""scripts/bench/projection.py: the step-time model on hand-computed inputs, calibration
files, labels and result files (CPU; models on the meta device)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(REPO / "scripts" / "bench"))

import projection as proj

from torchtitan_tide.comm.memory_plan import CommDtypes, GroupShape

GIB_ELEMS_BF16 = 2**29  # elements of one GiB in bf16
DTYPES = CommDtypes(param_bytes=2, reduce_bytes=4, master_bytes=4)
META = {
    "date": "2026-11-30T20:00:00Z",
    "machine": "cpu",
    "hostname": "h",
    "torch": "2.13.0+cpu",
    "nccl": None,
    "cuda": None,
    "commit": "abc1234",
    "world_size": 64,
}


def test_network_per_gpu():
    cluster = proj.Cluster(local_world_size=8, nics_per_node=8, nic_gbps=400)
    assert cluster.net_gibps_per_gpu == pytest.approx(50e9 / 2**30)
    assert cluster.local_for(2) == 2 and cluster.local_for(64) == 8
    with pytest.raises(proj.ProjectionError, match="--gpus 12"):
        cluster.local_for(12)


def test_stock_ring_by_hand():
    # 1 GiB shard, 2 ranks on one node: 1 GiB at 256 GiB/s
    assert proj.stock_collective_ms(GIB_ELEMS_BF16, 2, 2, 2, 256.0, 1.0) == pytest.approx(3.90625)
    # 16 ranks on 2 nodes: 15 GiB at min(240, 8 * 46.6) = 240 GiB/s
    assert proj.stock_collective_ms(GIB_ELEMS_BF16, 16, 8, 2, 240.0, 46.6) == pytest.approx(62.5)
    # a slow network caps the ring at L * net = 80 GiB/s
    assert proj.stock_collective_ms(GIB_ELEMS_BF16, 16, 8, 2, 240.0, 10.0) == pytest.approx(187.5)


def test_tide_phases_by_hand():
    links = proj.Links(nvlink=350.0, nccl_ag_bus=1.0, nccl_rs_bus=1.0, net_per_gpu=50.0)
    # AG, 2 nodes x 8: cross 1 GiB / 50 = 20 ms, then local 7 * 2 GiB / 350 = 40 ms
    assert proj.tide_ag_ms(GIB_ELEMS_BF16, 16, 8, 2, links) == pytest.approx(60.0)
    # RS: max(local 14 GiB / 350 = 40 ms, cross 2 GiB fp32 / 50 = 40 ms)
    assert proj.tide_rs_ms(GIB_ELEMS_BF16, 16, 8, 2, links) == pytest.approx(40.0)
    slow = proj.Links(350.0, 1.0, 1.0, net_per_gpu=25.0)
    assert proj.tide_rs_ms(GIB_ELEMS_BF16, 16, 8, 2, slow) == pytest.approx(80.0)


GROUPS = (
    GroupShape("layers.0", ((2 * GIB_ELEMS_BF16,),), reshard_after_forward=True),
    GroupShape("norm+output", ((2 * GIB_ELEMS_BF16,),), reshard_after_forward=False),
)


def test_comm_times_by_hand():
    links = proj.Links(nvlink=256.0, nccl_ag_bus=256.0, nccl_rs_bus=256.0, net_per_gpu=50.0)
    stock = proj.comm_times(GROUPS, 2, 2, "fsdp2", DTYPES, links)
    # per group: AG 1 GiB / 256 = 3.90625 ms, RS 2 GiB (fp32) / 256 = 7.8125 ms;
    # 3 all-gathers (the second group stays unsharded after forward), 2 reduce-scatters
    assert stock.ag_ms == pytest.approx(3 * 3.90625)
    assert stock.rs_ms == pytest.approx(2 * 7.8125)
    assert stock.edge_ms == pytest.approx(3.90625 + 7.8125)
    tide = proj.comm_times(GROUPS, 2, 2, "tide", DTYPES, links)
    assert tide.ag_ms == pytest.approx(3 * 3.90625)
    assert tide.rs_ms == pytest.approx(2 * 3.90625)  # bf16 reads instead of fp32 on the wire
    tide_ag = proj.comm_times(GROUPS, 2, 2, "tide_ag", DTYPES, links)
    assert (tide_ag.ag_ms, tide_ag.rs_ms) == (tide.ag_ms, stock.rs_ms)


def test_step_model_and_its_inverse():
    comm = proj.CommTimes(ag_ms=30.0, rs_ms=20.0, edge_ms=5.0)
    hidden = proj.step_terms(100.0, comm, 10.0, 4.0, overlap=1.0, interference=0.1)
    assert (hidden.exposed_ms, hidden.interference_ms) == (5.0, pytest.approx(4.5))
    assert hidden.step_ms == pytest.approx(123.5)
    partly = proj.step_terms(100.0, comm, 10.0, 4.0, overlap=0.3, interference=0.1)
    assert partly.exposed_ms == pytest.approx(20.0)  # 5 + (45 - 30)
    assert partly.step_ms == pytest.approx(137.0)
    assert proj.solve_fwd_bwd_ms(123.5, comm, 10.0, 4.0, 1.0, 0.1) == pytest.approx(100.0)
    assert proj.solve_fwd_bwd_ms(137.0, comm, 10.0, 4.0, 0.3, 0.1) == pytest.approx(100.0)
    with pytest.raises(proj.ProjectionError, match="below the model's floor"):
        proj.solve_fwd_bwd_ms(20.0, comm, 10.0, 4.0, 1.0, 0.1)


def _facts(name: str, active: int, ac_mode: str = "none") -> proj.ConfigFacts:
    return proj.ConfigFacts(name, "llama3_tide", GROUPS, DTYPES, active, 8192, ac_mode)


def test_fixed_costs_scale_with_shard_and_unsharded_numel():
    cal = proj.Calibration(optimizer_ms_per_gparam=10.0, layout_ms_per_gparam=5.0)
    # shard numel at W=2: 2 groups x 2^29 = 2^30 elements
    optimizer, layout = _facts("a", 1).fixed_costs_ms(2, "fsdp2", cal)
    assert optimizer == pytest.approx(10 * 2**30 / 1e9)
    assert layout == pytest.approx(5 * 2 * 2**30 / 1e9)
    assert _facts("a", 1).fixed_costs_ms(2, "tide", cal)[1] == 0.0
    tide_ag_layout = _facts("a", 1).fixed_costs_ms(2, "tide_ag", cal)[1]
    assert tide_ag_layout == pytest.approx(11.0 / 18.4 * layout)  # RS copy-in only


def _small_world_projection(cal: proj.Calibration) -> dict:
    facts = {"small": _facts("small", 1000), "big": _facts("big", 1500, ac_mode="full")}
    return proj.run_projection(
        ["big"],
        [8, 16],
        cal,
        proj.Cluster(),
        load=facts.__getitem__,
        model_name_of=lambda name: facts[name].model_name if name in facts else None,
    )


def test_projection_calibrates_on_reference_and_scales_compute():
    ref = proj.Reference("small", 2, {"fsdp2": 400.0})
    result = _small_world_projection(proj.Calibration(references=(ref,)))
    anchor = result["anchors"]["small"]
    assert anchor["projection_step_ms_at_reference"]["fsdp2"] == pytest.approx(400.0)
    big = [r for r in result["projection"] if r["config"] == "big"]
    assert {(r["gpus"], r["mode"]) for r in big} == {(g, m) for g in (8, 16) for m in proj.MODES}
    # 1.5x active params, full AC (4/3): fwd+bwd x2
    assert big[0]["projection_fwd_bwd_ms"] == pytest.approx(2 * anchor["projection_fwd_bwd_ms"])
    for row in result["projection"]:
        assert all(k.startswith("projection_") for k in row if k not in ("config", "gpus", "mode"))
    by_mode = {r["mode"]: r for r in big if r["gpus"] == 16}
    assert by_mode["symm_mem"]["projection_step_ms"] == by_mode["fsdp2"]["projection_step_ms"]
    assert by_mode["tide"]["projection_layout_ms"] == 0.0
    memory = {(r["gpus"], r["mode"]): r for r in result["memory"]}
    assert memory[(16, "fsdp2")]["rs_bytes"] == 2 * 16 * (2 * GIB_ELEMS_BF16 // 16) * 4


def test_no_reference_for_a_model_is_a_named_error():
    with pytest.raises(proj.ProjectionError, match="no calibration reference for big"):
        _small_world_projection(proj.Calibration(references=()))


def test_calibration_files(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(
        json.dumps(
            {
                "source": "my run",
                "bandwidth_gibps": {"nvlink": 300},
                "interference": {"tide": 0.05},
                "overlap": 0.8,
                "references": {"small": {"gpus": 2, "fwd_bwd_ms": 250.0}},
            }
        )
    )
    cal = proj.apply_calibration_file(proj.default_calibration(), path)
    assert (cal.nvlink_gibps, cal.overlap, cal.interference["tide"]) == (300.0, 0.8, 0.05)
    assert cal.interference["fsdp2"] == 0.15
    assert cal.references[0].config == "small" and cal.references[0].fwd_bwd_ms == 250.0
    assert cal.sources["nvlink_gibps"].startswith(f"file: {path}")
    assert cal.sources["nccl_all_gather_bus_gibps"].startswith("default: docs/2026-11-29-h200-facts.md")
    # A recorded bench_step result (fixed sample, not whatever bench/results holds).
    step_json = DATA / "2026-11-30_nvidia-h200-x-2_7334fb3_step_h200x2_qwen3_30b_a3b_4layers.json"
    cal = proj.apply_calibration_file(cal, step_json)
    assert cal.references[0].config == "h200x2_qwen3_30b_a3b_4layers"
    assert cal.references[0].step_ms["fsdp2"] == pytest.approx(505.56, abs=0.01)
    for bad, message in (
        ({"bandwith_gibps": {}}, "unknown key(s) ['bandwith_gibps']"),
        ({"overlap": 1.5}, "overlap = 1.5"),
        ({"references": {"x": {"gpus": 2}}}, "references.x needs"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(proj.ProjectionError) as info:
            proj.apply_calibration_file(cal, path)
        assert message in str(info.value)


def test_outputs_are_labelled_projection(tmp_path):
    ref = proj.Reference("small", 2, {"fsdp2": 400.0})
    cal = proj.Calibration(references=(ref,))
    result = {"metadata": META, **_small_world_projection(cal), "calibration": cal.record([])}
    paths = proj.write_outputs(result, tmp_path)
    stem = tmp_path / "2026-11-30_cpu_abc1234_projection"
    assert paths["json"] == str(stem.with_suffix(".json"))
    saved = json.loads(Path(paths["json"]).read_text())
    assert saved["kind"] == "projection" and saved["metadata"]["commit"] == "abc1234"
    assert all("projection" in t["title"] or "exact" in t["title"] for t in saved["tables"])
    text = Path(paths["markdown"]).read_text()
    assert text.startswith("# Scale projection. Step-time projection (model, not measured)")
    assert "| projection step ms |" in text
    assert "## Memory per rank (exact, memory planner" in text
    charts = proj.charts(result)
    assert all("projection" in c.title for c in charts[:-1])
    assert "exact" in charts[-1].title
    if "png" in paths:  # matplotlib present
        assert Path(paths["png"]).stat().st_size > 0


def test_main_end_to_end(tmp_path, capsys):
    assert (
        proj.main(["--configs", "debug_model", "--gpus", "8,16", "--out-dir", str(tmp_path)]) == 0
    )
    out = capsys.readouterr().out
    assert "wrote json" in out and "wrote markdown" in out
    saved = json.loads(next(tmp_path.glob("*_projection.json")).read_text())
    assert saved["calibration"]["from_files"] is None
    assert saved["anchors"]["h200x2_llama70b_4layers"]["gpus"] == 2
    assert {r["config"] for r in saved["projection"]} == {"debug_model"}
    assert saved["inputs"]["network_gibps_per_gpu"] == pytest.approx(50e9 / 2**30)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "12"], "--gpus 12 is not a multiple of --local-world-size 8"),
        (["--gpus", "1"], "every GPU count must be >= 2"),
        (["--calibration", "/nonexistent.json"], "--calibration /nonexistent.json: no such file"),
        (["--nic-gbps", "0"], "--nic-gbps must be positive"),
    ],
)
def test_main_bad_flags(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        proj.main(["--configs", "debug_model", "--out-dir", str(tmp_path), *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
