"""run_train.sh: config lookup, overrides passed through, world from env/SLURM, and every
bad run refused before any process starts."""

import os
import shlex
import subprocess
import sys

import pytest

from torchtitan_tide.config import load_toml
from torchtitan_tide.launch import checks, command_line, job_config, main


def run_dry(repo, args, cwd=None, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NGPU", "NNODES", "NODE_RANK", "MASTER_"))}
    full_env.update(TIDE_DEVICE="cpu", PYTHON=sys.executable, **env)
    return subprocess.run(
        [str(repo / "run_train.sh"), *args, "--dry-run"],
        capture_output=True, text=True, env=full_env, cwd=cwd or repo, timeout=120, check=False,
    )


def command_of(stdout: str) -> list[str]:
    line = [ln for ln in stdout.splitlines() if "torchtitan_tide.torchrun" in ln][-1]
    return shlex.split(line.removeprefix("[run_train] "))


def test_config_by_name_and_path_and_overrides(repo, tmp_path):
    by_name = run_dry(repo, ["--config", "debug_model", "--training.steps", "7", "--tide.comm=tide"])
    assert by_name.returncode == 0, by_name.stderr
    cmd = command_of(by_name.stdout)
    config_path = str(repo / "train_configs" / "debug_model.toml")
    assert cmd[cmd.index("--job.config_file") + 1] == config_path
    assert cmd[-3:] == ["--training.steps", "7", "--tide.comm=tide"]
    assert "--nproc_per_node=2" in cmd
    assert "comm        tide" in by_name.stdout
    assert "2 = 1 node(s) x 2 CPU processes (gloo)" in by_name.stdout
    assert "llama3_tide / flavor debugmodel" in by_name.stdout

    with_suffix = run_dry(repo, ["--config=debug_model.toml"])
    # stdout is a pipe here: TorchTitan's colour codes are off (test_plain_logs_off_a_terminal)
    assert command_of(with_suffix.stdout)[-3:] == [
        "--job.config_file", config_path, "--metrics.disable_color_printing"]

    copy = tmp_path / "mine.toml"
    copy.write_text((repo / "train_configs" / "debug_model.toml").read_text())
    by_path = run_dry(repo, ["--config", str(copy), "--model.flavor", "debugmodel_flex_attn"], cwd=tmp_path)
    assert by_path.returncode == 0, by_path.stderr
    cmd = command_of(by_path.stdout)
    assert cmd[cmd.index("--job.config_file") + 1] == str(copy)
    assert "flavor debugmodel_flex_attn" in by_path.stdout

    relative = run_dry(repo, ["--config", "mine.toml"], cwd=tmp_path)
    assert relative.returncode == 0, relative.stderr


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--training.steps", "3"], {}, "missing --config"),
        (["--config", "no_such_config"], {}, "available configs"),
        (["--config"], {}, "--config needs a value"),
        (["--config", "debug_model", "--job.config_file", "x.toml"], {}, "use --config NAME"),
        (["--config", "debug_model", "--tide.comm", "nccl"], {}, "[tide] comm = 'nccl' is not valid"),
        (["--config", "debug_model", "--tide.local_world_size", "two"], {}, "--tide.local_world_size"),
        (["--config", "debug_model"], {"NGPU": "abc"}, "NGPU='abc' must be an integer"),
        (["--config", "debug_model"], {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK=2"),
        (["--config", "debug_model"], {"NNODES": "2"}, "MASTER_ADDR"),
        # Issue 22: passed the dry run, then failed in tyro on every rank after 19 s.
        (["--config", "debug_model", "--training.bogus_key", "1"], {},
         "--training.bogus_key is not a TorchTitan 0.2.2 or [tide] option"),
    ],
)
def test_bad_input_is_a_named_error(repo, args, env, message):
    result = run_dry(repo, args, **env)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr


def test_multi_node_from_env_and_slurm(repo):
    result = run_dry(repo, ["--config", "debug_model"], NGPU="4", NNODES="2", NODE_RANK="1",
                     MASTER_ADDR="node-a", MASTER_PORT="29555")
    assert result.returncode == 0, result.stderr
    cmd = command_of(result.stdout)
    for flag in ("--nproc_per_node=4", "--nnodes=2", "--node_rank=1", "--master_addr=node-a",
                 "--master_port=29555"):
        assert flag in cmd
    assert "world       8 = 2 node(s) x 4 CPU processes" in result.stdout
    assert "dp_shard 8" in result.stdout

    slurm = run_dry(repo, ["--config", "debug_model"], SLURM_NNODES="8", SLURM_NODEID="3",
                    MASTER_ADDR="head")
    cmd = command_of(slurm.stdout)
    assert "--nnodes=8" in cmd and "--node_rank=3" in cmd and "--master_addr=head" in cmd


def test_override_values_parsing():
    values = command_line.override_values(
        ["--training.steps", "5", "--tide.comm=tide", "--checkpoint.enable", "--metrics.log-freq", "2"]
    )
    assert values == {"training.steps": "5", "tide.comm": "tide", "checkpoint.enable": "true",
                      "metrics.log_freq": "2"}


def dry_main(monkeypatch, capsys, *args, dry_run=True):
    """launch.main in this process (no subprocess): (return code, stdout, stderr). Without
    ``dry_run`` the launch is real but torchrun is not: starting it fails the test."""
    for key in ("NGPU", "NNODES", "NODE_RANK", "MASTER_ADDR", "SLURM_NNODES", "SLURM_NODEID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TIDE_DEVICE", "cpu")

    def no_start(cmd, **kwargs):
        raise AssertionError(f"the launcher started {cmd}")

    monkeypatch.setattr(main.subprocess, "call", no_start)
    code = main.main(["--config", "debug_model", *args, *(["--dry-run"] if dry_run else [])])
    out, err = capsys.readouterr()
    return code, out, err


def refused(monkeypatch, capsys, *args) -> str:
    """The launcher's error for ``args``, after checking it refused (rc 2) before starting
    anything, in a dry run and in a real launch alike."""
    code, out, err = dry_main(monkeypatch, capsys, *args)
    assert code == 2, out
    assert "torchtitan_tide.torchrun" not in out and err.startswith("run_train.sh: error: ")
    assert dry_main(monkeypatch, capsys, *args, dry_run=False)[2] == err
    return err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.seq_len", "0"], "--training.seq_len 0 (tokens per sample) must be an integer >= 1"),
        (["--training.local_batch_size", "0"], "--training.local_batch_size 0"),
        (["--training.steps", "-5"], "--training.steps -5"),
        (["--training.steps", "ten"], "--training.steps 'ten' must be an integer"),
        (["--metrics.log_freq", "0"], "--metrics.log_freq 0"),
        (["--training.max_norm", "0"], "--training.max_norm 0 must be > 0"),
        (["--training.global_batch_size", "6"], "multiple of local_batch_size x data-parallel degree = 8"),
        (["--parallelism.tensor_parallel_degree", "3"], "each must be >= 1"),
        (["--parallelism.data_parallel_shard_degree", "4"], "multiply to 4, not the world size 2"),
        (["--tide.comm", "tide", "--tide.local_world_size", "3"],
         "--tide.local_world_size 3 must divide the FSDP group size 2"),
        (["--tide.slot_reuse", "maybe"], "'maybe' is not a boolean"),
    ],
)
def test_bad_run_values_fail_in_the_launcher(monkeypatch, capsys, args, message):
    code, out, err = dry_main(monkeypatch, capsys, *args)
    assert code == 2, out
    assert message in err, err
    assert "torchtitan_tide.torchrun" not in out  # nothing was started


