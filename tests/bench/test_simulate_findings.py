"""Issue 46: one test per finding (A-G) of the second review of the simulator at the paper's
shape (8 x 8 GPUs, 400 Gb/s per GPU), and the plan reading behind them. Each finding's
test fails on the charging before the issue (main 8cf1f42) and passes on today's: TIDE's
timeline is the op plan the code runs (``simulator/plans.py``), links are shared, local
copies are local copies, the headline is the row ``auto`` runs."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from torchtitan_tide.comm.plans import window_rounds as wr
from torchtitan_tide.comm.plans.memory_plan import group_shard_numel
from torchtitan_tide.simulator import cluster, inputs, network, report
from torchtitan_tide.simulator import step as sim
from torchtitan_tide.simulator.engine import Op, merge, simulate

OLD, NEW = cluster.Cluster(nccl_version="2.28.9"), cluster.Cluster(nccl_version="2.31.2")
LAY = sim.Layout(64, 8)


@functools.lru_cache(maxsize=8)
def _cm(config: str):
    from torchtitan_tide.fsdp_groups import load_config_model

    return load_config_model(config)


@functools.lru_cache(maxsize=8)
def _inputs(config: str):
    return inputs.build_inputs(_cm(config), inputs.RESULTS, None, 0.4)


def _step(config: str, clu, mode: str = "tide", groups: int = 4, lay=LAY, **tide):
    """Spans by name of ``groups`` FSDP groups of ``config`` (the embedding and the first
    blocks) simulated at ``lay`` on ``clu``."""
    cm = _cm(config)
    model = sim.tide_model_of(cm.tide)
    model = replace(model, **tide) if tide else model
    _, spans = sim.simulate_step(cm.groups[:groups], _inputs(config), mode, lay, clu,
                                 cm.dtypes, model)  # fmt: skip
    return {s.op.name: s for s in spans}


def test_a_stock_ring_across_nodes_runs_at_its_nics_not_the_two_gpu_channels():
    """Stock's ring across nodes runs at L x what one NIC reaches (46 GB/s of 50 at 400
    Gb/s, NCCL's maintainers: nccl-tests#290): 343 GiB/s at 8 x 400 Gb/s. Before, the
    2-GPU ring's 24-channel rate (269-271 GiB/s) bound it."""
    by = _step("llama70b_fsdp2", OLD, "fsdp2")
    group = _cm("llama70b_fsdp2").groups[1]
    shard = group_shard_numel(group, 64) * 4  # fp32 reduce-scatter
    rate = 8 * 46e9 / 2**30
    ring = network.ring_latency_ms(LAY) + 1e3 * 63 * shard / (rate * 2**30)
    assert by[f"{group.name}.rs"].op.duration_ms == pytest.approx(ring, rel=1e-9)
    assert _inputs("llama70b_fsdp2").transport_gibps["fsdp2"]["rs"] < rate  # no longer binds
    assert "nccl-tests/issues/290" in network.SOURCES["nic"]


def test_b_placement_and_pack_copies_are_local_hbm_copies():
    """TIDE's placement (Place, on the placement path: in place off) and TIDE-RS's pack
    (PackSlices) are local HBM-to-HBM copies: engine ``ce_local`` on the GPU's HBM, at the
    local copy rate, stretched beside compute as the copy engine's local copy measured
    (``local_batch_ce`` on one H100, 4c402a6: +827% beside large GEMMs, about 538 GiB/s
    alone; until then the most pessimistic figure, the one-GPU same-device copy's +1116%).
    Before, they were charged as NVLink copies (+1.8%). In place at 8 x 8 (what ``auto``
    runs, issue 45) the all-gather has neither a pack nor a placement copy."""
    placed = _step("llama70b_tide", NEW, ag_in_place_groups=0)
    in_place = _step("llama70b_tide", NEW)
    ins = _inputs("llama70b_tide")
    places = [s.op for n, s in placed.items() if n.endswith(".Place")]
    packs = [s.op for n, s in in_place.items() if n.split("@")[0].endswith(".PackSlices")]
    assert places and packs
    assert not [n for n in in_place if ".ag." in n and n.split("@")[0].endswith(
        (".Place", ".PackOwn"))]  # fmt: skip
    g = ins.engines["ce_local"][1]
    assert g > 5  # the local copy's own stretch, mixed over Llama's classes
    for op in places + packs:
        assert (op.kind, op.link.split("@")[0], op.slowdown["compute"]) == ("ce_local", "hbm", g)
    rows = {(r["engine"], r["compute_class"]): r for r in ins.figures}
    assert rows[("ce_local", "large")]["kind"] == "measured (one H100)"
    assert rows[("ce_local", "large")]["comm_slowdown_pct"] == pytest.approx(827.08, abs=0.1)
    assert "local_batch_ce alone" in ins.sources["copy"]
    assert 500 < ins.copy_gibps < 600  # one wave of placement copies on the copy engine


