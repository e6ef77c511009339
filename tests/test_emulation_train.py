"""Training runs of 2 emulated nodes through scripts/gpu/emulate.sh
(docs/design/2026-12-02-emulation.md).

On ONE GPU (markers ``gpu`` and ``emulation``): 2 launcher nodes x 1 rank, each its own
NCCL node (``NCCL_HOSTID``, sockets on loopback), the debug Llama with bf16 parameters:

- ``--debug.deterministic``, 8 steps, ``comm = "tide"`` (TIDE's cross-node path: it logs
  ``transport=p2p (auto: 2 nodes x 1``) has the losses of ``comm = "fsdp2"``, bitwise (read
  from each run's metrics.jsonl);
- a node that stops (SIGSTOP, by the test hook tests/hooks/tide_stop_rank.py, as it enters
  TIDE's all-gather of step 3, so that its peer waits on it inside TIDE's cross-node
  exchange) ends the job instead of hanging it: the survivor's TIDE watchdog reports the
  stopped rank by name and exits with 124 within its deadline; emulate.sh then stops the
  stopped node, as a scheduler ends a job step whose task failed. The test ends every
  process it started.

The same stopped-node run on CPU (gloo stands in for NCCL; marker ``slow``) checks the hook
and emulate.sh's handling of a failed node where no GPU is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import REPO, alive, end_tree, kill_exact, losses, read_metrics, start_time

from torchtitan_tide.launch.command import MULTICAST_OFF

EMULATE = REPO / "scripts" / "gpu" / "emulate.sh"
HOOKS = REPO / "tests" / "hooks"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16 = ["--config", "debug_model", "--training.mixed_precision_param", "bfloat16",
        "--metrics.log_freq", "1"]  # fmt: skip
CPU_RUN = ["--config", "debug_model", "--training.seq_len", "64",
           "--training.local_batch_size", "2", "--metrics.log_freq", "1"]  # fmt: skip
WATCHDOG_S = 15  # [tide] watchdog_timeout_s: also step 1's deadline (Triton and NCCL set-up)
STOP_STEP = 3


def _env(device: str, **extra: str) -> dict[str, str]:
    """The caller's environment without scheduler, rendezvous or emulation variables."""
    drop = ("SLURM_", "MASTER_", "NCCL_HOSTID", "NCCL_MULTI_RANK_GPU_ENABLE", "TIDE_TEST_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(MULTICAST_OFF, PYTHON=sys.executable, LOG_RANK="0")
    if device == "cpu":
        env.update(TIDE_DEVICE="cpu", OMP_NUM_THREADS="1")
    else:
        env.pop("TIDE_DEVICE", None)
    env.update(extra)
    return env


def _start(
    log: Path, args: list[str], env: dict[str, str], grace_s: int = 10, nodes: int = 2,
    mode: str = "nodes",
) -> subprocess.Popen:  # fmt: skip
    """emulate.sh with ``nodes`` launcher nodes in a session of its own, output into ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(
            ["bash", str(EMULATE), "--nodes", str(nodes), "--mode", mode, "--grace",
             str(grace_s), "--", *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.emulation
@needs_cuda
def test_emulated_training_has_fsdp2_losses(tmp_path):
    """2 emulated nodes, bf16 parameters, deterministic: tide's losses == fsdp2's, 8 steps."""
    stock, tide, logs = _train_both(tmp_path, ["--training.steps", "8", "--debug.deterministic"])
    assert sorted(stock) == list(range(1, 9)), stock
    assert tide == stock, (tide, stock)
    out = logs["tide"].read_text()
    assert "transport=p2p (auto: 2 nodes x 1: no node-local peers" in out, out[-6000:]
    first_reduce = r"TIDE-RS .*: first reduce, .* 2 nodes x 1, accumulate: triton"
    assert re.search(first_reduce, out), out[-6000:]
    assert "transport=p2p" not in logs["fsdp2"].read_text()


def _train_both(
    tmp_path: Path, args: list[str], nodes: int = 2, mode: str = "nodes", timeout_s: int = 240
) -> tuple[dict[int, float], dict[int, float], dict[str, Path]]:
    """fsdp2 and tide trained at once (they share the GPU) on ``nodes`` launcher nodes:
    ``(fsdp2's losses, tide's losses, each run's log)``; a failed or late run fails."""
    procs, logs = {}, {}
    try:
        for comm in ("fsdp2", "tide"):
            logs[comm] = tmp_path / f"{comm}.log"
            run = [*BF16, *args, "--job.dump_folder", str(tmp_path / comm), "--tide.comm", comm]
            procs[comm] = _start(logs[comm], run, _env("cuda"), nodes=nodes, mode=mode)
        deadline = time.monotonic() + timeout_s
        for comm, proc in procs.items():
            try:
                rc = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{comm} run still going after {timeout_s} s:\n"
                                     + logs[comm].read_text()[-6000:]) from None  # fmt: skip
            assert rc == 0, f"{comm} run failed ({rc}):\n" + logs[comm].read_text()[-6000:]
    finally:
        for proc in procs.values():
            end_tree(proc)
    return losses(read_metrics(tmp_path / "fsdp2")), losses(read_metrics(tmp_path / "tide")), logs


def _stopped_node_run(
    tmp_path: Path, device: str, run: list[str], nodes: int = 2, mode: str = "nodes",
    stop_rank: int = 1,
) -> None:  # fmt: skip
    """Rank ``stop_rank`` stops in TIDE's all-gather of step STOP_STEP; see the module
    docstring. Two nodes: rank 0 reports it (its only peer). More: every survivor waits on
    it, directly (its window waits) or through the GPU they share (the host's run-ahead
    bound on the compute stream); whichever deadline passes first, the report must name
    the stopped rank among those waited for and as the one that stopped answering."""
    marker, log = tmp_path / "stopped_pid", tmp_path / "emulate.log"
    env = _env(
        device,
        PYTHONPATH=os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH")) if p),
        TIDE_TEST_STOP_RANK=str(stop_rank), TIDE_TEST_STOP_STEP=str(STOP_STEP),
        TIDE_TEST_STOP_MARKER=str(marker),
    )  # fmt: skip
    args = [*run, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "100",
            "--tide.comm", "tide", "--tide.watchdog_timeout_s", str(WATCHDOG_S),
            "--comm.train_timeout_seconds", "300",  # NCCL's / gloo's own timeout: far later
            "--experimental.custom_import", "tide_stop_rank"]  # fmt: skip
    proc = _start(log, args, env, grace_s=5, nodes=nodes, mode=mode)
    stopped_pid, stopped_start = None, None
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None, "the run ended before the stop:\n" + log.read_text()[-6000:]
            assert time.monotonic() < deadline, "no stop within 300 s:\n" + log.read_text()[-6000:]
            time.sleep(0.2)
        stopped_at = time.monotonic()
        stopped_pid = int(marker.read_text())
        stopped_start = start_time(stopped_pid)
        try:
            rc = proc.wait(WATCHDOG_S + 90)
        except subprocess.TimeoutExpired:
            raise AssertionError("the job hangs:\n" + log.read_text()[-6000:]) from None
        ended_s = time.monotonic() - stopped_at
        # emulate.sh stopped the stopped node before it exited
        survived = start_time(stopped_pid) == stopped_start and alive(stopped_pid)
    finally:
        end_tree(proc)
        if stopped_pid is not None:
            kill_exact([(stopped_pid, stopped_start)])
    out = log.read_text()
    print(f"{device}: job ended {ended_s:.1f} s after rank {stop_rank} stopped (rc {rc})")
    assert rc != 0, out[-6000:]
    waited = re.compile(
        rf"TIDE watchdog: rank (\d+) waited {WATCHDOG_S} s at step {STOP_STEP} for rank\(s\) "
        rf"([\d, ]+) in (TIDE-[^(]+)"
    )
    reports = [(int(r), {int(x) for x in peers.split(",")}, op.strip())
               for r, peers, op in waited.findall(out)]  # fmt: skip
    assert reports and all(stop_rank in peers for _, peers, _ in reports), out[-8000:]
    print("reports: " + "; ".join(sorted({f"rank {r} in {op}" for r, _, op in reports})))
    if nodes == 2:
        assert any(r == 0 for r, _, _ in reports), out[-8000:]
    assert f"stopped answering: rank {stop_rank} (no heartbeat for" in out, out[-8000:]
    assert "[node 0] run_train.sh: cause: TIDE watchdog: rank " in out, out[-8000:]
    assert re.search(r"\[node \d+\]\s+exitcode\s*:\s*124", out), out[-8000:]
    # The deadline, a poll, the bounded abort (<= 10 s), torchrun's exit, emulate.sh's
    # grace (5 s) and the stop of the other node (<= 10 s + torchrun's 5 s).
    assert ended_s < WATCHDOG_S + 45, (ended_s, out[-6000:])
    assert not survived, "the stopped rank outlived the job"


@pytest.mark.gpu
@pytest.mark.emulation
@needs_cuda
def test_emulated_stopped_node_ends_the_job_with_a_report(tmp_path):
    _stopped_node_run(tmp_path, "cuda", BF16)


@pytest.mark.slow
def test_stopped_node_ends_the_job_with_a_report_cpu(tmp_path):
    _stopped_node_run(tmp_path, "cpu", CPU_RUN)


# N x L on ONE GPU as ONE NCCL node (NCCL >= 2.30 in torch's place: check.sh's nxl stage):
# 4 launcher nodes of one rank that TIDE groups as 2 nodes x 2 (docs/design/2026-12-04-windows.md),
# TIDE-AG in place (torch 2.11 needs the ctypes storage swap named: [tide] ag_storage_swap).
NXL = ["--tide.local_world_size", "2", "--tide.ag_storage_swap", "ctypes"]


def _multi_rank_gpu(test):
    from torchtitan_tide.comm.transports.windows.nccl_rma import multi_rank_gpu_missing_reason

    reason = multi_rank_gpu_missing_reason() if torch.cuda.is_available() else "needs CUDA"
    mark = pytest.mark.skipif(reason is not None, reason=str(reason))
    marks = (pytest.mark.gpu, pytest.mark.emulation, pytest.mark.one_node, pytest.mark.nxl)
    for m in marks:
        test = m(test)
    return needs_cuda(mark(test))


@_multi_rank_gpu
def test_nxl_training_follows_fsdp2_losses(tmp_path):
    """2 nodes x 2 on NCCL windows, bf16 parameters, deterministic, 20 steps: the losses
    follow fsdp2's (TIDE-RS adds in its own order: not bitwise; the bound is a relative
    1e-2, and the report prints the largest difference)."""
    stock, tide, logs = _train_both(
        tmp_path, ["--training.steps", "20", "--debug.deterministic", *NXL], nodes=4,
        mode="one_node", timeout_s=300,
    )  # fmt: skip
    assert sorted(stock) == list(range(1, 21)) and sorted(tide) == sorted(stock), (tide, stock)
    worst = max(abs(tide[s] - stock[s]) / abs(stock[s]) for s in stock)
    print(f"2 x 2 windows vs fsdp2, 20 steps: largest relative loss difference {worst:.2e}; "
          f"step 20 {stock[20]:.5f} vs {tide[20]:.5f}")
    assert worst < 1e-2, (worst, tide, stock)
    out = logs["tide"].read_text()
    assert "transport=windows (auto: 2 nodes x 2: NCCL windows" in out, out[-6000:]
    assert re.search(r"TIDE-RS .*: first reduce, .* 2 nodes x 2", out), out[-6000:]
    assert "TIDE-AG in place: arena" in out, out[-6000:]


@_multi_rank_gpu
def test_nxl_stopped_rank_inside_a_cross_node_wait_ends_the_job(tmp_path):
    """2 nodes x 2: rank 2 (node 1, local 0: rank 0's rail peer) stops as it enters an
    all-gather; the survivors' waits on it (their cross-node and node-local window waits,
    and the run-ahead bound of their compute streams on the shared GPU) pass their deadline
    and the watchdog ends the job naming rank 2, no hang (measured 2026-12-04: 40 s after the
    stop with a 15 s deadline)."""
    _stopped_node_run(tmp_path, "cuda", [*BF16, *NXL], nodes=4, mode="one_node", stop_rank=2)
