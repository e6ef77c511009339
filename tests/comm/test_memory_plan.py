"""The memory planner: hand-computed sizes, scaling, the CLI and its errors (CPU, meta device)."""

from __future__ import annotations

import json

import pytest
from torch import nn

from torchtitan_tide import fsdp_groups, memory_report
from torchtitan_tide.comm.plans.memory_plan import (
    CommDtypes,
    GroupShape,
    aligned_group_bytes,
    group_shard_numel,
    padded_shard_numel,
    plan_memory,
)

BF16_FP32 = CommDtypes(param_bytes=2, reduce_bytes=4, master_bytes=4)
LAYER = ((13, 7), (7, 13), (1,))
TWO_LAYERS = [GroupShape("layers.0", LAYER), GroupShape("layers.1", LAYER)]


def test_padded_shards_by_hand():
    # W=2: ceil(13/2)*7 = 49, ceil(7/2)*13 = 52, ceil(1/2) = 1
    assert [padded_shard_numel(s, 2) for s in LAYER] == [49, 52, 1]
    assert group_shard_numel(TWO_LAYERS[0], 2) == 102
    # W=4: 4*7 = 28, 2*13 = 26, 1
    assert group_shard_numel(TWO_LAYERS[0], 4) == 55
    # bf16, each parameter rounded up to 16 bytes: 98->112, 104->112, 2->16
    assert aligned_group_bytes(TWO_LAYERS[0], 2, 2) == 240
    assert aligned_group_bytes(TWO_LAYERS[0], 4, 2) == 64 + 64 + 16
    assert aligned_group_bytes(TWO_LAYERS[0], 4, 4) == 112 + 112 + 16


def test_two_ranks_one_node_by_hand():
    plans = plan_memory(TWO_LAYERS, world=2, local_world_size=2, dtypes=BF16_FP32)
    fsdp2, symm, tide = plans["fsdp2"], plans["symm_mem"], plans["tide"]
    assert fsdp2.ag_bytes == 2 * 2 * 102 * 2 == 816
    assert fsdp2.rs_bytes == 2 * 2 * 102 * 4 == 1632
    assert fsdp2.gradient_bytes == 204 * 4
    assert fsdp2.params_optimizer_bytes == 204 * 4 * 3
    assert (symm.ag_bytes, symm.rs_bytes, symm.residency) == (816, 1632, "persistent")
    assert fsdp2.residency == "transient"
    # AG: 2 slots of round128(N * 240) = 256. RS (R = 2 rows of 102 bf16): shared slots of
    # round128(max(240, 2 * 204)) = 512 each, minus the AG slots. One node: no fp32 ring.
    assert tide.ag_bytes == 512
    assert tide.parts == {"ag_slots": 512, "rs_staging_extra": 512, "rs_cross_node_fp32": 0}
    assert tide.rs_bytes == 512
    assert tide.total_bytes == 1024 + 204 * 4 + 204 * 12


def test_four_ranks_two_nodes_by_hand():
    plans = plan_memory(TWO_LAYERS, world=4, local_world_size=2, dtypes=BF16_FP32)
    fsdp2, tide = plans["fsdp2"], plans["tide"]
    assert fsdp2.ag_bytes == 2 * 4 * 55 * 2 == 880
    assert fsdp2.rs_bytes == 2 * 4 * 55 * 4 == 1760
    assert fsdp2.gradient_bytes == 110 * 4
    # AG slots: 2 * round128(2 nodes * 144) = 2 * 384. RS staging (2 rows of 55 bf16 = 220)
    # fits in them; cross-node: (K=2 + 1) fp32 buffers of 55 elements = 3 * 220.
    assert tide.parts == {"ag_slots": 768, "rs_staging_extra": 0, "rs_cross_node_fp32": 660}
    assert (tide.ag_bytes, tide.rs_bytes) == (768, 660)
    own = plan_memory(TWO_LAYERS, 4, 2, BF16_FP32, slot_reuse=False)["tide"]
    assert own.parts["rs_staging_extra"] == 2 * 256  # 2 slots of round128(220)
    assert own.rs_bytes == 512 + 660
    rows4 = plan_memory(TWO_LAYERS, 4, 2, BF16_FP32, rs_rows=4, rs_inflight=1)["tide"]
    assert rows4.parts["rs_cross_node_fp32"] == 2 * 220  # K + 1 = 2; rows capped at L = 2
    tide_ag = plan_memory(TWO_LAYERS, 4, 2, BF16_FP32)["tide_ag"]
    assert (tide_ag.ag_bytes, tide_ag.rs_bytes) == (768, 1760)  # TIDE-AG slots + stock RS
    assert tide_ag.residency == "AG persistent, RS transient"