def test_c_one_nic_per_gpu_carries_every_cross_node_byte():
    """TIDE-AG's puts and TIDE-RS phase 2's puts share one NIC per GPU: while both run
    they split it (FIFO per communicator), so the NIC never carries more than its rate.
    Before, each ran at full line rate on the same NIC."""
    two = [Op("ag_put", "tide_one_sided", 4.0, "nic", link="nic", flow="slots"),
           Op("rs_put", "tide_rs_cross", 4.0, "nic", link="nic", flow="data"),
           Op("ag_put2", "tide_one_sided_b", 4.0, "nic", link="nic", flow="slots")]  # fmt: skip
    by = {s.op.name: s for s in simulate(two)}
    assert by["ag_put"].end_ms == pytest.approx(8.0) and by["rs_put"].end_ms == pytest.approx(8.0)
    assert by["ag_put2"].end_ms == pytest.approx(12.0)  # FIFO behind ag_put on its communicator
    spans = _step("qwen3_30b_a3b_tide", NEW, groups=6).values()
    links = {s.op.link for s in spans if s.op.link.split("@")[0] == "nic"}
    assert links == {"nic", *(f"nic@{d}" for d in range(1, 8))}  # one NIC per local rank
    for link in links:
        nic = [s for s in spans if s.op.link == link]
        assert {s.op.stream.split("@")[0] for s in nic} >= {"tide_one_sided", "tide_rs_cross"}
        assert {s.op.device for s in nic} == {nic[0].op.device}
        busy = sum(b - a for a, b in merge((s.start_ms, s.end_ms) for s in nic))
        assert sum(s.op.duration_ms for s in nic) <= busy + 1e-6
    nic = [s for s in spans if s.op.link == "nic"]
    assert any(s.end_ms - s.start_ms > s.op.duration_ms * 1.5 for s in nic)  # it did share


def test_d_headline_is_the_row_auto_runs_and_as_built_is_serial():
    """On NCCL 2.31 ``auto`` runs NCCL windows and the one-sided phase-2 ring (no NCCL
    kernel); on 2.28.9 the copy engine with send/recv across nodes, serial as the code
    runs it: each exchange waited before the next, the node-local pull after the last.
    The headline sets each against the SymmMem of the same NCCL. Before, the headline was
    "as built" modeled pipelined, set against SymmMem 2.31."""
    new = _step("llama70b_tide", NEW)
    assert not [n for n, s in new.items() if s.op.kind == "nccl"]
    assert {s.op.kind for n, s in new.items() if n.endswith(".Put")} == {"nic", "ce"}
    old = _step("llama70b_tide", OLD)
    gather = "layers.0.fwd.ag"
    x = sorted((s for n, s in old.items() if n.startswith(f"{gather}_x")),
               key=lambda s: s.start_ms)  # fmt: skip
    assert len(x) == 3 and all(s.op.kind == "nccl" and s.op.link == "nic" for s in x)
    assert x[0].start_ms >= old[f"{gather}_pack"].end_ms - 1e-9
    assert all(b.start_ms >= a.end_ms - 1e-9 for a, b in itertools.pairwise(x))  # serial
    assert old[f"{gather}_pull"].start_ms >= x[-1].end_ms - 1e-9
    row = {(r["model"], r["nccl"]): r for r in report.headline_rows(_baseline())}
    assert row[("qwen3_30b_a3b", "2.31.2")]["tide_runs"] == report.AUTO_NEW
    assert row[("qwen3_30b_a3b", "2.28.9")]["tide_runs"] == report.AS_BUILT
    base = {(r["model"], r["variant"]): r for r in _baseline()}
    auto, symm = base[("qwen3_30b_a3b", report.AUTO_NEW)], base[("qwen3_30b_a3b",
                                                                  "symm_mem (NCCL 2.31.2)")]  # fmt: skip
    assert auto["vs_symm_speedup"] == pytest.approx(symm["sim_step_ms"] / auto["sim_step_ms"])
    assert (auto["tide_transport"], auto["rs_phase2"]) == ("windows", "one_sided")


