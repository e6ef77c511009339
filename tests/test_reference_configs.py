"""The shipped TOMLs: every one validates and parses; the 64-GPU reference siblings of each
model differ only in [tide]; the 2-GPU and reference configs name registered flavors."""

from pathlib import Path

import pytest

from torchtitan_tide.config import check_config_file, load_toml
from torchtitan_tide.launch.summary import parallelism_line

CONFIG_DIR = Path(__file__).resolve().parents[1] / "train_configs"
ALL_CONFIGS = sorted(CONFIG_DIR.glob("*.toml"))
MODES = ("fsdp2", "symm_mem", "tide")
# stem -> (train spec, flavor) of the 64-GPU (8 nodes x 8 GPUs) reference configs
REFERENCE = {
    "llama70b": ("llama3_tide", "70B"),
    "qwen3_30b_a3b": ("qwen3_tide", "30B-A3B"),
    "wan22_a14b": ("wan22", "t2v_a14b"),
}
TWO_GPU = {
    "h200x2_llama70b_4layers": ("llama3_tide", "70B_4layers"),
    "h200x2_qwen3_30b_a3b_4layers": ("qwen3_tide", "30B-A3B_4layers"),
    "h200x2_wan22_a14b_20layers": ("wan22", "t2v_a14b_20layers"),
}


def _ids(paths):
    return [p.stem for p in paths]


def test_reference_and_two_gpu_configs_exist():
    names = {p.stem for p in ALL_CONFIGS}
    expected = {f"{stem}_{mode}" for stem in REFERENCE for mode in MODES} | set(TWO_GPU)
    assert expected <= names, sorted(expected - names)


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_ids(ALL_CONFIGS))
def test_every_config_validates(path):
    table = load_toml(str(path))
    check_config_file(str(path))
    assert table["job"]["custom_config_module"] == "torchtitan_tide.config"
    assert table["experimental"]["custom_import"] == "torchtitan_tide.train_specs"
    assert table["debug"]["seed"] == 42


@pytest.mark.parametrize("stem", sorted(REFERENCE))
def test_siblings_differ_only_in_tide(stem):
    tables = {mode: load_toml(str(CONFIG_DIR / f"{stem}_{mode}.toml")) for mode in MODES}
    assert {mode: t["tide"]["comm"] for mode, t in tables.items()} == {m: m for m in MODES}
    rest = {mode: {k: v for k, v in t.items() if k != "tide"} for mode, t in tables.items()}
    assert rest["fsdp2"] == rest["symm_mem"] == rest["tide"]


@pytest.mark.parametrize("stem", sorted(REFERENCE))
def test_reference_settings(stem):
    """The 64-GPU setting of issue 6: pure FSDP over every rank, bf16/fp32, fused AdamW, AC,
    checkpoints, log every 10 steps."""
    table = load_toml(str(CONFIG_DIR / f"{stem}_fsdp2.toml"))
    par, train = table["parallelism"], table["training"]
    assert (table["model"]["name"], table["model"]["flavor"]) == REFERENCE[stem]
    assert par["data_parallel_shard_degree"] == -1
    assert parallelism_line(par, {}, world_size=64) == "dp_shard 64 dp_replicate 1 tp 1 pp 1 cp 1"
    assert par.get("expert_parallel_degree", 1) == 1
    assert (train["mixed_precision_param"], train["mixed_precision_reduce"]) == (
        "bfloat16",
        "float32",
    )
    assert table["optimizer"]["implementation"] == "fused"
    assert table["activation_checkpoint"]["mode"] in ("full", "selective")
    assert table["checkpoint"]["enable"] and 0 < table["checkpoint"]["interval"] <= train["steps"]
    assert table["metrics"]["log_freq"] == 10
    if stem == "wan22_a14b":
        assert table["wan22"]["source"] == "synthetic"
        assert table["wan22"]["expert"] == "high_noise"
    else:
        assert train["dataset"] == "tide_text"
        assert table["model"]["hf_assets_path"] == "torchtitan_tide/assets/tokenizer"
    if stem == "llama70b":
        assert train["local_batch_size"] * train["seq_len"] == 8192


@pytest.mark.parametrize("stem", sorted(TWO_GPU))
def test_two_gpu_configs(stem):
    table = load_toml(str(CONFIG_DIR / f"{stem}.toml"))
    assert (table["model"]["name"], table["model"]["flavor"]) == TWO_GPU[stem]
    assert table["tide"]["comm"] == "fsdp2"  # bench_step.py overrides --tide.comm per run
    assert table["parallelism"]["data_parallel_shard_degree"] == -1
    assert table["optimizer"]["implementation"] == "fused"
    assert table["training"]["mixed_precision_param"] == "bfloat16"


@pytest.fixture(scope="module")
def train_specs():
    from torchtitan.protocols.train_spec import get_train_spec

    import torchtitan_tide.train_specs  # noqa: F401  (registers the specs)

    return get_train_spec


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_ids(ALL_CONFIGS))
def test_flavor_is_registered(path, train_specs):
    model = load_toml(str(path))["model"]
    assert model["flavor"] in train_specs(model["name"]).model_args


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=_ids(ALL_CONFIGS))
def test_torchtitan_config_manager_parses(path, train_specs):
    from torchtitan.config import ConfigManager

    from models.wan22.job_config import validate_data_config

    table = load_toml(str(path))
    try:
        config = ConfigManager().parse_args(["--job.config_file", str(path)])
    except SystemExit as exc:  # tyro reports bad values and exits
        pytest.fail(f"ConfigManager rejected {path.name} (exit {exc.code}); see captured output")
    assert config.model.name == table["model"]["name"]
    assert config.model.flavor == table["model"]["flavor"]
    assert config.tide.comm == table["tide"]["comm"]
    assert config.training.seq_len == table["training"]["seq_len"]
    if table["model"]["name"] == "wan22":
        validate_data_config(config.wan22)
        assert config.wan22.expert == table["wan22"]["expert"]
