"""run_train.sh: config lookup, overrides passed through, world from env/SLURM."""

import os
import shlex
import subprocess
import sys

import pytest

from torchtitan_tide import launch


def run_dry(repo, args, cwd=None, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NGPU", "NNODES", "NODE_RANK", "MASTER_"))}
    full_env.update(TIDE_DEVICE="cpu", PYTHON=sys.executable, **env)
    return subprocess.run(
        [str(repo / "run_train.sh"), *args, "--dry-run"],
        capture_output=True, text=True, env=full_env, cwd=cwd or repo, timeout=120, check=False,
    )


def command_of(stdout: str) -> list[str]:
    line = [ln for ln in stdout.splitlines() if "torch.distributed.run" in ln][-1]
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
    assert command_of(with_suffix.stdout) [-2:] == ["--job.config_file", config_path]

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
    values = launch.override_values(
        ["--training.steps", "5", "--tide.comm=tide", "--checkpoint.enable", "--metrics.log-freq", "2"]
    )
    assert values == {"training.steps": "5", "tide.comm": "tide", "checkpoint.enable": "true",
                      "metrics.log_freq": "2"}
