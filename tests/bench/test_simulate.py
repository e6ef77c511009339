"""The step simulator on hand-made cases (pure Python, no GPUs): the exposed first
all-gather, one communicator serializing all-gather and reduce-scatter, a slow layer,
TIDE-RS's pipelined phases, its accumulate kernels and its run-ahead bound, interference
in both directions, symm_mem's NCCL generations, TIDE's cross-node options; cluster
files; the inputs and their sources; the committed validation rows; the CLI; the
package's import order."""

from __future__ import annotations

import json

import pytest

from torchtitan_tide.comm.plans.memory_plan import CommDtypes, GroupShape
from torchtitan_tide.comm.plans.window_rounds import RS_PIECE_BYTES
from torchtitan_tide.simulator import cli, cluster, inputs, network, report
from torchtitan_tide.simulator import step as sim
from torchtitan_tide.simulator.engine import Op, SimulationError, simulate, summarize
from torchtitan_tide.simulator.network import NET_STEP_US, NVLINK_STEP_US

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


def test_a_run_of_alike_ops_gets_each_op_its_own_span():
    """Consecutive ops of a stream that progress alike run as one unit (engine._runs); each
    op still gets the span it would have alone: here a, b, c (2 ms each) share a link with
    x from 1 ms on, so a ends at 3, b and x at 7, c at 9; the same when another op waits for
    b (no run)."""
    from torchtitan_tide.simulator.engine import _check, _runs

    ops = [Op("a", "s", 2.0, "ce", link="L"), Op("b", "s", 2.0, "ce", after=("a",), link="L"),
           Op("c", "s", 2.0, "ce", after=("b",), link="L"), Op("w", "t", 1.0, "ce"),
           Op("x", "t", 3.0, "ce", link="L")]  # fmt: skip
    assert len(_runs(ops, _check(ops))[0]) == 3  # a, b, c as one
    want = {"a": (0, 3), "b": (3, 7), "c": (7, 9), "w": (0, 1), "x": (1, 7)}
    for case in (ops, [*ops, Op("y", "u", 1.0, after=("b",))]):
        got = {s.op.name: (s.start_ms, s.end_ms) for s in simulate(case)}
        for name, (start, end) in want.items():
            assert got[name] == (pytest.approx(start), pytest.approx(end)), name


def test_every_device_slows_and_links_its_own():
    """Ops carry their GPU (local rank): compute of rank 1 is not slowed by rank 0's
    collective, rank 0's is; a link belongs to one device."""
    ops = [Op("rs", "nccl", 4.0, "rs"),
           Op("gemm", "compute", 10.0, slowdown={"rs": 0.5}),
           Op("gemm@1", "compute@1", 10.0, slowdown={"rs": 0.5}, device=1)]  # fmt: skip
    by = _by_name(simulate(ops))
    assert by["gemm"].end_ms == pytest.approx(4.0 + 10.0 - 4.0 / 1.5)
    assert by["gemm@1"].end_ms == pytest.approx(10.0)
    with pytest.raises(SimulationError, match="belongs to device 0"):
        simulate([Op("p", "a", 1.0, "nic", link="nic"), Op("q", "b", 1.0, "nic", link="nic",
                                                           device=1)])  # fmt: skip


def _inputs(compute: dict[str, tuple[float, float]], ag=1.0, rs=1.0, **kw) -> inputs.Inputs:
    """Hand-made inputs: every mode's transports at ``ag`` / ``rs`` GiB/s, no cast, no
    layout copies; ``engines``: (f, g) per engine (default: no interference)."""
    bw = {m: {"ag": ag, "rs": rs} for m in inputs.MODES}
    return inputs.Inputs(
        compute={k: inputs.GroupCompute(*v) for k, v in compute.items()},
        root_fwd_ms=0.0, root_bwd_ms=0.0, optimizer_ms_per_shard_elem=0.0, host_ms=0.0,
        transport_gibps=bw, layout_ns={}, shape_class=inputs.LARGE,
        engines=kw.get("engines", {}), accumulate_gibps=kw.get("accumulate_gibps", 0.0),
        copy_gibps=kw.get("copy_gibps", 0.0),
    )  # fmt: skip


def _groups(n: int, numel: int = GIB_BF16, reshard: bool = False) -> list[GroupShape]:
    return [GroupShape(f"layers.{i}", ((numel,),), reshard) for i in range(n)]