def test_one_rank_per_node_has_no_copy_engine_slots():
    tide = plan_memory(TWO_LAYERS, 4, 1, BF16_FP32)["tide"]
    assert tide.ag_bytes == 0
    # point-to-point: one staging buffer of R = 1 row (55 bf16); 4 nodes: 3 fp32 buffers
    assert tide.parts == {"ag_slots": 0, "rs_staging_extra": 110, "rs_cross_node_fp32": 660}


def test_stock_rs_grows_with_world_tide_rs_flat_at_fixed_shard():
    """Model width scales with W so that every rank holds the same shard."""
    shard_rows = 1024
    stock, tide = {}, {}
    for world in (16, 32, 64):
        groups = [GroupShape(f"layers.{i}", ((world * shard_rows, 64),)) for i in range(3)]
        plans = plan_memory(groups, world, 8, BF16_FP32)
        assert group_shard_numel(groups[0], world) == shard_rows * 64
        stock[world], tide[world] = plans["fsdp2"].rs_bytes, plans["tide"].rs_bytes
    assert stock[32] == 2 * stock[16] and stock[64] == 4 * stock[16]
    assert tide[16] == tide[32] == tide[64] == 3 * shard_rows * 64 * 4
    assert tide[64] * 20 < stock[64]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world": 6, "local_world_size": 4}, "local_world_size=4"),
        ({"world": 4, "local_world_size": 2, "rs_rows": 0}, "rs_rows"),
        ({"world": 4, "local_world_size": 2, "rs_inflight": -1}, "rs_inflight"),
    ],
)
def test_plan_memory_errors_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(TWO_LAYERS, dtypes=BF16_FP32, **kwargs)


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(13, 7)
        self.layers = nn.ModuleDict({str(i): nn.Linear(7, 13) for i in range(2)})
        self.norm = nn.LayerNorm(13)
        self.output = nn.Linear(13, 5, bias=False)
        self.extra = nn.Parameter(nn.init.zeros_(nn.Linear(1, 3).weight))


def test_groups_follow_torchtitan_apply_fsdp():
    groups, sentence = fsdp_groups.fsdp_groups(TinyLlama(), "llama3_tide")
    assert [g.name for g in groups] == [
        "root",
        "tok_embeddings",
        "layers.0",
        "layers.1",
        "norm+output",
    ]
    assert groups[0].param_shapes == ((3, 1),)
    assert groups[2].param_shapes == ((13, 7), (13,))
    assert groups[-1].param_shapes == ((13,), (13,), (5, 13))
    assert [g.reshard_after_forward for g in groups] == [False, True, True, True, False]
    assert "one per block of model.layers" in sentence
    generic, sentence = fsdp_groups.fsdp_groups(TinyLlama(), "someone_elses_spec", "never")
    assert [g.name for g in generic] == ["root", "layers.0", "layers.1"]
    assert not any(g.reshard_after_forward for g in generic)
    assert "generic" in sentence


def test_model_without_layers_is_a_named_error():
    with pytest.raises(fsdp_groups.FsdpGroupsError, match="no `layers` container"):
        fsdp_groups.fsdp_groups(nn.Linear(2, 2), "llama3_tide")
    with pytest.raises(fsdp_groups.FsdpGroupsError, match="fsdp_reshard_after_forward"):
        fsdp_groups.fsdp_groups(TinyLlama(), "llama3_tide", "sometimes")


def _run_cli(capsys, *argv: str) -> str:
    assert memory_report.main(list(argv)) == 0
    return capsys.readouterr().out


