"""[tide] validation: every bad key or value fails with an error that names it."""

import pytest

from torchtitan_tide.config import (
    Tide,
    TideConfigError,
    check_config_file,
    validate_tide_table,
)


def test_defaults_are_stock_fsdp2():
    tide = validate_tide_table(None)
    assert tide.comm == "fsdp2" and tide.fallback == "none"
    assert tide.comm_options() == {}


@pytest.mark.parametrize(
    "table, names",
    [
        ({"comm": "nccl"}, ["comm", "'nccl'", "fsdp2", "symm_mem", "tide"]),
        ({"comm": "FSDP2"}, ["comm", "'FSDP2'"]),
        ({"fallback": "stock"}, ["fallback", "'stock'", "none"]),
        ({"ag_transport": "rdma"}, ["ag_transport", "'rdma'", "copy_engine", "nccl_p2p"]),
        ({"local_world_size": -1}, ["local_world_size", ">= 0"]),
        ({"local_world_size": "2"}, ["local_world_size", "integer"]),
        ({"local_world_size": True}, ["local_world_size", "integer"]),
        ({"ag_pacing": 1.5}, ["ag_pacing", "integer"]),
        ({"metrics_jsonl": "yes"}, ["metrics_jsonl", "boolean"]),
        ({"reduce_scatter": "nccl"}, ["reduce_scatter", "'nccl'", "tide", "fsdp2"]),
        ({"rs_ctas": -1}, ["rs_ctas", ">= 0"]),
        ({"rs_rows": "2"}, ["rs_rows", "integer"]),
        ({"rs_inflight": 0}, ["rs_inflight", ">= 1"]),
        ({"ag_in_place_groups": -1}, ["ag_in_place_groups", ">= 0"]),
        ({"ag_storage_swap": "memmove"}, ["ag_storage_swap", "'ctypes'"]),
        ({"rs_wire_dtype": "bf16"}, ["rs_wire_dtype", "'bf16'", "float32", "bfloat16"]),
        ({"rs_wire_dtype": "float16"}, ["rs_wire_dtype", "'float16'", "bfloat16"]),
        ({"slot_reuse": 1}, ["slot_reuse", "boolean"]),
        ({"slot_barrier": "spin"}, ["slot_barrier", "'spin'", "kernel"]),
        ({"install_timeout_s": 0}, ["install_timeout_s", ">= 1"]),
        ({"install_timeout_s": 2.5}, ["install_timeout_s", "integer"]),
        ({"com": "tide"}, ["unknown key", "'com'", "comm"]),
        ({"comm": "tide", "transport": "x"}, ["unknown key", "'transport'", "ag_transport"]),
    ],
)
def test_bad_values_name_the_key(table, names):
    with pytest.raises(TideConfigError) as info:
        validate_tide_table(table)
    message = str(info.value)
    assert "[tide]" in message
    for name in names:
        assert name in message, (name, message)


def test_tide_options_forwarded_only_for_tide():
    tide = Tide(comm="tide", ag_transport="nccl_p2p", local_world_size=1, ag_pacing=4,
                reduce_scatter="fsdp2", rs_ctas=8, slot_barrier="kernel")
    assert tide.comm_options() == {
        "transport": "nccl_p2p", "local_world_size": 1, "pacing": 4,
        "cross_node_transport": "auto", "reduce_scatter": "fsdp2", "rs_ctas": 8, "rs_rows": 2,
        "rs_inflight": 2, "rs_wire_dtype": "float32", "slot_reuse": True,
        "slot_barrier": "kernel", "ag_in_place_groups": 4, "ag_storage_swap": "native",
        "install_timeout_s": 120,
    }
    assert tide.options_ignored_by_mode() == []
    stock = Tide(comm="fsdp2", ag_transport="nccl_p2p", slot_reuse=False)
    assert stock.comm_options() == {}
    assert stock.options_ignored_by_mode() == ["ag_transport", "slot_reuse"]
    # Every option the TOML forwards is one comm.apply accepts.
    from torchtitan_tide.comm import TideOptions

    assert TideOptions.from_kwargs(**tide.comm_options()).reduce_scatter == "fsdp2"
    assert TideOptions.from_kwargs(**tide.comm_options()).slot_barrier == "kernel"
    with pytest.raises(ValueError, match="slot_barrier"):
        TideOptions(slot_barrier="spin")


def test_one_validation_for_toml_and_comm_apply():
    """The [tide] section and comm.apply's options are one type with one validation:
    the same bad value fails alike through both, naming the TOML key and the keyword."""
    from torchtitan_tide.comm import TideOptions
    from torchtitan_tide.comm.options import TideOptionError

    for key, kwarg, value in (("ag_pacing", "pacing", -2), ("rs_rows", "rs_rows", 0),
                              ("ag_transport", "transport", "nvls"),
                              ("rs_wire_dtype", "rs_wire_dtype", "fp8")):  # fmt: skip
        with pytest.raises(TideConfigError) as toml_error:
            validate_tide_table({key: value})
        with pytest.raises(TideOptionError) as apply_error:
            TideOptions.from_kwargs(**{kwarg: value})
        assert str(toml_error.value) == str(apply_error.value)
        assert f"[tide] {key}" in str(apply_error.value)
    # Defaults come from TideOptions; 0 is "detect" in both.
    assert Tide(comm="tide").tide_options() == TideOptions()
    assert TideOptions(local_world_size=0).local_world_size is None


def test_config_file_checks(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[job]\ncustom_config_module = "torchtitan_tide.config"\n[tide]\ncomm = "tide"\n')
    assert check_config_file(str(good)).comm == "tide"

    no_module = tmp_path / "no_module.toml"
    no_module.write_text('[tide]\ncomm = "tide"\n')
    with pytest.raises(TideConfigError, match="custom_config_module"):
        check_config_file(str(no_module))

    bad_value = tmp_path / "bad_value.toml"
    bad_value.write_text('[job]\ncustom_config_module = "torchtitan_tide.config"\n[tide]\ncomm = 3\n')
    with pytest.raises(TideConfigError, match="bad_value.toml.*comm = 3"):
        check_config_file(str(bad_value))

    broken = tmp_path / "broken.toml"
    broken.write_text("[tide\n")
    with pytest.raises(TideConfigError, match="not valid TOML"):
        check_config_file(str(broken))

    with pytest.raises(FileNotFoundError, match="missing.toml"):
        check_config_file(str(tmp_path / "missing.toml"))


def test_torchtitan_config_manager_merges_tide_section(repo, capsys):
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(
        ["--job.config_file", str(repo / "train_configs" / "debug_model.toml"), "--tide.comm", "tide",
         "--tide.local_world_size", "1"]
    )
    assert config.tide.comm == "tide"
    assert config.tide.local_world_size == 1
    assert config.model.name == "llama3_tide"

    # tyro reports errors raised while building the dataclass and exits.
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(
            ["--job.config_file", str(repo / "train_configs" / "debug_model.toml"),
             "--tide.ag_transport", "carrier_pigeon"]
        )
    printed = capsys.readouterr()
    text = " ".join((printed.out + printed.err).replace("│", " ").split())
    assert "[tide] ag_transport (comm.apply option transport) = 'carrier_pigeon' is not valid" in text


def test_every_shipped_config_validates(repo):
    configs = sorted((repo / "train_configs").glob("*.toml"))
    assert configs, "no configs shipped"
    for path in configs:
        check_config_file(str(path))
