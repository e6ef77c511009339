"""A dead (kill -9) or stuck (SIGSTOP) rank of 2 gloo ranks, mid-training, through
./run_train.sh: every rank exits non-zero within the timeout + 30 s with a message
naming the rank, and a rerun resumes from the last checkpoint with the losses of an
uninterrupted run, step for step."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import REPO, SMALL_RUN, alive, descendants, losses, read_metrics, train

pytestmark = pytest.mark.slow

TIMEOUT_S = 10  # --comm.train_timeout_seconds (and so the TIDE watchdog's deadline)
STEPS, INTERVAL, KILL_AFTER = 6, 3, 4  # checkpoint at 3 (and 6); fault after step 4
CKPT = ["--checkpoint.enable", "--checkpoint.interval", str(INTERVAL),
        "--checkpoint.no-last-save-model-only", "--training.steps", str(STEPS),
        "--comm.train_timeout_seconds", str(TIMEOUT_S)]  # fmt: skip
# torch's torchrun waits 30 s between SIGTERM and SIGKILL of the workers left after a
# failure, and a SIGSTOPped rank only goes at the SIGKILL; torchtitan_tide.torchrun waits
# 5 s (docs/design/2026-12-01-failures.md). Which one ran shows in the launcher's command line.
TORCHRUN_GRACE_S = {"torchtitan_tide.torchrun": 5, "torch.distributed.run": 30}
# TIDE's watchdog below the process-group timeout, so that a TIDE wait on the stopped rank
# is reported by the watchdog (naming TIDE's operation) well before gloo's own timeout.
WATCHDOG_S = 6
MODES = {
    "fsdp2": ["--tide.comm", "fsdp2"],
    "tide": ["--tide.comm", "tide", "--tide.watchdog_timeout_s", str(WATCHDOG_S)],
    "tide_2x1": ["--tide.comm", "tide", "--tide.local_world_size", "1",
                 "--tide.watchdog_timeout_s", str(WATCHDOG_S)],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """One uninterrupted run (fsdp2; TIDE matches it bitwise, test_train_cpu)."""
    return losses(train(tmp_path_factory.mktemp("reference") / "run", *CKPT))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(TIDE_DEVICE="cpu", NGPU="2", PYTHON=sys.executable, LOG_RANK="all",
               OMP_NUM_THREADS="1")  # fmt: skip

    return env


def _worker(root: int, rank: int) -> int | None:
    for pid in descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b"".join(env):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"torchtitan_tide.train" in cmdline:
                return pid
    return None


def _last_step(folder: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(folder) if "step" in r), default=0)
    except (OSError, ValueError):
        return 0


def _run_until_fault(folder: Path, mode: list[str], sig: int) -> tuple[int, float, str]:
    """Start a run, send ``sig`` to rank 1 after step KILL_AFTER; returns the exit status,
    the seconds from the signal to the exit of every process, and the output."""
    log = folder.parent / f"{folder.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(REPO / "run_train.sh"), "--config", "debug_model", "--job.dump_folder",
             str(folder), *SMALL_RUN, *CKPT, *mode],
            stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 400
            while _last_step(folder) < KILL_AFTER:
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, "run did not reach the fault step"
                time.sleep(0.2)
            victim = _worker(proc.pid, 1)
            assert victim is not None, "rank 1 not found"
            os.kill(victim, sig)
            sent = time.monotonic()
            rc = proc.wait(timeout=TIMEOUT_S + 90)
            exited = time.monotonic() - sent
            while any(alive(p) for p in (victim,)) and time.monotonic() - sent < TIMEOUT_S + 90:
                time.sleep(0.2)  # torchrun reaps the workers before it exits; be sure
            exited = max(exited, time.monotonic() - sent) if alive(victim) else exited
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return rc, exited, log.read_text()


CASES = [
    ("fsdp2", signal.SIGKILL, True),
    ("fsdp2", signal.SIGSTOP, False),
    ("tide", signal.SIGKILL, False),
    ("tide", signal.SIGSTOP, True),
    ("tide_2x1", signal.SIGKILL, False),
    ("tide_2x1", signal.SIGSTOP, True),
]


@pytest.mark.parametrize(
    "mode, sig, resume", CASES, ids=[f"{m}-{signal.Signals(s).name}" for m, s, _ in CASES]
)
def test_faulty_rank_ends_the_job_and_rerun_resumes(tmp_path, reference, mode, sig, resume):
    folder = tmp_path / "run"
    rc, exited, output = _run_until_fault(folder, MODES[mode], sig)
    print(f"{mode} {signal.Signals(sig).name}: rc {rc}, every rank gone {exited:.1f} s "
          "after the signal")  # fmt: skip
    assert rc != 0, output[-4000:]
    torchrun = next(m for m in TORCHRUN_GRACE_S if f"-m {m} " in output)
    limit = TIMEOUT_S + 30 + (TORCHRUN_GRACE_S[torchrun] - 5 if sig == signal.SIGSTOP else 0)
    print(f"  torchrun: {torchrun}, limit {limit} s")
    assert exited < limit, (exited, output[-4000:])
    if sig == signal.SIGKILL:
        assert "Signal 9 (SIGKILL) received by PID" in output or "exitcode  : -9" in output, (
            output[-4000:])
    else:
        # The survivor's report names the stopped rank (watchdog cause or heartbeat check).
        assert "stopped answering: rank 1 (no heartbeat for" in output, output[-6000:]
        if mode != "fsdp2":
            # Where rank 0 waits on the stopped rank decides who reports: in a TIDE wait the
            # watchdog (its deadline, WATCHDOG_S, comes first); in a stock collective beside
            # TIDE's (the guard's loss all-reduce, the grad-norm clip) gloo's timeout, which
            # explain_exception turns into the same named cause. Either is TIDE's report.
            by_watchdog = "TIDE watchdog: rank 0 waited" in output and "for rank(s) 1 in TIDE-" in output
            by_gloo = "TIDE watchdog: rank 0 failed at step" in output
            assert by_watchdog or by_gloo, output[-6000:]
    if not resume:
        return
    records = train(folder, *CKPT, *MODES[mode])
    # Resumed, not restarted: steps up to the checkpoint were logged by the first run only.
    assert [r.get("step") for r in records].count(1) == 1, records
    rerun = losses(records)
    assert (folder / "checkpoint" / f"step-{INTERVAL}" / ".tide_sha256.0.json").is_file()
    assert sorted(rerun) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # later records (the rerun's) win in losses()
        assert rerun[step] == reference[step], (step, rerun, reference)