def test_slow_layer_exposes_the_next_all_gather():
    # W = 2, 1 GiB bf16 per group -> 0.5 GiB shard; stock AG = 1 x 0.5 GiB at 1 GiB/s = 500 ms
    # (+ NCCL's latency, 11.8 us: below the tolerance)
    groups = _groups(3)
    fast = _inputs({"layers.0": (1000, 0), "layers.1": (1000, 0), "layers.2": (1000, 0)}, rs=1e9)
    slow = _inputs({"layers.0": (1000, 0), "layers.1": (200, 0), "layers.2": (1000, 0)}, rs=1e9)
    lay = sim.Layout(2, 2)
    fig_fast, _ = sim.simulate_step(groups, fast, "fsdp2", lay, cluster.Cluster(), DTYPES)
    fig_slow, spans = sim.simulate_step(groups, slow, "fsdp2", lay, cluster.Cluster(), DTYPES)
    assert fig_fast["exposed_first_ms"] == pytest.approx(500.0, abs=0.02)
    assert fig_fast["exposed_between_ms"] == pytest.approx(0.0, abs=1e-6)
    # layer 1 (200 ms) is shorter than layer 2's 500 ms all-gather: 300 ms exposed
    assert fig_slow["exposed_between_ms"] == pytest.approx(300.0, abs=0.02)
    assert _by_name(spans)["layers.2.fwd"].start_ms == pytest.approx(500 + 1000 + 500, abs=0.05)


def _phase2(by: dict, group: str) -> list:
    """The spans of TIDE-RS phase 2 of ``group`` on local rank 0 (its ring steps or
    send/recv)."""
    return sorted((sp for n, sp in by.items() if n.startswith(f"{group}.rs.") and ".p2" in n
                   and sp.op.device == 0), key=lambda sp: sp.start_ms)  # fmt: skip


def _phase1(by: dict, group: str) -> list:
    return sorted((sp for n, sp in by.items() if n.startswith(f"{group}.rs.") and ".p2" not in n
                   and not n.endswith("_issue") and sp.op.device == 0),
                  key=lambda sp: sp.start_ms)  # fmt: skip


