"""The step simulator's event model on hand-made cases (pure Python, no GPUs): the exposed
first all-gather, one communicator serializing all-gather and reduce-scatter, a slow
layer, TIDE-RS's pipelined phases and its run-ahead bound, interference; cluster files;
the committed validation rows; the CLI."""

from __future__ import annotations

import json

import pytest

from torchtitan_tide import simulate as sim
from torchtitan_tide.comm.memory_plan import CommDtypes, GroupShape
from torchtitan_tide.simulate_engine import Op, SimulationError, simulate, summarize

GIB_BF16 = 2**29  # elements of one GiB in bf16
DTYPES = CommDtypes(param_bytes=2, reduce_bytes=4, master_bytes=4)


def _by_name(spans):
    return {s.op.name: s for s in spans}


def test_first_all_gather_is_exposed_the_next_hides():
    ops = [
        Op("g0.ag", "nccl", 4.0, "ag"),
        Op("g0.fwd", "compute", 10.0, after=("g0.ag",)),
        Op("g1.ag", "nccl", 4.0, "ag", issued_with=("g0.fwd",)),
        Op("g1.fwd", "compute", 10.0, after=("g1.ag",)),
    ]
    spans = _by_name(simulate(ops))
    assert spans["g0.fwd"].start_ms == pytest.approx(4.0)
    assert spans["g1.ag"].start_ms == pytest.approx(4.0)  # issued as g0's forward starts
    assert spans["g1.fwd"].start_ms == pytest.approx(14.0)  # its AG hid behind g0
    fig = summarize(list(spans.values()))
    assert fig["step_ms"] == pytest.approx(24.0)
    assert fig["exposed_first_ms"] == pytest.approx(4.0)
    assert fig["exposed_ms"] == pytest.approx(4.0)


def test_one_communicator_serializes_all_gather_behind_reduce_scatter():
    base = [
        Op("g2.bwd", "compute", 5.0),
        Op("g2.rs", "nccl", 8.0, "rs", after=("g2.bwd",)),
        Op("g1.ag", "nccl", 3.0, "ag", issued_with=("g2.bwd",)),  # queued after the RS
        Op("g1.bwd", "compute", 5.0, after=("g1.ag",)),
    ]
    spans = _by_name(simulate(base))
    assert spans["g1.ag"].start_ms == pytest.approx(13.0)  # waits for the RS on its stream
    assert spans["g1.bwd"].start_ms == pytest.approx(16.0)
    # the same ops with the AG on its own stream: no wait
    own = [op if op.name != "g1.ag" else Op("g1.ag", "ce", 3.0, "ag", issued_with=("g2.bwd",))
           for op in base]  # fmt: skip
    assert _by_name(simulate(own))["g1.bwd"].start_ms == pytest.approx(5.0)


def test_interference_slows_compute_beside_reduce_scatter():
    ops = [
        Op("rs", "nccl", 4.0, "rs"),
        Op("gemm", "compute", 10.0, slowdown={"rs": 0.5}),
    ]
    spans = _by_name(simulate(ops))
    # 4 ms at 1/1.5 (2.667 ms of work), then 7.333 ms alone
    assert spans["gemm"].end_ms == pytest.approx(4.0 + 10.0 - 4.0 / 1.5)
    assert spans["gemm"].lost_ms == pytest.approx(4.0 - 4.0 / 1.5)
    assert summarize(list(spans.values()))["sm_ms_taken"] == pytest.approx(4.0 - 4.0 / 1.5)


def test_cycles_and_unknown_dependencies_are_errors():
    with pytest.raises(SimulationError, match="unknown op"):
        simulate([Op("a", "compute", 1.0, after=("nope",))])
    with pytest.raises(SimulationError, match="wait on each other"):
        simulate([Op("a", "compute", 1.0, after=("b",)), Op("b", "nccl", 1.0, after=("a",))])


def _inputs(compute: dict[str, tuple[float, float]], ag=1.0, rs=1.0, **kw) -> sim.Inputs:
    bw = {m: {"ag": ag, "rs": rs} for m in ("fsdp2", "symm_mem", "tide", "tide_ag")}
    zero = {m: {"ag": 0.0, "rs": 0.0} for m in bw}
    return sim.Inputs(
        compute={k: sim.GroupCompute(*v) for k, v in compute.items()},
        root_fwd_ms=0.0, root_bwd_ms=0.0, optimizer_ms_per_shard_elem=0.0, host_ms=0.0,
        bandwidth_gibps=bw, interference=kw.get("interference", zero), layout_ns={},
        shape_class=sim.LARGE,
    )  # fmt: skip


def _groups(n: int, numel: int = GIB_BF16, reshard: bool = False) -> list[GroupShape]:
    return [GroupShape(f"layers.{i}", ((numel,),), reshard) for i in range(n)]