def test_booleans_either_way(monkeypatch, capsys):
    keys = job_config.bool_keys(job_config.option_types("torchtitan_tide.config"))
    assert {"tide.slot_reuse", "tide.metrics_jsonl", "checkpoint.enable"} <= keys
    assert "quantize.linear.float8.emulate" in keys  # nested sections too
    normalize = command_line.normalize_bool_flags
    assert normalize(["--tide.slot_reuse", "false", "--training.steps", "3"], keys) == [
        "--tide.no_slot_reuse", "--training.steps", "3"]
    for off in (["--tide.slot-reuse=0"], ["--tide.no-slot-reuse"], ["--tide.slot_reuse", "No"]):
        assert normalize(off, keys) == ["--tide.no_slot_reuse"], off
    for on in (["--tide.slot_reuse"], ["--tide.slot-reuse", "true"], ["--tide.no_slot_reuse=false"]):
        assert normalize(on, keys) == ["--tide.slot_reuse"], on
    assert normalize(["--checkpoint.enable", "--tide.comm", "tide"], keys) == [
        "--checkpoint.enable", "--tide.comm", "tide"]
    assert normalize(["--quantize.linear.float8.emulate", "false"], keys) == [
        "--quantize.linear.float8.no_emulate"]

    code, out, _ = dry_main(monkeypatch, capsys, "--tide.comm", "tide", "--tide.slot_reuse", "false")
    assert code == 0
    assert "'slot_reuse': False" in out
    assert command_of(out)[-3:] == ["--tide.comm", "tide", "--tide.no_slot_reuse"]

    # What the launcher passes on is what TorchTitan's parser takes (also the train entry's form).
    from torchtitan.config import ConfigManager

    config = str(command_line.REPO_CONFIG_DIR / "debug_model.toml")
    for args, expected in (([ "--tide.no_slot_reuse"], False), (["--tide.slot_reuse"], True)):
        parsed = ConfigManager().parse_args(["--job.config_file", config, *args])
        assert parsed.tide.slot_reuse is expected
    tide = command_line.effective_tide(command_line.REPO_CONFIG_DIR / "debug_model.toml", load_toml(config),
                                 {"tide.no_slot_reuse": "true"})
    assert tide.slot_reuse is False