@functools.lru_cache(maxsize=1)
def _baseline():
    return report.baseline_rows(inputs.RESULTS, cluster.Cluster(), gpus=16)


def _overlap(a, b) -> bool:
    return max(a.start_ms, b.start_ms) < min(a.end_ms, b.end_ms)


def test_e_window_streams_as_the_code_issues_them(monkeypatch):
    """Each op runs on the stream the code issues it on (issue 45): the node-local fan-out
    on ``tide_fan``, the cross-node puts on ``tide_one_sided``, so the fan-out of one wave
    runs beside the next wave's cross-node put, on the placement path and in place; a
    stream the plan adds is simulated as its own, with no edit of the simulator. Before
    issue 45 the fan-out shared the put stream (and the model had it apart)."""
    for in_place in (0, 4):
        by = _step("llama70b_tide", NEW, groups=2, ag_in_place_groups=in_place)
        ag = [s for n, s in by.items() if n.startswith("layers.0.fwd.ag.") and s.op.device == 0]
        puts = [s for s in ag if s.op.name.endswith(".Put")]
        rail = [s for s in puts if s.op.link == "nic"]
        fan = [s for s in puts if s.op.link == "nvlink"]
        assert {s.op.stream for s in rail} == {"tide_one_sided"}
        assert {s.op.stream for s in fan} == {"tide_fan"}
        assert len(rail) >= 3 and fan
        assert any(_overlap(f, r) for f in fan for r in rail), in_place  # the fan-out beside

    original = wr.ag_in_place_ops

    def fan_apart(*args, **kw):
        """The same plan with the fan-out on a stream named "fan2"."""
        ops, seen = original(*args, **kw)
        moved = [dataclasses.replace(op, stream="fan2") if getattr(op, "stream", None) == wr.FAN
                 else wr.Fork(op.src, "fan2") if isinstance(op, wr.Fork) and op.dst == wr.FAN
                 else wr.Fork("fan2", op.dst) if isinstance(op, wr.Fork) and op.src == wr.FAN
                 else op for op in ops]  # fmt: skip
        return moved, seen

    monkeypatch.setattr(wr, "ag_in_place_ops", fan_apart)
    sim._TIMELINES.clear()
    apart = _step("llama70b_tide", NEW, groups=2)
    sim._TIMELINES.clear()
    assert [s for s in apart.values() if s.op.stream == "tide_fan2"]
    assert not [s for n, s in apart.items() if ".ag." in n and s.op.stream == "tide_fan"]


def test_the_nic_rule_is_a_dependency():
    """TIDE-RS phase 2 puts a partial in pieces, each after ``Fork(PUT, RING)``: the ring
    waits for every cross-node put TIDE-AG issued before it (the re-gather FSDP2 issued as
    the group's backward started), so on a GPU's NIC the all-gather goes first."""
    from torchtitan_tide.simulator.plans import ONE_SIDED, RS_CROSS

    by = _step("llama70b_tide", NEW, groups=4)
    ring = [s for n, s in by.items() if s.op.stream == RS_CROSS and n.endswith(".Put")]
    ag_puts = {n: s for n, s in by.items() if s.op.stream == ONE_SIDED}
    waited = [(s, ag_puts[d]) for s in ring for d in s.op.after if d in ag_puts]
    assert waited and all(s.start_ms >= a.end_ms - 1e-9 for s, a in waited)
    group = waited[0][0].op.group  # its partial waits for the next group's re-gather
    assert any(a.op.name.startswith(f"{a.op.group}.bwd.ag.") and a.op.group != group
               for _, a in waited)  # fmt: skip