def test_cli_debug_model(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    out = _run_cli(capsys, "--config", "debug_model.toml", "--gpus", "2", "--json", str(out_json))
    for row in ("| mode", "| fsdp2", "| symm_mem", "| tide ", '| tide, reduce_scatter="fsdp2"'):
        assert row in out
    assert "tide_ag" not in out and "Formulas" not in out
    assert "How each figure is computed: add --formulas." in out
    with_formulas = _run_cli(capsys, "--config", "debug_model.toml", "--gpus", "2", "--formulas")
    assert 'tide, reduce_scatter="fsdp2" rs: as fsdp2' in with_formulas
    assert "FSDP groups as TorchTitan 0.2.2 llama3/llama4 apply_fsdp" in out
    report = json.loads(out_json.read_text())
    assert report["dtypes"]["ag_bytes"] == 4  # float32 params in the debug config
    world = report["world"]
    assert (world["gpus"], world["fsdp_shard_degree"], world["nodes"]) == (2, 2, 1)


def test_cli_llama70b_4layers_2_and_64_gpus(capsys, tmp_path):
    path = tmp_path / "p.json"
    out = _run_cli(
        capsys, "--config", "h200x2_llama70b_4layers", "--gpus", "2", "--json", str(path)
    )
    assert "one node of 2" in out
    report = json.loads(path.read_text())
    largest = max(g["shard_numel"] for g in report["groups"])
    assert largest == 525_340_672  # norm+output: ceil(128256/2)*8192 + 8192/2
    fsdp2 = report["modes"]["fsdp2"]
    assert fsdp2["ag_bytes"] == 2 * 2 * largest * 2
    assert fsdp2["rs_bytes"] == 2 * 2 * largest * 4
    out = _run_cli(
        capsys, "--config", "h200x2_llama70b_4layers", "--gpus", "64", "--json", str(path)
    )
    report = json.loads(path.read_text())
    assert report["world"]["nodes"] == 8 and report["world"]["local_ranks_per_node"] == 8
    tide = report["modes"]["tide"]
    assert tide["parts"]["rs_cross_node_fp32"] > 0
    assert tide["comm_buffer_bytes"] < report["modes"]["fsdp2"]["comm_buffer_bytes"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--config", "debug_model", "--gpus", "12"],
            "--gpus 12 is not a multiple of --local-world-size 8",
        ),
        (["--config", "debug_model", "--gpus", "0"], "--gpus 0"),
        (["--config", "debug_model", "--gpus", "1"], "shard degree 1"),
        (["--config", "no_such_config", "--gpus", "8"], "--config 'no_such_config'"),
        (["--config", "debug_model", "--gpus", "8", "--rs-rows", "0"], "--rs-rows 0"),
    ],
)
def test_cli_bad_flags_name_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        memory_report.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _toml(tmp_path, model: str, parallelism: str = "") -> str:
    path = tmp_path / "x.toml"
    path.write_text(f"[model]\n{model}\n[parallelism]\n{parallelism}\n")
    return str(path)


@pytest.mark.parametrize(
    "model, parallelism, message",
    [
        ('name = "nope"\nflavor = "x"', "", "[model] name = 'nope'"),
        ('name = "llama3_tide"\nflavor = "nope"', "", "[model] flavor = 'nope'"),
        (
            'name = "llama3_tide"\nflavor = "debugmodel"',
            "tensor_parallel_degree = 2",
            "[parallelism] tensor_parallel_degree = 2",
        ),
        (
            'name = "llama3_tide"\nflavor = "debugmodel"',
            "data_parallel_shard_degree = 4",
            "data_parallel_shard_degree = 4",
        ),
    ],
)
def test_cli_bad_toml_names_the_key(capsys, tmp_path, model, parallelism, message):
    with pytest.raises(SystemExit):
        memory_report.main(["--config", _toml(tmp_path, model, parallelism), "--gpus", "8"])
    assert message in capsys.readouterr().err