def test_slow_layer_exposes_the_next_all_gather():
    # W = 2, 1 GiB bf16 per group -> 0.5 GiB shard; stock AG = 1 x 0.5 GiB at 1 GiB/s = 500 ms
    groups = _groups(3)
    fast = _inputs({"layers.0": (1000, 0), "layers.1": (1000, 0), "layers.2": (1000, 0)}, rs=1e9)
    slow = _inputs({"layers.0": (1000, 0), "layers.1": (200, 0), "layers.2": (1000, 0)}, rs=1e9)
    lay = sim.Layout(2, 2)
    fig_fast, _ = sim.simulate_step(groups, fast, "fsdp2", lay, sim.Cluster(), DTYPES)
    fig_slow, spans = sim.simulate_step(groups, slow, "fsdp2", lay, sim.Cluster(), DTYPES)
    assert fig_fast["exposed_first_ms"] == pytest.approx(500.0)
    assert fig_fast["exposed_between_ms"] == pytest.approx(0.0, abs=1e-6)
    # layer 1 (200 ms) is shorter than layer 2's 500 ms all-gather: 300 ms exposed
    assert fig_slow["exposed_between_ms"] == pytest.approx(300.0)
    assert _by_name(spans)["layers.2.fwd"].start_ms == pytest.approx(500 + 1000 + 500)


def test_tide_rs_phases_pipeline_across_groups():
    # 16 GPUs = 2 nodes x 8; per group shard S = 2^29 / 16 elements; no compute, so the
    # four reduce-scatters queue at once
    groups = _groups(4)
    s = GIB_BF16 // 16
    cluster = sim.Cluster(gpus_per_node=8, nic_gbps_per_gpu=2**30 * 8 / 1e9)  # 1 GiB/s
    inputs = _inputs({g.name: (0.0, 0.0) for g in groups}, ag=1e9, rs=100.0)
    lay = sim.Layout(16, 8)
    local = 1e3 * 7 * 2 * s * 2 / (100 * 2**30)  # (L-1) N S b_grad at 100 GiB/s
    cross = 1e3 * 1 * s * 4 / 2**30  # (N-1) S fp32 at 1 GiB/s
    _, spans = sim.simulate_step(groups, inputs, "tide", lay, cluster, DTYPES, rs_inflight=4)
    by = _by_name(spans)
    assert by["layers.3.rs"].op.duration_ms == pytest.approx(local)
    assert by["layers.3.rs_net"].op.duration_ms == pytest.approx(cross)
    # phase 1 of the next group runs while phase 2 of the previous one is in flight:
    # the last partial lands after one local phase + four cross-node phases, not 4 x both
    assert by["layers.2.rs"].start_ms < by["layers.3.rs_net"].end_ms
    last = max(s.end_ms for s in spans if s.op.name.endswith("rs_net"))
    assert last == pytest.approx(by["layers.3.rs"].start_ms + local + 4 * cross)
    # [tide] rs_wire_dtype = "bfloat16": half the cross-node bytes, half the time
    _, bf16 = sim.simulate_step(groups, inputs, "tide", lay, cluster, DTYPES, 4, rs_wire_bytes=2)
    assert _by_name(bf16)["layers.3.rs_net"].op.duration_ms == pytest.approx(cross / 2)


def test_tide_rs_run_ahead_bound_waits_for_partials():
    # slow network: with K = 1 partial in flight, phase 1 of group j waits for phase 2 of j+1
    groups = _groups(3)
    cluster = sim.Cluster(gpus_per_node=8, nic_gbps_per_gpu=0.01)
    inputs = _inputs({g.name: (0.0, 1.0) for g in groups}, ag=1e9, rs=1e9)
    lay = sim.Layout(16, 8)
    _, k1 = sim.simulate_step(groups, inputs, "tide", lay, cluster, DTYPES, rs_inflight=1)
    _, k2 = sim.simulate_step(groups, inputs, "tide", lay, cluster, DTYPES, rs_inflight=2)
    k1, k2 = _by_name(k1), _by_name(k2)
    assert k1["layers.1.rs"].start_ms == pytest.approx(k1["layers.2.rs_net"].end_ms)
    assert k2["layers.1.rs"].start_ms < k2["layers.2.rs_net"].end_ms
    assert k2["layers.0.rs"].start_ms == pytest.approx(k2["layers.2.rs_net"].end_ms)


def test_backward_regather_for_resharded_groups_only():
    groups = [*_groups(2, reshard=True), GroupShape("norm+output", ((GIB_BF16,),), False)]
    inputs = _inputs({g.name: (10.0, 20.0) for g in groups}, rs=1e9)
    _, spans = sim.simulate_step(groups, inputs, "fsdp2", sim.Layout(2, 2), sim.Cluster(), DTYPES)
    names = {s.op.name for s in spans}
    assert {"layers.0.bwd.ag", "layers.1.bwd.ag"} <= names
    assert "norm+output.bwd.ag" not in names
    by = _by_name(spans)
    assert by["optimizer"].start_ms >= max(by[f"{g.name}.rs"].end_ms for g in groups)