def test_f_compute_beside_two_engines_loses_both_shares():
    """Compute beside an NCCL kernel (+20%) and a copy (+30%) at once runs at 1 / 1.5, the
    engines' fractions added; before, the larger alone (1 / 1.3)."""
    ops = [Op("rs", "nccl", 5.0, "nccl"), Op("copy", "tide", 5.0, "ce"),
           Op("gemm", "compute", 10.0, slowdown={"nccl": 0.2, "ce": 0.3})]  # fmt: skip
    by = {s.op.name: s for s in simulate(ops)}
    assert by["gemm"].end_ms == pytest.approx(5.0 + 10.0 - 5.0 / 1.5)


def test_g_layout_kernels_are_slowed_like_other_kernels():
    """FSDP2's copy-out and chunk_cat on the compute stream slow beside NCCL's kernels as
    compute does; before, they ran at their profiled time whatever ran beside them."""
    by = _step("h200x2_llama70b_4layers", OLD, "fsdp2", groups=6, lay=sim.Layout(2, 2))
    layout = [s for s in by.values() if s.op.kind == "layout"]
    assert layout and all(s.op.slowdown.get("nccl", 0) > 0.1 for s in layout)
    assert sum(s.lost_ms for s in layout) > 0


def test_an_op_the_simulator_does_not_know_fails_loudly(monkeypatch):
    """A new op type in the plan is an error naming it, not an op charged as nothing."""

    @dataclasses.dataclass(frozen=True)
    class Multicast:
        stream: str
        nbytes: int

    original = wr.ag_in_place_ops

    def with_multicast(*a, **k):
        ops, seen = original(*a, **k)
        return [*ops, Multicast(wr.PUT, 1)], seen

    monkeypatch.setattr(wr, "ag_in_place_ops", with_multicast)
    sim._TIMELINES.clear()
    with pytest.raises(inputs.SimulateError, match="unknown op Multicast"):
        _step("llama70b_tide", NEW, groups=1)
    sim._TIMELINES.clear()


def test_in_place_at_n_x_l_simulates_every_local_rank():
    """In place where the plan runs in place (every N x L of more than one node, issue 45):
    at 8 x 8 each of the 8 local ranks of a node runs its own plan on its own GPU (streams,
    NIC, NVLink, HBM), moving the cross-node bytes ``cross_node_segments`` gives its local
    index (balanced by bytes); the rank whose step ends last sets the step."""
    from torchtitan_tide.comm.plans.memory_plan import padded_shard_numel
    from torchtitan_tide.comm.plans.plan import WorldLayout
    from torchtitan_tide.simulator import plans

    assert plans.in_place_at(WorldLayout(8, 1)) and plans.in_place_at(WorldLayout(64, 8))
    assert not plans.in_place_at(WorldLayout(8, 8))  # one node: nothing crosses nodes
    cm = _cm("llama70b_tide")
    run = sim.tide_run(sim.tide_model_of(cm.tide), NEW, LAY, cm.dtypes)
    timeline = plans.Timeline(WorldLayout(64, 8), run, cm.groups[:2])
    assert timeline.in_place and timeline.classes == tuple(range(8))
    group = cm.groups[1]
    works, done = timeline.all_gather(group, "fwd", ("fwd0",))
    assert len(done) == 8 and all(done)
    nic = [sum(w.nbytes for w in works if w.device == d and w.link == plans.on_device("nic", d))
           for d in range(8)]  # fmt: skip
    shard = [padded_shard_numel(s, 64) * 2 for s in group.param_shapes]
    segments = wr.cross_node_segments(tuple(shard), 8)
    want = [7 * sum(b - a for _, a, b in segments[d]) for d in range(8)]
    assert nic == want  # recursive doubling: 7 node blocks' shares sent
    # the cut is by bytes: every local index's NIC carries the same bytes within the cuts'
    # 256-byte alignment (a cut at shard boundaries left one at 1.29x the mean for Qwen3)
    assert max(nic) - min(nic) <= 7 * 2 * wr.SEGMENT_ALIGN, nic
    assert not [w for w in works if w.what in ("Place", "PackOwn")]
    issue = [w for w in works if w.what == "Issue"]
    assert [w.issued_with for w in issue] == [("fwd0",), *((f"fwd0@{d}",) for d in range(1, 8))]
    fig, spans = sim.simulate_step(cm.groups[:3], _inputs("llama70b_tide"), "tide", LAY, NEW,
                                   cm.dtypes, sim.tide_model_of(cm.tide))  # fmt: skip
    ends = {d: max(s.end_ms for s in spans if s.op.stream == plans.on_device("compute", d))
            for d in range(8)}  # fmt: skip
    assert ends[fig["slowest_local_rank"]] == pytest.approx(max(ends.values()))
    assert fig["step_ms"] == pytest.approx(max(ends.values()))


