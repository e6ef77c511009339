"""The pieces of the one-GPU emulation that run without a GPU (docs/design/2026-12-02-emulation.md):
the per-node environment (tests/comm/_emulation.py and scripts/gpu/emulate.sh agree), the
command lines emulate.sh builds, the NCCL swap script (dry run, and a real swap of a stand-in
library file: swapped while the command runs, restored after, whatever it returned), the NCCL
version read from a library (a small C stand-in built here), and the readers of NCCL's log."""

from __future__ import annotations

import hashlib
import lzma
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _emulation import (
    MODES,
    emulated_env,
    first_visible_gpu,
    launcher_node_env,
    nccl_comms,
    nccl_versions,
)
from train_helpers import run_bounded

REPO = Path(__file__).resolve().parents[2]
EMULATE = REPO / "scripts" / "gpu" / "emulate.sh"
SWAP = REPO / "scripts" / "gpu" / "nccl_swap.sh"


def test_emulated_env_per_mode():
    assert emulated_env(3, "nodes") == {
        "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_HOSTID": "emunode3",
    }  # fmt: skip
    one = emulated_env(1, "one_node")
    assert one["NCCL_MULTI_RANK_GPU_ENABLE"] == "1" and "NCCL_HOSTID" not in one
    with pytest.raises(ValueError, match="choose one of"):
        emulated_env(0, "cluster")
    assert launcher_node_env(2) == {"GROUP_RANK": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert first_visible_gpu({"CUDA_VISIBLE_DEVICES": "3,1"}) == "3"
    assert first_visible_gpu({}) == "0"


def _dry_run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(EMULATE), *args], capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "MASTER_PORT": "29123", **(env or {})},
    )  # fmt: skip


def _node_commands(stdout: str) -> list[list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("[emulate] node ")]
    return [shlex.split(line.split(":", 1)[1]) for line in lines]


@pytest.mark.parametrize("mode", MODES)
def test_emulate_dry_run_commands_match_the_test_environment(mode):
    args = ["--config", "debug_model", "--tide.comm", "tide", "--job.description", "a b"]
    result = _dry_run("--dry-run", "--nodes", "3", "--mode", mode, "--", *args,
                      env={"CUDA_VISIBLE_DEVICES": "5,6"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    commands = _node_commands(result.stdout)
    assert len(commands) == 3
    for node, cmd in enumerate(commands):
        assert cmd[:5] == ["env", "-u", "NCCL_HOSTID", "-u", "NCCL_MULTI_RANK_GPU_ENABLE"]
        run_train = cmd.index(str(REPO / "run_train.sh"))
        assert cmd[run_train + 1 :] == args  # the arguments pass unchanged (quoting kept)
        env = dict(kv.split("=", 1) for kv in cmd[5:run_train])
        expected = {
            **emulated_env(node, mode),
            "NNODES": "3", "NODE_RANK": str(node), "NGPU": "1", "CUDA_VISIBLE_DEVICES": "5",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29123",
        }  # fmt: skip
        assert env == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "cluster", "--", "--config", "x"], "choose nodes or one_node"),
        (["--nodes", "0", "--", "--config", "x"], "a positive integer"),
        (["--grace", "soon", "--", "--config", "x"], "whole seconds"),
        (["--nodes", "2"], "no run_train.sh arguments"),
    ],
)
def test_emulate_rejects_bad_arguments(args, message):
    result = _dry_run("--dry-run", *args)
    assert result.returncode == 2 and message in result.stderr, (result.stdout, result.stderr)


# ------------------------------------------------------------------ the NCCL swap