def test_world_hsdp_and_cp():
    table = {"parallelism": {"data_parallel_replicate_degree": 2, "context_parallel_degree": 2}}
    world = fsdp_groups.world_for(table, 64, 8)
    assert (world.shard_degree, world.local, world.nodes) == (32, 8, 4)  # dp_shard 16 x cp 2
    world = fsdp_groups.world_for({"parallelism": {"data_parallel_replicate_degree": 16}}, 64, 8)
    assert (world.shard_degree, world.local, world.nodes) == (4, 4, 1)


def test_cli_reads_tide_section_and_flags_override(capsys, tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(
        '[job]\ncustom_config_module = "torchtitan_tide.config"\n'
        '[model]\nname = "llama3_tide"\nflavor = "debugmodel"\n'
        '[tide]\ncomm = "tide"\nreduce_scatter = "fsdp2"\nrs_inflight = 3\nlocal_world_size = 4\n'
    )
    out_json = tmp_path / "t.json"
    _run_cli(capsys, "--config", str(path), "--gpus", "8", "--json", str(out_json))
    report = json.loads(out_json.read_text())
    assert report["selected_comm"] == "tide_ag"
    assert report["options"] == {
        "rs_rows": 2,
        "rs_inflight": 3,
        "slot_reuse": True,
        "cross_node": "p2p",
        "ag_in_place_groups": 4,
    }
    assert report["world"]["nodes"] == 2
    assert report["world"]["local_world_size_from"] == "[tide] local_world_size"
    argv = ["--config", str(path), "--gpus", "8", "--json", str(out_json)]
    _run_cli(capsys, *argv, "--rs-inflight", "1", "--no-slot-reuse", "--local-world-size", "8",
             "--cross-node", "one_sided")  # fmt: skip
    report = json.loads(out_json.read_text())
    assert report["options"] == {
        "rs_rows": 2,
        "rs_inflight": 1,
        "slot_reuse": False,
        "cross_node": "one_sided",
        "ag_in_place_groups": 4,
    }
    assert report["world"]["nodes"] == 1


def test_one_sided_windows_are_counted():
    """The one-sided transports' windows as install sizes them: TIDE-AG's rail entries
    (2N packed shards at one rank per node) plus TIDE-RS's rows in one window, the phase-2
    ring of 2K regions of the largest fp32 shard (256-byte rounded) whatever N; send/recv's
    ring is (K + 1) fp32 shards."""
    from torchtitan_tide.comm.plans.memory_plan import CommDtypes, GroupShape, plan_memory
    from torchtitan_tide.comm.plans.window_rounds import window_layout
    from torchtitan_tide.comm.transports.windows.ring import rs_ring_bytes

    groups = [GroupShape("layer", ((1000, 64),))]
    dtypes = CommDtypes(param_bytes=2, reduce_bytes=4, master_bytes=4)
    shard = 1000 // 4 * 64  # W = 4
    p2p = plan_memory(groups, 4, 1, dtypes, rs_inflight=2)["tide"]
    one = plan_memory(groups, 4, 1, dtypes, rs_inflight=2, cross_node="one_sided",
                      ag_in_place_groups=4)["tide"]  # fmt: skip
    assert p2p.parts["rs_cross_node_fp32"] == 3 * shard * 4
    assert one.parts["rs_cross_node_fp32"] == rs_ring_bytes(2, shard * 4, wire=False)
    # one rank per node: the window also holds the in-place all-gather's arena (the unsharded
    # group, as fsdp_internals.unsharded_bytes sizes it); without it, the placement window
    arena = 1000 * 64 * 2
    assert one.parts["ag_arena"] == arena
    assert one.ag_bytes == window_layout(4, 1, shard * 2, 0, arena_bytes=arena).total_bytes
    assert one.ag_bytes + one.parts["rs_staging_extra"] == window_layout(
        4, 1, shard * 2, max(shard * 2, shard * 4), arena_bytes=arena).total_bytes
    placed = plan_memory(groups, 4, 1, dtypes, rs_inflight=2, cross_node="one_sided",
                         ag_in_place_groups=0)["tide"]  # fmt: skip
    assert "ag_arena" not in placed.parts
    assert placed.ag_bytes == window_layout(4, 1, shard * 2, 0).total_bytes
    assert one.ag_bytes - placed.ag_bytes == arena
    with pytest.raises(ValueError, match="ag_in_place_groups"):
        plan_memory(groups, 4, 1, dtypes, cross_node="one_sided", ag_in_place_groups=-1)
    # the ring does not grow with the node count at a fixed per-rank shard
    groups16 = [GroupShape("layer", ((4000, 64),))]  # W = 16: the same shard per rank
    one16 = plan_memory(groups16, 16, 1, dtypes, rs_inflight=2, cross_node="one_sided")["tide"]
    assert one16.parts["rs_cross_node_fp32"] == one.parts["rs_cross_node_fp32"]
    with pytest.raises(ValueError, match="cross_node"):
        plan_memory(groups, 4, 1, dtypes, cross_node="rdma")


def test_cli_counts_the_in_place_arena(capsys, tmp_path):
    """``--ag-in-place-groups`` (else ``[tide] ag_in_place_groups``): one-sided at one rank
    per node, the window's arena shows as ``ag_arena``, a share of ``ag_slots``."""
    out_json = tmp_path / "plan.json"
    base = ["--config", "debug_model.toml", "--gpus", "4", "--local-world-size", "1",
            "--cross-node", "one_sided", "--json", str(out_json)]  # fmt: skip
    out = _run_cli(capsys, *base, "--ag-in-place-groups", "0")
    placed = json.loads(out_json.read_text())["modes"]["tide"]["parts"]
    assert "ag_arena" not in placed and "ag_arena" not in out
    arenas = {}
    for flag in ([], ["--ag-in-place-groups", "2"]):  # the default ([tide]: 4 groups), then 2
        out = _run_cli(capsys, *base, *flag)
        report = json.loads(out_json.read_text())
        parts = report["modes"]["tide"]["parts"]
        groups = report["options"]["ag_in_place_groups"]
        assert groups == (int(flag[1]) if flag else 4), report["options"]
        assert parts["ag_slots"] - placed["ag_slots"] == parts["ag_arena"] > 0
        assert "ag_arena (of ag_slots)" in out
        arenas[groups] = parts["ag_arena"]
    assert arenas[4] > arenas[2], arenas
    with pytest.raises(SystemExit):
        memory_report.main([*base, "--ag-in-place-groups", "-1"])


@pytest.mark.parametrize("config", ["llama70b_tide", "qwen3_30b_a3b_tide"])
def test_in_place_window_at_8x8_holds_no_more_than_stock_in_flight(capsys, tmp_path, config):
    """The paper's layout (8 nodes x 8): TIDE's window with the in-place arena (4 groups,
    persistent) holds no more than stock FSDP2's flat all-gather buffers plus the unsharded
    parameters of the groups it holds at once (``ag_outputs_in_flight``, transient); without
    the arena the window is the placement path's rail and local entries. The only excess
    allowed is alignment: every parameter of a packed entry 16-byte aligned in the 2 x W
    entries (12 parameters a Qwen3 block: 3 KiB at 8 x 8) and the window's areas 256-byte
    aligned."""
    out_json = tmp_path / "plan.json"
    windows = {}
    for groups in ("4", "0"):
        _run_cli(capsys, "--config", config, "--gpus", "64", "--local-world-size", "8",
                 "--cross-node", "one_sided", "--ag-in-place-groups", groups,
                 "--json", str(out_json))  # fmt: skip
        modes = json.loads(out_json.read_text())["modes"]
        windows[groups] = modes["tide"]["parts"]
        in_flight = modes["fsdp2"]["parts"]["ag_outputs_in_flight"]
    assert windows["4"]["ag_arena"] > 0 and "ag_arena" not in windows["0"]
    assert windows["4"]["ag_slots"] - windows["0"]["ag_slots"] == windows["4"]["ag_arena"]
    alignment = 2 * 64 * 12 * 16 + 5 * 256
    assert windows["4"]["ag_slots"] <= in_flight + alignment, (windows["4"]["ag_slots"], in_flight)