def test_stock_ring_and_hierarchical_by_hand():
    gib = 2**30
    assert sim.stock_ms(gib, sim.Layout(2, 2), 256.0, 1.0) == pytest.approx(1e3 / 256)
    # 16 ranks on 2 nodes: 15 GiB at min(240, 8 x 10) = 80 GiB/s
    assert sim.stock_ms(gib, sim.Layout(16, 8), 240.0, 10.0) == pytest.approx(15e3 / 80)
    cross, local = sim.hierarchical_ms(gib, sim.Layout(16, 8), 350.0, 50.0)
    assert cross == pytest.approx(1e3 / 50) and local == pytest.approx(14e3 / 350)


def test_cluster_file(tmp_path):
    assert sim.load_cluster(None).gpus_per_node == 8
    good = tmp_path / "c.toml"
    good.write_text(
        "[cluster]\ngpus_per_node = 4\nnic_gbps_per_gpu = 200\nnccl_hierarchical_ag = true\n"
    )
    c = sim.load_cluster(good)
    assert (c.gpus_per_node, c.nccl_hierarchical_ag) == (4, True)
    assert c.net_gibps == pytest.approx(200e9 / 8 / 2**30)
    bad = tmp_path / "b.toml"
    bad.write_text("[cluster]\nnic_gbps = 1\n")
    with pytest.raises(sim.SimulateError, match="unknown key"):
        sim.load_cluster(bad)
    for name in ("h200_8x400g", "h200_8x400g_nccl2307", "h200_8x200g"):
        sim.load_cluster(sim.REPO / "train_configs" / "clusters" / f"{name}.toml")


def test_validation_rows_carry_their_keys_and_explain_misses():
    from torchtitan_tide.simulate_report import validation_rows

    rows = validation_rows(sim.RESULTS, sim.Cluster())
    modes = {(r["config"], r["mode"]) for r in rows}
    assert len([m for m in modes if m[1] in sim.MODES]) == 12  # 3 configs x 4 modes
    for r in rows:
        assert {"config", "mode", "simulated_step_ms", "measured_step_ms"} <= set(r)
        assert r["within_5pct"] or r["missing"] not in ("", "not explained"), r


def test_cli_prints_rows_and_sources(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert (
        sim.main(["--config", "h200x2_llama70b_4layers", "--gpus", "16", "--json", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert "SIMULATION" in text and "| tide |" in text and "compute: trace" in text
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} == set(sim.MODES) and rows[0]["nodes"] == 2
    with pytest.raises(SystemExit):
        sim.main(["--config", "h200x2_llama70b_4layers", "--gpus", "12"])  # not whole nodes


def test_inputs_fall_back_to_flops_when_the_trace_has_other_layers():
    from torchtitan_tide.plan import load_config_model

    cm = load_config_model("debug_model")  # llama3_tide, but not the 70B layer of the trace
    inputs = sim.build_inputs(cm, sim.RESULTS, None, mfu=0.5)
    assert "trace_not_used" in inputs.sources and inputs.sources["compute"].startswith("FLOPs")
    layer = inputs.compute["layers.0"]
    assert layer.bwd_ms == pytest.approx(2 * layer.fwd_ms)  # no activation checkpointing
    assert inputs.optimizer_ms_per_shard_elem > 0


def test_host_time_drops_the_loss_read_when_logging_every_n_steps():
    every, _ = sim.host_ms({"metrics": {"log_freq": 1}}, "h200x2_qwen3_30b_a3b_4layers")
    tenth, text10 = sim.host_ms({"metrics": {"log_freq": 10}}, "h200x2_qwen3_30b_a3b_4layers")
    assert every == pytest.approx(29.5) and tenth == pytest.approx(29.5 - (199.8 - 173.7))
    assert "loss read" in text10 and sim.host_ms({}, "unknown")[0] == 0.0


def test_stream_picture_marks_the_exposed_first_all_gather(tmp_path):
    from torchtitan_tide import simulate_report

    pytest.importorskip("matplotlib")
    path = tmp_path / "streams.png"
    assert simulate_report.draw_streams(
        path, "h200x2_llama70b_4layers", 2, sim.Cluster(), sim.RESULTS
    )
    assert path.stat().st_size > 10_000
    result = sim.simulate_config("h200x2_llama70b_4layers", 2, ["fsdp2"], sim.Cluster())
    exposed = simulate_report.exposed_intervals(result["spans"]["fsdp2"])
    assert exposed[0][0] == pytest.approx(0.0)  # the first all-gather, before any compute
    total = sum(b - a for a, b in exposed)
    assert total == pytest.approx(result["rows"][0]["sim_exposed_ms"])