def test_the_simulators_streams_are_the_transports():
    """The CUDA stream the simulator puts each op stream of a plan on is the one the
    transports run it on (the names live in torch modules, so ``plans`` names them too)."""
    pytest.importorskip("torch")
    from torchtitan_tide.comm.fsdp import reduce_scatter
    from torchtitan_tide.comm.transports.windows import ring as one_sided
    from torchtitan_tide.comm.transports.windows import transport as windows
    from torchtitan_tide.simulator import plans

    assert {k: plans.AG_STREAMS[k] for k in windows._STREAMS} == windows._STREAMS
    assert plans.AG_STREAMS[wr.PUT] == one_sided.AG_PUT_STREAM == plans.ONE_SIDED
    assert set(plans.AG_STREAMS) == {wr.MAIN, wr.PUT, wr.FAN, wr.PLACE}
    source = Path(reduce_scatter.__file__).read_text()
    assert f'streams.stream("{plans.RS_CROSS}"' in source  # TIDE-RS phase 2's stream


def test_auto_takes_what_the_codes_topology_takes():
    """``step.tide_run`` (torch-free) agrees with ``comm.topology.choose_transport`` under
    ``auto`` for one and several nodes, one and several ranks per node, both NCCLs and
    both cross-node options."""
    torch = pytest.importorskip("torch")
    from torchtitan_tide.comm.options import TideOptions
    from torchtitan_tide.comm.plans import topology
    from torchtitan_tide.comm.plans.plan import WorldLayout

    dtypes = _cm("llama70b_tide").dtypes
    for world, local in ((2, 1), (8, 1), (8, 8), (64, 8), (16, 4)):
        for clu in (OLD, NEW):
            for cross in ("auto", "p2p"):
                opts = TideOptions(cross_node_transport=cross)
                windows = (clu is NEW, "")
                kind, _, _ = topology.choose_transport(
                    opts, WorldLayout(world, local), torch.device("cuda", 0), "nccl",
                    (True, "P2P"), windows)  # fmt: skip
                run = sim.tide_run(sim.TideModel(cross_node_transport=cross), clu,
                                   sim.Layout(world, local), dtypes)  # fmt: skip
                assert run.transport == kind, (world, local, clu.nccl_version, cross)
    with pytest.raises(inputs.SimulateError, match="nccl_one_sided"):
        sim.tide_run(sim.TideModel(cross_node_transport="nccl_one_sided"), OLD, LAY, dtypes)