def test_tide_rs_phases_pipeline_across_groups():
    # 16 GPUs = 2 nodes x 8 on NCCL 2.31: TIDE-RS phase 1 on NCCL windows (rs_round_ops),
    # phase 2 on the one-sided ring (ring_step_ops, the partial in pieces of at most
    # RS_PIECE_BYTES, run as one op: nothing is waited between them) over a slow NIC; no
    # compute, so the four reduce-scatters queue at once; accumulate kernels free
    groups = _groups(4)
    s = GIB_BF16 // 16
    clu = cluster.Cluster(gpus_per_node=8, nic_gbps_per_gpu=2**30 * 8 / 1e9, nccl_version="2.31.2")
    ins = _inputs({g.name: (0.0, 0.0) for g in groups}, ag=1e9, rs=100.0, copy_gibps=1e9)
    lay = sim.Layout(16, 8)
    tide = sim.TideModel(rs_inflight=4, rs_rows=8, slot_reuse=False)
    _, spans = sim.simulate_step(groups, ins, "tide", lay, clu, DTYPES, tide)
    by = _by_name(spans)
    puts = [sp for sp in _phase2(by, "layers.3") if sp.op.name.endswith(".Put")]
    assert len(puts) == 1 and puts[0].op.kind == "nic" and puts[0].op.stream == "tide_rs_cross"
    nic = network.nic_gibps(clu.net_gibps)
    pieces = -(-s * 4 // RS_PIECE_BYTES)
    cross = 1e3 * s * 4 / (nic * 2**30) + pieces * NET_STEP_US / 1e3  # one fp32 partial
    assert pieces > 1 and puts[0].op.duration_ms == pytest.approx(cross)
    assert {sp.op.stream for sp in _phase1(by, "layers.3")} <= {"rs_local", "tide_fan"}
    # phase 1 of the next group runs while phase 2 of the previous one is in flight
    assert _phase1(by, "layers.2")[0].start_ms < _phase2(by, "layers.3")[-1].end_ms
    # bf16 partials on the wire: half the bytes
    bf16 = sim.TideModel(rs_inflight=4, rs_rows=8, slot_reuse=False, rs_wire_bytes=2)
    by2 = _by_name(sim.simulate_step(groups, ins, "tide", lay, clu, DTYPES, bf16)[1])
    put2 = next(sp for sp in _phase2(by2, "layers.3") if sp.op.name.endswith(".Put"))
    step = NET_STEP_US / 1e3
    assert put2.op.duration_ms == pytest.approx((cross - pieces * step) / 2
                                                + -(-s * 2 // RS_PIECE_BYTES) * step)  # fmt: skip


def test_tide_rs_run_ahead_bound_waits_for_partials():
    # slow network: with K = 1 partial in flight, phase 1 of group j waits for phase 2 of
    # group j+1 (the ring's one send region); with K = 2 it does not
    groups = _groups(3)
    clu = cluster.Cluster(gpus_per_node=8, nic_gbps_per_gpu=0.01)
    ins = _inputs({g.name: (0.0, 1.0) for g in groups}, ag=1e9, rs=1e9, copy_gibps=1e9)
    lay = sim.Layout(16, 8)
    one, two = (sim.TideModel(rs_inflight=k, slot_reuse=False, cross_node_transport="p2p")
                for k in (1, 2))  # fmt: skip
    k1 = _by_name(sim.simulate_step(groups, ins, "tide", lay, clu, DTYPES, one)[1])
    k2 = _by_name(sim.simulate_step(groups, ins, "tide", lay, clu, DTYPES, two)[1])

    def other_chunk(by, g):  # phase 1 of the other node's chunk (the one with a partial)
        return next(sp for sp in _phase1(by, g) if ".c1r0" in sp.op.name)

    assert other_chunk(k1, "layers.1").start_ms >= _phase2(k1, "layers.2")[-1].end_ms - 1e-9
    assert other_chunk(k2, "layers.1").start_ms < _phase2(k2, "layers.2")[-1].end_ms


def test_accumulate_kernels_take_compute_time_by_their_share():
    ops = [
        Op("acc", "side", 4.0, "sm", sm_share=1.0),
        Op("gemm", "compute", 10.0),
    ]
    spans = _by_name(simulate(ops))
    assert spans["gemm"].end_ms == pytest.approx(14.0)  # paused while the kernel held the SMs
    fig = summarize(list(spans.values()))
    assert fig["sm_ms_taken"] == pytest.approx(4.0) and fig["sm_kernel_ms"] == pytest.approx(4.0)
    half = _by_name(simulate([Op("acc", "side", 4.0, "sm", sm_share=0.5), ops[1]]))
    assert half["gemm"].end_ms == pytest.approx(12.0)
    with pytest.raises(SimulationError, match="sm_share"):
        simulate([Op("x", "side", 1.0, "rs", sm_share=0.5)])
    with pytest.raises(SimulationError, match="beside compute"):
        simulate([Op("x", "compute", 1.0, "sm", sm_share=0.5)])
    # a zero-SM cross-node phase alone counts as exposed communication
    idle = summarize(simulate([Op("put", "rs_net", 3.0, "net0"), Op("opt", "compute", 1.0,
                                                                     "optimizer", after=("put",))]))  # fmt: skip
    assert idle["exposed_ms"] == pytest.approx(3.0)


def test_collective_slowed_beside_compute():
    ops = [
        Op("ag", "nccl", 4.0, "ag", slowdown={"compute": 1.0}),
        Op("gemm", "compute", 2.0),
    ]
    spans = _by_name(simulate(ops))
    # 2 ms beside the GEMM at half rate (1 ms of work), then 3 ms alone
    assert spans["ag"].end_ms == pytest.approx(5.0)
    assert summarize(list(spans.values()))["comm_slowed_ms"] == pytest.approx(1.0)


def test_tide_accumulate_ops_by_hand_on_the_tide_stream_under_slot_reuse():
    # 2 GPUs, one node (copy engine): phase 1 reads 2 bf16 rows and writes fp32, 8 B per
    # shard element
    groups = _groups(2)
    s = GIB_BF16 // 2
    engines = {"sm_rs": (0.25, 0.0)}  # compute at 1 / 1.25 while an accumulate kernel runs
    ins = _inputs({g.name: (0.0, 50.0) for g in groups}, ag=1e9, rs=1e9, accumulate_gibps=4.0,
                  engines=engines)  # fmt: skip
    lay = sim.Layout(2, 2)
    _, spans = sim.simulate_step(groups, ins, "tide", lay, cluster.Cluster(), DTYPES)
    by = _by_name(spans)
    acc, push = by["layers.1.rs.c0r0_acc"], by["layers.1.rs.c0r0_push"]
    assert acc.op.duration_ms == pytest.approx(1e3 * 8 * s / (4.0 * 2**30))
    assert acc.op.stream == push.op.stream == "tide"
    assert acc.op.kind == "sm_rs" and push.op.kind == "ce"
    # the kernel of layers.1 (500 ms) runs beside layers.0's backward: 1/1.25 of the
    # time they overlap is lost
    bwd = by["layers.0.bwd"]
    overlap = min(bwd.end_ms, acc.end_ms) - max(bwd.start_ms, acc.start_ms)
    assert acc.op.duration_ms > 100 and overlap > 40
    assert bwd.end_ms - bwd.start_ms == pytest.approx(50.0 + overlap * 0.25 / 1.25)
    # 8 per node, 2 rows per round (4 rounds per chunk), 2 nodes, windows (NCCL 2.31): the
    # rounds' Accumulate ops read 2 bf16 rows and read + write the fp32 target (the first
    # round of a chunk only writes it)
    lay16 = sim.Layout(16, 8)
    new = cluster.Cluster(nccl_version="2.31.2")
    by16 = _by_name(sim.simulate_step(groups, ins, "tide", lay16, new, DTYPES)[1])
    s16 = GIB_BF16 // 16
    assert by16["layers.1.rs.c0r0.17.Accumulate"].op.duration_ms == pytest.approx(
        1e3 * (2 * 2 * s16 + 4 * s16) / (4.0 * 2**30))
    assert by16["layers.1.rs.c0r1.17.Accumulate"].op.duration_ms == pytest.approx(
        1e3 * (2 * 2 * s16 + 8 * s16) / (4.0 * 2**30))


def test_symm_mem_generations_and_tide_transports():
    groups = _groups(2, reshard=True)
    engines = {e: (0.5, 0.0) for e in ("nccl", "nccl_symk", "ce")}
    ins = _inputs({g.name: (10.0, 20.0) for g in groups}, engines=engines, copy_gibps=100.0)
    lay = sim.Layout(16, 8)
    old = cluster.Cluster(nccl_version="2.28.9")
    new = cluster.Cluster(nccl_version="2.31.2")
    assert not old.hierarchical_ag and new.hierarchical_ag and new.hierarchical_rs
    names_old = {
        s.op.name: s.op for s in sim.simulate_step(groups, ins, "symm_mem", lay, old, DTYPES)[1]
    }
    names_new = {
        s.op.name: s.op for s in sim.simulate_step(groups, ins, "symm_mem", lay, new, DTYPES)[1]
    }
    s = GIB_BF16 // 16
    nic = network.nic_gibps(old.net_gibps)
    assert names_old["layers.0.rs"].duration_ms == pytest.approx(network.ring_ms(s * 4, lay, 1.0,
                                                                                 nic))  # fmt: skip
    assert names_old["layers.0.rs"].kind == "nccl"  # NCCL 2.28.9 across nodes: the ring
    # NCCL >= 2.30.7: node-local and cross-node phases pipelined in one collective
    cross = network.message_ms(s * 4, nic, 1, NET_STEP_US)
    local = network.message_ms(7 * 2 * s * 4, 1.0, 1, NVLINK_STEP_US)
    assert names_new["layers.0.rs"].duration_ms == pytest.approx(max(cross, local))
    assert (
        names_new["layers.0.rs"].stream == "nccl" and names_new["layers.0.rs"].kind == "nccl_symk"
    )
    assert names_new["layers.0.fwd.ag"].kind == "ce"  # zero-SM hierarchical all-gather
    # TIDE: on NCCL 2.28.9 auto runs the copy engine with send/recv kernels across nodes
    # (they slow compute like NCCL kernels); on 2.31 NCCL windows and one-sided puts
    p2p = {s.op.name: s.op for s in sim.simulate_step(groups, ins, "tide", lay, old, DTYPES)[1]}
    win = {s.op.name: s.op for s in sim.simulate_step(groups, ins, "tide", lay, new, DTYPES)[1]}
    assert {op.kind for n, op in p2p.items() if n.endswith("_sendrecv")} == {"nccl"}
    assert {op.stream for n, op in p2p.items() if n.endswith("_sendrecv")} == {"nccl_p2p"}
    assert p2p["layers.0.fwd"].slowdown["nccl"] == 0.5
    assert not [op for op in win.values() if op.kind == "nccl"]
    assert {op.kind for n, op in win.items() if n.endswith(".Put")} == {"nic", "ce"}
    # the config's [tide] options choose; a forced option that cannot run is named
    from types import SimpleNamespace

    cfg = SimpleNamespace(rs_inflight=2, rs_rows=2, slot_reuse=True)
    for chosen in ("nccl_one_sided", "auto", "p2p"):
        model = sim.tide_model_of(SimpleNamespace(**vars(cfg), cross_node_transport=chosen))
        assert model.cross_node_transport == chosen
    assert sim.tide_model_of(cfg, cross_node="p2p", transport="copy_engine").ag_transport == (
        "copy_engine")
    assert sim.tide_run(sim.TideModel(cross_node_transport="p2p"), new, lay, DTYPES).transport == (
        "copy_engine")
    with pytest.raises(inputs.SimulateError, match="cross_node_transport"):
        sim.TideModel(cross_node_transport="rdma")
    with pytest.raises(inputs.SimulateError, match="nccl_windows"):
        sim.tide_run(sim.TideModel(ag_transport="nccl_windows"), old, lay, DTYPES)


def test_backward_regather_for_resharded_groups_only():
    groups = [*_groups(2, reshard=True), GroupShape("norm+output", ((GIB_BF16,),), False)]
    ins = _inputs({g.name: (10.0, 20.0) for g in groups}, rs=1e9)
    _, spans = sim.simulate_step(groups, ins, "fsdp2", sim.Layout(2, 2), cluster.Cluster(), DTYPES)
    names = {s.op.name for s in spans}
    assert {"layers.0.bwd.ag", "layers.1.bwd.ag"} <= names
    assert "norm+output.bwd.ag" not in names
    by = _by_name(spans)
    assert by["optimizer"].start_ms >= max(by[f"{g.name}.rs"].end_ms for g in groups)


def test_ring_by_hand_with_nccl_latency_and_the_nics():
    gib = 2**30
    two = network.Layout(2, 2)
    assert network.ring_ms(gib, two, 256.0, 1.0) == pytest.approx(1e3 / 256 + (8.4 + 3.4) / 1e3)
    # 16 ranks on 2 nodes: 15 GiB at 8 x 10 GiB/s (the NICs, not the measured 240); 14
    # NVLink + 1 network step
    lay = network.Layout(16, 8)
    latency = (8.4 + 14 * 3.4 + 9.6) / 1e3
    assert network.ring_latency_ms(lay) == pytest.approx(latency)
    assert network.ring_ms(gib, lay, 240.0, 10.0) == pytest.approx(15e3 / 80 + latency)
    assert network.nic_gibps(50.0) == pytest.approx(46.0)


def test_cluster_file(tmp_path):
    assert cluster.load_cluster(None).gpus_per_node == 8
    good = tmp_path / "c.toml"
    good.write_text(
        '[cluster]\ngpus_per_node = 4\nnic_gbps_per_gpu = 200\nnccl_version = "2.30.7"\n'
    )
    c = cluster.load_cluster(good)
    assert (c.gpus_per_node, c.hierarchical_ag) == (4, True)
    assert c.net_gibps == pytest.approx(200e9 / 8 / 2**30)
    for text, match in (("nic_gbps = 1", "unknown key"), ("nccl_hierarchical_ag = true", "nccl_version"),
                        ('nccl_version = "two"', "MAJOR")):  # fmt: skip
        bad = tmp_path / "b.toml"
        bad.write_text(f"[cluster]\n{text}\n")
        with pytest.raises(cluster.ClusterError, match=match):
            cluster.load_cluster(bad)
    for name in ("h200_8x400g", "h200_8x400g_nccl231", "h200_8x200g"):
        cluster.load_cluster(inputs.REPO / "train_configs" / "clusters" / f"{name}.toml")


def test_inputs_name_their_sources_and_charge_each_part_once():
    from torchtitan_tide.fsdp_groups import load_config_model

    cm = load_config_model("h200x2_qwen3_30b_a3b_4layers")
    ins = inputs.build_inputs(cm, inputs.RESULTS, None, 0.4)
    for key in ("compute", "optimizer", "host", "transport", "interference", "accumulate",
                "layout", "cross_node", "copy", "class_weights"):  # fmt: skip
        assert ".json" in ins.sources[key] or key in ("host", "class_weights"), (
            key,
            ins.sources[key],
        )
    assert 3000 < ins.accumulate_gibps < 4500 and 500 < ins.copy_gibps < 600  # local_batch_ce
    # transports from their own device time: stock's NCCL kernels faster than the call
    assert ins.transport_gibps["fsdp2"]["ag"] > 155.1 and ins.transport_gibps["fsdp2"]["rs"] > 186.5
    assert all(ins.sm_ns[m]["cast"] > 0 for m in ("fsdp2", "symm_mem", "tide"))
    assert ins.sm_ns["symm_mem"]["divide"] > 0 == ins.sm_ns["fsdp2"]["divide"]
    assert set(ins.class_weights) == {"large", "attention", "grouped_experts"}
    assert sum(ins.class_weights.values()) == pytest.approx(1.0)
    rows = {(r["engine"], r["compute_class"]): r for r in ins.figures}
    assert rows[("nic", "large")]["kind"] == "modeled"
    assert rows[("nccl", "large")]["kind"].startswith("measured")


def test_shape_class_counts_one_grouped_gemm_over_every_expert():
    from types import SimpleNamespace

    def moe(grouped):
        args = SimpleNamespace(top_k=8, num_experts=128, use_grouped_mm=grouped)
        return SimpleNamespace(dim=2048, moe_args=args)

    # 8192 tokens x top 8 / 128 experts = 512 rows per expert: 4 x 16 = 64 tiles each
    cls, why = inputs.shape_class_of(moe(False), 8192)
    assert cls == inputs.SINGLE_WAVE and "64 tiles" in why  # one launch per expert
    cls, why = inputs.shape_class_of(moe(True), 8192)
    assert cls == inputs.LARGE and "128 x (512 rows x dim 2048): 8192 tiles" in why
    assert "class grouped_experts" in why
    assert inputs.shape_class_of(SimpleNamespace(dim=1024), 1024)[0] == inputs.SINGLE_WAVE


def test_stock_step_spread_over_committed_runs(tmp_path):
    def write(name, world, ms):
        rows = [{"mode": "fsdp2", "best_step_ms": ms}, {"mode": "tide", "best_step_ms": 1.0}]
        data = {"metadata": {"world_size": world}, "rows": rows}
        (tmp_path / f"{name}_step_cfg.json").write_text(json.dumps(data))

    write("a", 2, 190.0)
    assert inputs.stock_step_spread(tmp_path, "cfg") is None  # one run: no spread
    write("b", 2, 182.5)
    write("c", 1, 100.0)  # another world size: not the same measurement
    assert inputs.stock_step_spread(tmp_path, "cfg") == (182.5, 190.0, 2)


def test_validation_rows_carry_their_keys_and_explain_misses():
    rows = report.validation_rows(inputs.RESULTS, cluster.Cluster())
    modes = {(r["config"], r["mode"]) for r in rows}
    assert len([m for m in modes if m[1] in inputs.MODES]) == 12  # 3 configs x 4 modes
    assert len([r for r in rows if r["gpus"] == 1]) >= 2  # Llama and Qwen3 at world 1
    for r in rows:
        assert {"config", "mode", "simulated_step_ms", "measured_step_ms", "sources"} <= set(r)
        assert r["within_5pct"] or r["missing"] not in ("", "not explained"), r
        if r["config"].startswith("h200x2_llama") and r["mode"] == "tide":
            assert r["accumulate_ms"] > 0 and r["sm_ms_taken"] > 0  # TIDE's kernels charged
    sources = report.source_rows(rows, cluster.Cluster())
    measured = [s for s in sources if s["input"].startswith("measured step")]
    assert len(measured) == len(rows) and all(".json" in s["source"] or "issue 21" in s["source"]
                                              for s in measured)  # fmt: skip
    assert {s["input"] for s in sources} >= {"compute", "accumulate", "interference", "cluster"}


def test_baseline_table_compares_tide_with_the_symm_mem_of_its_nccl():
    rows = report.baseline_rows(inputs.RESULTS, cluster.Cluster(), gpus=16)
    qwen = {r["variant"]: r for r in rows if r["model"] == "qwen3_30b_a3b"}
    assert len([v for v in qwen if v.startswith("symm_mem")]) == 2
    for variant, nccl in ((report.AS_BUILT, "2.28.9"), (report.AUTO_NEW, "2.31.2")):
        tide, symm = qwen[variant], qwen[f"symm_mem (NCCL {nccl})"]
        assert tide["nccl"] == nccl
        assert tide["vs_symm_speedup"] == pytest.approx(symm["sim_step_ms"] / tide["sim_step_ms"])
        assert tide["vs_fsdp2_reduction_pct"] == pytest.approx(
            100 * (1 - tide["sim_step_ms"] / qwen["fsdp2"]["sim_step_ms"])
        )
    assert (qwen[report.AS_BUILT]["tide_transport"], qwen[report.AUTO_NEW]["tide_transport"]) == (
        "copy_engine", "windows")
    assert "27.1%" in report.PAPER and "1.372x" in report.PAPER and "1.064x" in report.PAPER
    for r in rows:  # the breakdown adds up to the step
        parts = sum(r[f"sim_bd_{k}_ms"] for k in ("compute", "sm_taken", "layout", "optimizer",
                    "host", "exposed_fwd", "exposed_bwd", "exposed_tail"))  # fmt: skip
        assert parts == pytest.approx(r["sim_step_ms"], rel=0.01), r["variant"]
        assert r["ceiling_vs_fsdp2"] == pytest.approx(qwen["fsdp2"]["ceiling_vs_fsdp2"]) or (
            r["model"] != "qwen3_30b_a3b")
        assert r["lost_to_ceiling_ms"] == pytest.approx(
            r["sim_step_ms"] - r["sim_bd_compute_ms"] - r["sim_bd_optimizer_ms"] - r["sim_bd_host_ms"])


def test_cli_prints_rows_and_sources(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert (
        cli.main(["--config", "h200x2_llama70b_4layers", "--gpus", "16", "--json", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert "SIMULATION" in text and "| tide |" in text and "compute: trace" in text
    assert "accumulate:" in text
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} == set(inputs.MODES) and rows[0]["nodes"] == 2
    with pytest.raises(SystemExit):
        cli.main(["--config", "h200x2_llama70b_4layers", "--gpus", "12"])  # not whole nodes
    nccl231 = "train_configs/clusters/h200_8x400g_nccl231.toml"
    assert cli.main(["--config", "h200x2_llama70b_4layers", "--gpus", "16", "--modes", "tide",
                     "--cluster", nccl231]) == 0  # fmt: skip
    assert "windows, phase 2 one_sided, in place (every local rank simulated" in (
        capsys.readouterr().out
    )


def test_inputs_fall_back_to_flops_when_the_trace_has_other_layers():
    from torchtitan_tide.fsdp_groups import load_config_model

    cm = load_config_model("debug_model")  # llama3_tide, but not the 70B layer of the trace
    ins = inputs.build_inputs(cm, inputs.RESULTS, None, mfu=0.5)
    assert "trace_not_used" in ins.sources and ins.sources["compute"].startswith("FLOPs")
    layer = ins.compute["layers.0"]
    assert layer.bwd_ms == pytest.approx(2 * layer.fwd_ms)  # no activation checkpointing
    assert ins.optimizer_ms_per_shard_elem > 0


def test_host_time_from_a_world1_step_file_or_the_recorded_figures(tmp_path):
    every, _ = inputs.host_ms({"metrics": {"log_freq": 1}}, "h200x2_qwen3_30b_a3b_4layers")
    tenth, text10 = inputs.host_ms({"metrics": {"log_freq": 10}}, "h200x2_qwen3_30b_a3b_4layers")
    assert every == pytest.approx(29.5) and tenth == pytest.approx(29.5 - (199.8 - 173.7))
    assert "loss read" in text10 and inputs.host_ms({}, "unknown")[0] == 0.0
    wan = "h200x2_wan22_a14b_20layers"
    assert inputs.host_ms({}, wan, tmp_path)[1].startswith("not measured")
    row = {"mode": "fsdp2", "best_step_ms": 8100.0, "bd_step_ms": 8200.0, "bd_compute_ms": 7300.0,
           "bd_optimizer_ms": 90.0, "bd_host_bound_ms": 500.0, "bd_other_idle_ms": 210.0}  # fmt: skip
    result = {"metadata": {"world_size": 1, "date": "2026-12-03"}, "rows": [row]}
    (tmp_path / f"x_step_{wan}.json").write_text(json.dumps(result))  # a 2-GPU name: not read
    assert inputs.host_ms({}, wan, tmp_path)[1].startswith("not measured")
    (tmp_path / f"x_step_world1_{wan}.json").write_text(json.dumps(result))  # bench_step's name
    host, text = inputs.host_ms({}, wan, tmp_path)
    assert host == pytest.approx(710.0) and f"x_step_world1_{wan}.json" in text


def test_world1_rows_say_when_the_world1_trace_is_missing(tmp_path):
    from torchtitan_tide.fsdp_groups import load_config_model

    cm = load_config_model("h200x2_llama70b_4layers")
    ins = inputs.build_inputs(cm, inputs.RESULTS, None, 0.4, world1=True)
    has_trace = inputs.newest_world1_trace(inputs.RESULTS, "h200x2_llama70b_4layers")
    assert ("world1_trace" in ins.sources) == (has_trace is None)
    # without it: autocast's casts on the bf16 trace, once per weight forward and backward
    base = inputs.build_inputs(cm, inputs.RESULTS, None, 0.4).compute
    cast, _ = inputs.autocast_casts(
        base, cm.groups, "none", inputs.RESULTS, "h200x2_llama70b_4layers"
    )
    g = cm.groups[1]
    added = cast[g.name].fwd_ms - base[g.name].fwd_ms
    assert added == pytest.approx(4.774 / 2761986048 * g.numel, rel=1e-3)  # bench_floor cast
    assert cast[g.name].bwd_ms - base[g.name].bwd_ms == pytest.approx(added)
    full, _ = inputs.autocast_casts(
        base, cm.groups, "full", inputs.RESULTS, "h200x2_llama70b_4layers"
    )
    assert full[g.name].bwd_ms - base[g.name].bwd_ms == pytest.approx(2 * added)
    empty, why = inputs.autocast_casts(base, cm.groups, "none", tmp_path, "h200x2_llama70b_4layers")
    assert empty == dict(base) and "not charged" in why


def test_stream_picture_marks_the_exposed_first_all_gather(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "streams.png"
    assert report.draw_streams(
        path, "h200x2_llama70b_4layers", 2, cluster.Cluster(), inputs.RESULTS
    )
    assert path.stat().st_size > 10_000
    result = sim.simulate_config("h200x2_llama70b_4layers", 2, ["fsdp2"], cluster.Cluster())
    exposed = report.exposed_intervals(result["spans"]["fsdp2"])
    assert exposed[0][0] == pytest.approx(0.0)  # the first all-gather, before any compute
    total = sum(b - a for a, b in exposed)
    assert total == pytest.approx(result["rows"][0]["sim_exposed_ms"])


def test_simulator_and_comm_package_import_without_torch():
    """comm/__init__ loads torch and the installers on first use, not on import."""
    import subprocess
    import sys

    code = ("import sys, torchtitan_tide.comm, torchtitan_tide.simulator.report; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.endswith('.install')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_package_modules_import_only_earlier_ones():
    """No import circle: each module of torchtitan_tide/simulator imports only modules
    before it in cluster, engine, network, results, interference, plans, compute, inputs,
    step, report, cli."""
    import ast

    order = ["cluster", "engine", "network", "results", "interference", "plans", "compute",
             "inputs", "step", "report", "cli"]  # fmt: skip
    root = inputs.REPO / "torchtitan_tide" / "simulator"
    for i, name in enumerate(order):
        tree = ast.parse((root / f"{name}.py").read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target.startswith("torchtitan_tide.simulator."):
                    used = target.split(".")[2]
                    assert used in order[:i], f"{name}.py imports {used}"
    assert not list((inputs.REPO / "torchtitan_tide").glob("simulate*.py"))


def test_ring_rs_symm_mem_swaps_only_symm_mem_reduce_scatter():
    from torchtitan_tide.fsdp_groups import load_config_model

    cm = load_config_model("h200x2_qwen3_30b_a3b_4layers")
    ins = inputs.build_inputs(cm, inputs.RESULTS, None, 0.4)
    ring = report.ring_rs_symm_mem(ins)
    assert ring.transport_gibps["symm_mem"]["rs"] == ins.transport_gibps["fsdp2"]["rs"]
    assert ring.transport_gibps["symm_mem"]["ag"] == ins.transport_gibps["symm_mem"]["ag"]
    assert ring.engines["nccl_symk"] == ins.engines["nccl"] != ins.engines["nccl_symk"]
    assert ring.transport_gibps["tide"] == ins.transport_gibps["tide"]
    # the ring's reduce-scatter is shorter than NCCL 2.28.9's symmetric kernel + divide
    two = sim.simulate_config(cm.path.stem, 2, ["symm_mem"], cluster.Cluster(), cm=cm, inputs=ins)
    fix = sim.simulate_config(cm.path.stem, 2, ["symm_mem"], cluster.Cluster(), cm=cm, inputs=ring)
    rs_ms = [{s.op.name: s.op.duration_ms for s in r["spans"]["symm_mem"]}["layers.0.rs"]
             for r in (two, fix)]  # fmt: skip
    assert rs_ms[1] < rs_ms[0]


def test_layout_copies_scale_with_the_simulated_model():
    """Layout kernels cost per element of the measured config: the measured config gets
    its profiled ms back, a smaller model of the same family proportionally less."""
    from torchtitan_tide.fsdp_groups import load_config_model

    measured = load_config_model("h200x2_llama70b_4layers")
    tiny = load_config_model("debug_model")
    fig = {}
    for cm in (measured, tiny):
        ins = inputs.build_inputs(cm, inputs.RESULTS, None, 0.4)
        res = sim.simulate_config(cm.path.stem, 2, ["fsdp2"], cluster.Cluster(), cm=cm, inputs=ins)
        fig[cm.path.stem] = sum(s.op.duration_ms for s in res["spans"]["fsdp2"]
                                if s.op.kind == "layout")  # alone (they slow beside NCCL)
    profiled = 19.14 + 11.19  # chunk_cat + split_with_sizes_copy ms of the 8a9ccda step
    assert fig["h200x2_llama70b_4layers"] == pytest.approx(profiled, rel=0.01)
    ratio = tiny.total_numel / measured.total_numel
    assert fig["debug_model"] == pytest.approx(profiled * ratio, rel=0.05)


def test_optimizer_from_another_trace_when_a_trace_did_not_time_it(tmp_path):
    """A trace whose optimizer did not fit in memory (bench_trace writes adamw_ms None and
    the error) still gives its layer times; the optimizer comes from the config's trace."""
    from torchtitan_tide.fsdp_groups import load_config_model

    config = "h200x2_llama70b_4layers"
    cm = load_config_model(config)
    world1 = inputs.newest_world1_trace(inputs.RESULTS, config)
    assert world1 is not None, "the committed world-1 trace of the Llama config"
    data = json.loads(world1.read_text())
    timed = inputs.build_inputs(cm, inputs.RESULTS, world1, 0.4, world1=True)
    data.update(adamw_ms=None, clip_ms=None, optimizer_error="out of memory: test")
    untimed_path = tmp_path / f"x_trace_world1_{config}.json"
    untimed_path.write_text(json.dumps(data))
    untimed = inputs.build_inputs(cm, inputs.RESULTS, untimed_path, 0.4, world1=True)
    other = inputs.newest_trace(inputs.RESULTS, config)
    assert other.name in untimed.sources["optimizer"], untimed.sources["optimizer"]
    theirs = json.loads(other.read_text())
    per_element = (theirs["adamw_ms"] + theirs["clip_ms"]) / theirs["work"]["shard_params"]
    assert untimed.optimizer_ms_per_shard_elem == pytest.approx(per_element)
    assert untimed.compute == timed.compute  # the layer times are the untimed trace's own