def test_help_and_dry_run_text(monkeypatch, capsys):
    assert main.main(["--help"]) == 0
    assert "./run_train.sh --config NAME[.toml] [--dry-run]" in capsys.readouterr().out

    code, out, _ = dry_main(monkeypatch, capsys, "--tide.comm", "tide")
    assert code == 0
    assert "tide layout local_world_size 0: nodes detected at start" in out
    assert out.strip().splitlines()[-1] == "[run_train] dry run: nothing started (drop --dry-run to train)"
    code, out, _ = dry_main(monkeypatch, capsys, "--tide.comm", "tide", "--tide.local_world_size", "1")
    assert "local_world_size 1 (option): 2 node(s) x 1 rank(s)" in out


def no_site_python(tmp_path) -> str:
    """A python that sees the standard library and PYTHONPATH only (``-S``: no
    site-packages), as before scripts/install.sh: torch and TorchTitan do not import."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    assert subprocess.run([str(wrapper), "-c", "import torch"], capture_output=True,
                          check=False).returncode
    return str(wrapper)


def test_help_before_the_install_and_into_a_closed_pipe(repo, tmp_path):
    env = {**os.environ, "PYTHON": no_site_python(tmp_path)}
    result = subprocess.run([str(repo / "run_train.sh"), "--help"], capture_output=True,
                            text=True, env=env, timeout=60, check=False)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "./run_train.sh --config NAME[.toml] [--dry-run]" in result.stdout
    assert "TIDE_LOG_ALL" in result.stdout and "TIDE_DEVICE" in result.stdout

    # `--help | head` once head has its lines: the reader is gone before the launcher writes.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        closed = subprocess.run([str(repo / "run_train.sh"), "--help"], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, env=env, timeout=60,
                                check=False)
    finally:
        os.close(write_end)
    assert closed.returncode == 0 and closed.stderr == "", closed.stderr

    # Anything but --help needs torch: a named error with the fix, no traceback.
    run = subprocess.run([str(repo / "run_train.sh"), "--config", "debug_model"],
                         capture_output=True, text=True, env=env, timeout=60, check=False)
    assert run.returncode == 2 and run.stderr == (
        "run_train.sh: error: No module named 'torch'; install first: bash scripts/install.sh "
        "(README, Quick start)\n"), run.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.bogus_key", "1"],
         "--training.bogus_key is not a TorchTitan 0.2.2 or [tide] option; did you mean "),
        (["--training.stepz", "3"], "did you mean --training.steps"),
        (["--training.no-compile"], "--training.no_compile is not a TorchTitan 0.2.2 or [tide] option"),
        (["--training.dtype", "float16"],
         ("TorchTitan's parser refuses the job config: invalid choice 'float16' for argument "
          "'--training.dtype'. Expected one of ('bfloat16', 'float32').")),
    ],
)
def test_job_config_parsed_as_the_trainer_will(monkeypatch, capsys, args, message):
    err = refused(monkeypatch, capsys, *args)
    assert message in err and job_config.OPTIONS_HELP in err, err


def test_unknown_toml_key_is_named_with_its_file(monkeypatch, capsys, tmp_path):
    config = tmp_path / "typo.toml"
    text = (command_line.REPO_CONFIG_DIR / "debug_model.toml").read_text()
    config.write_text(text.replace("[training]\n", "[training]\nwarmup_stepz = 3\n", 1))
    code, _, err = dry_main(monkeypatch, capsys, "--config", str(config))
    assert code == 2
    assert f"[training] warmup_stepz in {config} is not a TorchTitan 0.2.2 or [tide] option" in err
    # What passes the launcher is what TorchTitan's parser, as the trainer runs it, accepts.
    parsed = job_config.parse_job_config(job_config.trainer_args(
        command_line.REPO_CONFIG_DIR / "debug_model.toml", ["--tide.comm", "tide", "--training.steps", "3"]))
    assert parsed.tide.comm == "tide" and parsed.training.steps == 3


def test_custom_config_module_that_does_not_import(monkeypatch, capsys):
    err = refused(monkeypatch, capsys, "--job.custom_config_module", "torchtitan_tide.no_such")
    assert "job.custom_config_module 'torchtitan_tide.no_such' has no JobConfig to import" in err
    assert 'set [job] custom_config_module = "torchtitan_tide.config"' in err


def test_symm_mem_on_a_cpu_world(monkeypatch, capsys):
    err = refused(monkeypatch, capsys, "--tide.comm", "symm_mem")
    assert "--tide.comm symm_mem ([tide] comm) cannot run on this CPU world: comm = 'symm_mem' " \
        "needs CUDA GPUs with the NCCL backend" in err
    assert "use --tide.comm fsdp2 (or tide, which runs on gloo), or set [tide] fallback = 'fsdp2' " \
        "(--tide.fallback fsdp2)" in err
    # With the fallback the launcher starts the run and says what the ranks will do
    # (tests/test_comm_mode.py: the ranks decide alike).
    code, out, _ = dry_main(monkeypatch, capsys, "--tide.comm", "symm_mem", "--tide.fallback", "fsdp2")
    assert code == 0
    assert "comm        symm_mem (fallback fsdp2); the ranks will fall back to fsdp2: comm = " \
        "'symm_mem' needs CUDA GPUs with the NCCL backend" in out


def test_dump_folder_that_cannot_be_written(monkeypatch, capsys, tmp_path):
    a_file = tmp_path / "results.txt"
    a_file.write_text("not a folder")
    err = refused(monkeypatch, capsys, "--job.dump_folder", str(a_file / "run1"))
    assert f"--job.dump_folder '{a_file / 'run1'}': {a_file} is a file, not a folder" in err
    assert "pass --job.dump_folder a folder you can write" in err
    err = refused(monkeypatch, capsys, "--job.dump_folder", str(a_file))
    assert f"{a_file} is a file, not a folder" in err

    config = tmp_path / "mine.toml"
    text = (command_line.REPO_CONFIG_DIR / "debug_model.toml").read_text()
    config.write_text(text.replace('dump_folder = "./outputs/debug_model"', f'dump_folder = "{a_file}/x"'))
    code, _, err = dry_main(monkeypatch, capsys, "--config", str(config))
    assert code == 2 and f"[job] dump_folder in {config} '{a_file}/x': {a_file} is a file" in err, err

    monkeypatch.setattr(checks.os, "access", lambda path, mode: False)  # root writes anywhere
    err = refused(monkeypatch, capsys, "--job.dump_folder", str(tmp_path / "new" / "run"))
    assert f"not writable by this user ({tmp_path}, where it would be created)" in err


def test_plain_logs_off_a_terminal(monkeypatch, capsys, repo, tmp_path):
    """A batch job's log file gets no ANSI colour codes: with stdout not a terminal the
    launcher turns TorchTitan's colour off, unless the run sets the key itself."""
    flag = "--metrics.disable_color_printing"
    code, out, _ = dry_main(monkeypatch, capsys)  # capsys: stdout is no terminal
    assert code == 0 and flag in command_of(out)
    for user_choice in (["--metrics.no-disable-color-printing"], ["--metrics.disable_color_printing", "false"]):
        code, out, _ = dry_main(monkeypatch, capsys, *user_choice)
        assert code == 0 and flag not in command_of(out)
        assert "--metrics.no_disable_color_printing" in command_of(out), user_choice
    config = tmp_path / "colour.toml"
    text = (command_line.REPO_CONFIG_DIR / "debug_model.toml").read_text()
    config.write_text(text.replace("[metrics]\n", "[metrics]\ndisable_color_printing = false\n", 1))
    code, out, err = dry_main(monkeypatch, capsys, "--config", str(config))
    assert code == 0 and flag not in command_of(out), err

    monkeypatch.setattr(main.sys.stdout, "isatty", lambda: True)  # an interactive terminal
    code, out, _ = dry_main(monkeypatch, capsys)
    assert code == 0 and flag not in command_of(out)