def test_in_place_all_gather_is_paced_as_the_transport_paces_it(monkeypatch):
    """``[tide] ag_pacing`` bounds the puts in flight of an in-place all-gather as it does
    on the placement path: the simulator passes it to ``ag_in_place_ops`` as
    ``WindowTransport._gather_in_place`` does (its op list has one wait per wave)."""
    from torchtitan_tide.comm.plans.plan import WorldLayout
    from torchtitan_tide.simulator import plans

    cm = _cm("llama70b_tide")
    group = cm.groups[1]
    seen = []
    original = wr.ag_in_place_ops

    def recorded(plan, *args):
        ops, credits = original(plan, *args)
        seen.append((plan, args, ops))
        return ops, credits

    monkeypatch.setattr(wr, "ag_in_place_ops", recorded)
    waits = {}
    for pacing in (0, 2):
        seen.clear()
        model = replace(sim.tide_model_of(cm.tide), ag_pacing=pacing)
        run = sim.tide_run(model, NEW, sim.Layout(16, 2), cm.dtypes)
        timeline = plans.Timeline(WorldLayout(16, 2), run, cm.groups[:2])
        timeline.all_gather(group, "fwd", ())
        expected = _in_place_args(timeline, group)
        # this group's calls (not in_place_at's probe)
        calls = [c for c in seen if c[1][1] == expected[1]]
        assert calls, "the in-place plan did not run"
        plan, args, ops = calls[0]
        assert args[-1] == pacing  # the transport's own argument
        want = original(plan, *expected[:-1], 0, pacing)[0]
        assert ops == want
        waits[pacing] = sum(isinstance(op, wr.Wait) for op in ops)
    assert waits[2] > waits[0], waits  # pacing adds a wait per wave


@pytest.mark.parametrize("nodes", [1, 2])
def test_send_recv_transport_exchanges_the_node_local_shards_on_nvlink(nodes):
    """``ag_transport = "nccl_p2p"`` at L = 2 (forced: ``auto`` takes the copy engine in a
    node): its plan has the node-local exchanges (install builds it without
    ``pull_local``), charged on NVLink, the cross-node ones on the NIC; TIDE-RS phase 1's
    send/recv goes to the node's ranks, on NVLink."""
    from torchtitan_tide.comm.plans.plan import WorldLayout
    from torchtitan_tide.simulator import plans

    cm = _cm("llama70b_tide")
    group = cm.groups[1]
    lay = sim.Layout(2 * nodes, 2)
    run = sim.tide_run(sim.TideModel(ag_transport="nccl_p2p"), NEW, lay, cm.dtypes)
    assert run.transport == "p2p"
    timeline = plans.Timeline(WorldLayout(2 * nodes, 2), run, cm.groups[:2])
    gathered, _ = timeline.all_gather(group, "fwd", ())
    links = [w.link for w in gathered if w.what == "SendRecv"]
    shard_bytes = group_shard_numel(group, 2 * nodes) * 2
    assert links.count(plans.NVLINK) >= 1  # the local peer's shards
    assert links.count(plans.NIC_LINK) == (1 if nodes == 2 else 0)
    local = [w for w in gathered if w.what == "SendRecv" and w.link == plans.NVLINK]
    assert sum(w.nbytes for w in local) == pytest.approx(nodes * shard_bytes)  # L - 1 = 1 peer
    reduced, _ = timeline.reduce(group, ("bwd",))
    phase1 = [w for w in reduced if w.what == "SendRecv" and ".c0" in w.name]
    assert phase1 and all(w.link == plans.NVLINK for w in phase1)


def test_waits_take_the_slowest_ranks_view(monkeypatch):
    """A wait ends when every rank of its local index would have its matching signal: at
    1 x 8 (placement path: the ranks alike, local rank 0 stands for all) the placement of a
    local peer's forward waits for rank 0's whole fan-out (its last put), not only for the
    first put each peer sends rank 0. At 2 x 2 in place, local rank 0's waits for what its
    peer forwards name local rank 1's own puts, even at a position past rank 0's last."""
    from torchtitan_tide.comm.plans.plan import WorldLayout
    from torchtitan_tide.simulator import plans

    cm = _cm("llama70b_tide")
    model = sim.TideModel(ag_transport="nccl_windows")
    one = plans.Timeline(WorldLayout(8, 8), sim.tide_run(model, NEW, sim.Layout(8, 8),
                                                         cm.dtypes), cm.groups[:1])  # fmt: skip
    works, _ = one.all_gather(cm.groups[0], "fwd", ())
    fan = [w for w in works if w.what == "Put" and w.stream == plans.FAN]
    places = [w for w in works if w.what == "Place"]
    assert one.classes == (0,) and len(fan) == 1 and fan[0].count == 7  # 7 puts, waited as one
    assert len(places) == 8 and all(fan[0].name in p.after for p in places[1:])
    two = plans.Timeline(WorldLayout(4, 2), sim.tide_run(sim.TideModel(), NEW, sim.Layout(4, 2),
                                                         cm.dtypes), cm.groups[:2])  # fmt: skip
    original = wr.ag_in_place_ops

    def padded(plan, *args):  # local index 1's plan 40 ops longer: its forwards come later
        ops, seen = original(plan, *args)
        pad = [wr.Fork(wr.MAIN, wr.MAIN)] * 40 if plan.layout.local_of(plan.rank) == 1 else []
        return pad + ops, seen

    monkeypatch.setattr(wr, "ag_in_place_ops", padded)
    works, done = two.all_gather(cm.groups[1], "fwd", ())
    assert two.classes == (0, 1) and len(done) == 2
    peer_fan = {w.name for w in works if w.device == 1 and w.stream == "tide_fan@1"}
    waited = {d for w in works if w.device == 0 for d in w.after} | set(done[0])
    assert peer_fan and waited & peer_fan  # rank 0 waits for rank 1's own forwards
    mine = len(original(two._plan(cm.groups[1], 0), *_in_place_args(two, cm.groups[1]))[0])
    assert max(int(n.split(".")[-2]) for n in waited & peer_fan) > mine  # past rank 0's list