@pytest.fixture
def swap_setup(tmp_path):
    """A stand-in "bundled" library file and a "build" folder as .nccl/ holds it: the new
    file as two xz parts and a sha256.txt written as the project's is."""
    target = tmp_path / "site" / "libnccl.so.2"
    target.parent.mkdir()
    target.write_bytes(b"bundled NCCL 2.28.9\n")
    target.chmod(0o755)
    new = b"NCCL 2.30.7 build\n" * 1000
    packed = lzma.compress(new, format=lzma.FORMAT_XZ)
    src = tmp_path / "nccl"
    src.mkdir()
    half = len(packed) // 2
    (src / "libnccl.so.2.xz.part00").write_bytes(packed[:half])
    (src / "libnccl.so.2.xz.part01").write_bytes(packed[half:])
    (src / "sha256.txt").write_text(
        f"{hashlib.sha256(new).hexdigest()}  /tmp/libnccl.so.2\n"
        f"{hashlib.sha256(packed).hexdigest()}  /tmp/libnccl.so.2.xz\n"
    )
    return target, src, new


def _swap(target: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SWAP), *args], capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "NCCL_LIB": str(target)},
    )  # fmt: skip


needs_xz = pytest.mark.skipif(shutil.which("xz") is None, reason="needs the xz command")


@needs_xz
def test_nccl_swap_dry_run_changes_nothing(swap_setup, tmp_path):
    target, src, new = swap_setup
    ran = tmp_path / "ran"
    result = _swap(target, "--dry-run", str(src), "--", "touch", str(ran))
    assert result.returncode == 0, result.stderr
    assert hashlib.sha256(new).hexdigest() in result.stdout and str(target) in result.stdout
    assert "would run: touch" in result.stdout
    assert target.read_bytes() == b"bundled NCCL 2.28.9\n" and not ran.exists()


@needs_xz
@pytest.mark.parametrize("status", [0, 3])
def test_nccl_swap_runs_the_command_on_the_build_and_restores(swap_setup, tmp_path, status):
    target, src, new = swap_setup
    seen = tmp_path / "seen"
    script = f'cp "$NCCL_LIB" {shlex.quote(str(seen))}; exit {status}'
    result = _swap(target, str(src), "--", "bash", "-c", script)
    assert result.returncode == status, result.stderr
    assert seen.read_bytes() == new  # the command ran with the build in place
    assert target.read_bytes() == b"bundled NCCL 2.28.9\n"  # and it is back, mode kept
    assert target.stat().st_mode & 0o777 == 0o755
    assert "restored" in result.stdout
    assert not list(target.parent.glob("libnccl.so.2.*")), "temporary files left beside it"


@needs_xz
def test_nccl_swap_refuses_a_damaged_build_and_a_swapped_target(swap_setup, tmp_path):
    target, src, new = swap_setup
    ran = tmp_path / "ran"
    (src / "sha256.txt").write_text("0" * 64 + "  /tmp/libnccl.so.2\n")
    result = _swap(target, str(src), "--", "touch", str(ran))
    assert result.returncode == 2 and "sha256" in result.stderr, result.stderr
    assert target.read_bytes() == b"bundled NCCL 2.28.9\n" and not ran.exists()
    # A target that already is the build: restoring would not bring the bundled file back.
    (src / "sha256.txt").write_text(f"{hashlib.sha256(new).hexdigest()}  /tmp/libnccl.so.2\n")
    target.write_bytes(new)
    result = _swap(target, str(src), "--", "touch", str(ran))
    assert result.returncode == 2 and "already the build" in result.stderr, result.stderr
    assert not ran.exists()


# ------------------------------------------------------------------ NCCL's version and log


