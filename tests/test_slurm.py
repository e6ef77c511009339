"""scripts/slurm/train.sbatch outside SLURM: the dry run's per-node commands (1 and 8 nodes),
hostnames from a stand-in scontrol, and the srun line run through a stand-in srun."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
NODE_LINE = re.compile(r"^\[node (\d+) (\S+)\] cd (\S+) && (.*)$")
# Variables the script reads: dropped from the caller's environment so each test sets its own.
SCRUBBED = ("SLURM_", "NCCL_", "NGPU", "NNODES", "NODE_RANK", "MASTER_", "DRY_RUN", "NODES")
SCRUBBED += ("REPO", "DUMP_FOLDER", "CONFIG")


def run_sbatch(args=(), path_dir=None, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED)}
    clean.update(TIDE_DEVICE="cpu", NGPU="8", PYTHON=sys.executable, **env)
    if path_dir is not None:
        clean["PATH"] = f"{path_dir}:{clean['PATH']}"
    return subprocess.run(
        ["bash", str(SBATCH), *args],
        check=False,
        capture_output=True,
        text=True,
        env=clean,
        cwd="/",
        timeout=120,
    )


def node_commands(stdout: str) -> list[tuple[int, str, dict[str, str], list[str]]]:
    """(node rank, host, env assignments, run_train.sh argv) of each printed node line."""
    nodes = []
    for line in stdout.splitlines():
        if match := NODE_LINE.match(line):
            rank, host, cwd, command = match.groups()
            assert shlex.split(cwd) == [str(REPO)]
            words = shlex.split(command)
            split = words.index("./run_train.sh")
            env = dict(w.split("=", 1) for w in words[:split])
            nodes.append((int(rank), host, env, words[split + 1 :]))
    return nodes


def check_nodes(stdout: str, hosts: list[str], config: str, extra: list[str]) -> None:
    nodes = node_commands(stdout)
    assert [n[0] for n in nodes] == list(range(len(hosts)))
    assert [n[1] for n in nodes] == hosts
    stem = config.removesuffix(".toml")
    for rank, _, env, argv in nodes:
        assert env == {
            "NNODES": str(len(hosts)),
            "NODE_RANK": str(rank),
            "MASTER_ADDR": hosts[0],
            "MASTER_PORT": "29500",
            "NGPU": "8",
        }
        assert argv == ["--config", config, "--job.dump_folder", f"./outputs/{stem}", *extra]


def test_dry_run_8_nodes_prints_every_node_and_resolves_node_0():
    hosts = [f"gpu{i:02d}" for i in range(8)]
    extra = ["--training.steps", "3"]
    result = run_sbatch(
        extra, CONFIG="llama70b_tide", NODES=" ".join(hosts), SLURM_NNODES="8", DRY_RUN="1"
    )
    assert result.returncode == 0, result.stderr
    check_nodes(result.stdout, hosts, "llama70b_tide", extra)
    # Node 0's command went through run_train.sh --dry-run: the launcher's view of the world.
    assert (
        "world       64 = 8 node(s) x 8 CPU processes (gloo); this node rank 0, rendezvous gpu00:29500"
        in result.stdout
    )
    assert "comm        tide" in result.stdout
    torchrun = [ln for ln in result.stdout.splitlines() if "torchtitan_tide.torchrun" in ln]
    assert len(torchrun) == 1
    cmd = shlex.split(torchrun[0].removeprefix("[run_train] "))
    for flag in (
        "--nproc_per_node=8",
        "--nnodes=8",
        "--node_rank=0",
        "--master_addr=gpu00",
        "--master_port=29500",
    ):
        assert flag in cmd
    assert cmd[cmd.index("--job.config_file") + 1] == str(
        REPO / "train_configs" / "llama70b_tide.toml"
    )
    assert cmd[-4:] == ["--job.dump_folder", "./outputs/llama70b_tide", *extra]


def test_dry_run_1_node_and_dry_run_argument():
    result = run_sbatch(
        ["--dry-run"], CONFIG="wan22_a14b_fsdp2.toml", NODES="solo", DRY_RUN="print"
    )
    assert result.returncode == 0, result.stderr
    check_nodes(result.stdout, ["solo"], "wan22_a14b_fsdp2.toml", [])
    assert "torchtitan_tide.torchrun" not in result.stdout  # DRY_RUN=print resolves nothing


def test_hostnames_from_scontrol(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(
        '#!/bin/bash\n[[ "$1 $2 $3" == "show hostnames node[1-3]" ]] && printf "node1\\nnode2\\nnode3\\n"\n'
    )
    scontrol.chmod(0o755)
    result = run_sbatch(
        path_dir=bin_dir,
        CONFIG="qwen3_30b_a3b_symm_mem",
        SLURM_JOB_NODELIST="node[1-3]",
        SLURM_NNODES="3",
        DRY_RUN="print",
    )
    assert result.returncode == 0, result.stderr
    check_nodes(result.stdout, ["node1", "node2", "node3"], "qwen3_30b_a3b_symm_mem", [])


def test_srun_runs_one_launcher_per_node_with_slurm_node_id(tmp_path):
    """The real path: srun (a stand-in that runs its command once per node with SLURM_NODEID)
    starts run_train.sh (a stand-in that prints its environment) in REPO on every node."""
    bin_dir, fake_repo = tmp_path / "bin", tmp_path / "repo"
    bin_dir.mkdir()
    fake_repo.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/bash\necho "srun $*"\nnodes=1\n'
        'while [[ "$1" == -* ]]; do [[ "$1" == --nodes=* ]] && nodes="${1#--nodes=}"; shift; done\n'
        'for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i "$@"; done\n'
    )
    (fake_repo / "run_train.sh").write_text(
        '#!/bin/bash\necho "launch cwd=$PWD NODE_RANK=$NODE_RANK NNODES=$NNODES '
        'MASTER_ADDR=$MASTER_ADDR NGPU=$NGPU NCCL_DEBUG=$NCCL_DEBUG args=$*"\n'
    )
    for script in (bin_dir / "srun", fake_repo / "run_train.sh"):
        script.chmod(0o755)
    result = run_sbatch(
        ["--tide.comm", "tide"],
        path_dir=bin_dir,
        REPO=str(fake_repo),
        CONFIG="llama70b_fsdp2",
        NODES="a b",
        SLURM_NNODES="2",
        SLURM_CPUS_ON_NODE="64",
    )
    assert result.returncode == 0, result.stderr
    srun = [ln for ln in result.stdout.splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1
    for option in (
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=64",
        "--kill-on-bad-exit=1",
    ):
        assert option in srun[0].split()
    launches = [ln for ln in result.stdout.splitlines() if ln.startswith("launch ")]
    args = "--config llama70b_fsdp2 --job.dump_folder ./outputs/llama70b_fsdp2 --tide.comm tide"
    assert launches == [
        f"launch cwd={fake_repo} NODE_RANK={rank} NNODES=2 MASTER_ADDR=a NGPU=8 NCCL_DEBUG=WARN args={args}"
        for rank in range(2)
    ]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NODES": "a"}, "set CONFIG"),
        ({"CONFIG": "x", "DRY_RUN": "1"}, "set NODES="),
        (
            {"CONFIG": "x", "DRY_RUN": "1", "NODES": "a b", "SLURM_NNODES": "3"},
            "SLURM_NNODES=3 but 2 hosts",
        ),
    ],
)
def test_errors_name_the_fix(env, message):
    result = run_sbatch(**env)
    assert result.returncode != 0
    assert message in result.stderr