def _in_place_args(timeline, group) -> tuple:
    """``ag_in_place_ops``'s arguments after the plan, as ``Timeline`` passes them."""
    from torchtitan_tide.comm.plans.memory_plan import padded_shard_numel
    from torchtitan_tide.comm.plans.window_arena import aligned

    world = timeline.world
    shard = tuple(padded_shard_numel(s, world) * 2 for s in group.param_shapes)
    offsets = tuple(sum(aligned(n * world) for n in shard[:i]) for i in range(len(shard)))
    return offsets, shard, 0, 0, {}, 0


def test_what_ifs_are_named_and_apart_from_the_headline():
    """The report's what-ifs change one input each of the NCCL 2.31 row and say so; the
    row 'as run' is the headline's (in place: the earlier "no local copies" what-if is what
    runs, not counted twice), removing TIDE-RS's packs, the local copies left, can only
    help, and the reference row with in place off is slower where the placement copies
    weigh (Llama, Qwen3); for Wan2.2 (compute-bound, ceiling 1.012x) the two are within
    0.1%: with the copy engine's local copy measured (2026-12-07), placement copies barely
    slow compute, and in place's NVLink fan-out takes a few ms of SM time more."""
    rows = report.what_if_rows(inputs.RESULTS, cluster.Cluster(), gpus=16)
    base = {(r["model"], r["variant"]): r for r in _baseline()}
    for model in ("llama70b", "qwen3_30b_a3b", "wan22_a14b"):
        got = {r["what_if"]: r for r in rows if r["model"] == model}
        assert list(got) == list(report.WHAT_IFS)
        assert got[report.AS_RUN]["sim_step_ms"] == pytest.approx(
            base[(model, report.AUTO_NEW)]["sim_step_ms"]
        )
        assert base[(model, report.AUTO_NEW)]["in_place"]
        free = got[report.NO_PACK]
        assert free["sim_step_ms"] <= got[report.AS_RUN]["sim_step_ms"] + 1e-6
        # in place is what runs: the placement path is slower, and not a what-if
        off, as_run = got[report.IN_PLACE_OFF]["sim_step_ms"], got[report.AS_RUN]["sim_step_ms"]
        if model == "wan22_a14b":
            assert off == pytest.approx(as_run, rel=1e-3)
        else:
            assert off > as_run * 1.002, (model, off, as_run)


def test_every_table_with_a_speed_up_has_its_ceiling():
    """Beside every speed-up of the report, its ceiling (stock's step over compute +
    optimizer + host)."""
    tables = {name: getattr(report, name) for name in dir(report) if name.endswith("_COLUMNS")}
    with_speedups = [name for name, cols in tables.items()
                     if any("speedup" in key or "_vs_" in key for key, _ in cols)]  # fmt: skip
    assert len(with_speedups) >= 6, with_speedups
    for name in with_speedups:
        assert "ceiling_vs_fsdp2" in {key for key, _ in tables[name]}, name