@pytest.fixture
def stand_in_nccl(tmp_path, monkeypatch):
    """``make(code)``: a libnccl.so.2 compiled here whose ncclGetVersion reports ``code``,
    made the library nccl_rma finds in this process (as torch's mapped one would be)."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    import torch

    from torchtitan_tide.comm.transports.windows import nccl_rma

    def make(code: int) -> str:
        source = tmp_path / f"nccl{code}.c"
        source.write_text(
            f"int ncclGetVersion(int *v) {{ *v = {code}; return 0; }}\n"
            'const char *ncclGetErrorString(int r) { return "stand-in"; }\n'
            'const char *ncclGetLastError(void *c) { return ""; }\n'
        )
        lib = tmp_path / str(code) / "libnccl.so.2"
        lib.parent.mkdir()
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
        monkeypatch.setattr(nccl_rma, "_lib", None)
        monkeypatch.setattr(nccl_rma, "library_path", lambda: str(lib))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return str(lib)

    return make


@pytest.mark.parametrize("code, refused", [(22809, True), (23007, False)])
def test_multi_rank_gpu_verdict_from_the_loaded_library(stand_in_nccl, code, refused):
    """The one-node tests' skip reason comes from the library's own ncclGetVersion."""
    from torchtitan_tide.comm.transports.windows import nccl_rma

    lib = stand_in_nccl(code)
    assert nccl_rma.nccl_version() == code
    reason = nccl_rma.multi_rank_gpu_missing_reason()
    assert (reason is not None) == refused, reason
    if refused:
        assert "NCCL 2.28.9" in reason and lib in reason and "nccl_swap.sh" in reason


def test_run_log_names_a_swapped_nccl(stand_in_nccl, monkeypatch):
    """The training log's NCCL version is the loaded library's own; where torch was built
    with another (a swapped library), both, and the file, are named."""
    import torch

    from torchtitan_tide import train_specs

    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    lib = stand_in_nccl(23007)
    assert train_specs.nccl_version_string() == (
        f"NCCL 2.30.7 loaded ({lib}; torch built with 2.28.9)"
    )


def test_nccl_log_readers(tmp_path):
    (tmp_path / "nccl.host.11.log").write_text(
        "host:11:11 [0] NCCL INFO NCCL version 2.30.7+cuda13.0\n"
        "host:11:20 [0] NCCL INFO comm 0x55 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0\n"
    )
    (tmp_path / "nccl.host.12.log").write_text(
        "host:12:21 [0] NCCL INFO comm 0x66 rank 1 nRanks 4 nNodes 4 localRanks 1 localRank 0 MNNVL 0\n"
    )
    assert nccl_comms(tmp_path) == [(2, 1, 2), (4, 4, 1)]
    assert nccl_versions(tmp_path) == {"2.30.7+cuda13.0"}


# ------------------------------------------------------------------ emulate.sh runs


@pytest.mark.slow
def test_emulate_runs_two_cpu_nodes(tmp_path):
    """emulate.sh end to end on CPU (gloo stands in for NCCL, whose variables are inert
    here): 2 launcher nodes of 1 rank, each line prefixed with its node, TIDE detects 2
    nodes x 1 and trains, every node exits 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(TIDE_DEVICE="cpu", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    log = tmp_path / "emulate.log"
    cmd = ["bash", str(EMULATE), "--nodes", "2", "--", "--config", "debug_model",
           "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "2",
           "--training.seq_len", "64", "--training.local_batch_size", "2", "--tide.comm", "tide"]  # fmt: skip
    rc = run_bounded(cmd, log, 400, env=env, cwd=REPO, start_new_session=True)
    out = log.read_text()
    assert rc == 0, out[-6000:]
    for node in (0, 1):
        assert f"[node {node}] [run_train] world       2 = 2 node(s) x 1" in out, out[-4000:]
        assert f"[emulate] node {node} exited with status 0" in out
    assert "transport=p2p (auto: 2 nodes x 1: no node-local peers" in out, out[-6000:]
    assert "[emulate] 2 node(s), mode nodes: statuses 0 0, exit 0" in out


@needs_xz
def test_nccl_swap_restores_when_stopped(swap_setup, tmp_path):
    """SIGTERM to the swap script while its command runs: the command ends and the
    bundled library is back at once (check.sh's `timeout` sends exactly that)."""
    target, src, _ = swap_setup
    log = tmp_path / "swap.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", str(SWAP), str(src), "--", "sleep", "60"], stdout=out,
            stderr=subprocess.STDOUT, env={**os.environ, "NCCL_LIB": str(target)},
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "bundled copy backed up" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert target.read_bytes() != b"bundled NCCL 2.28.9\n"  # swapped while it runs
        proc.terminate()
        assert proc.wait(15) == 143, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert target.read_bytes() == b"bundled NCCL 2.28.9\n", log.read_text()
    assert "restored" in log.read_text()
