"""Run ./run_train.sh as a user would and read back its metrics.jsonl."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Small enough for 2 CPU cores, big enough to learn: 2 ranks x 2 x 64 tokens a step.
SMALL_RUN = ["--training.seq_len", "64", "--training.local_batch_size", "2",
             "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1"]


def cpu_env(nproc: int = 2, **extra: str) -> dict[str, str]:
    """The environment of a CPU run of ``nproc`` ranks per node: the caller's, without its
    SLURM_ and MASTER_ variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(TIDE_DEVICE="cpu", NGPU=str(nproc), PYTHON=sys.executable, LOG_RANK="0",
               OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def run_train(dump_folder: Path, *overrides: str, config: str = "debug_model", nproc: int = 2,
              timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """Train on CPU/gloo (``env``: extra variables); the finished process, its output
    captured (stdout is a pipe, as under sbatch). Raises AssertionError when it failed."""
    result = subprocess.run(
        [str(REPO / "run_train.sh"), "--config", config, "--job.dump_folder", str(dump_folder),
         *SMALL_RUN, *overrides],
        capture_output=True, text=True, env=cpu_env(nproc, **env), timeout=timeout, cwd=REPO,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}")
    return result


def train(dump_folder: Path, *overrides: str, config: str = "debug_model", nproc: int = 2,
          timeout: int = 600) -> list[dict]:
    """Train on CPU/gloo; return the metrics records of this dump folder (all runs)."""
    run_train(dump_folder, *overrides, config=config, nproc=nproc, timeout=timeout)
    return read_metrics(dump_folder)


def read_metrics(dump_folder: Path) -> list[dict]:
    """The step records of the folder's last run (resumes resolved: torchtitan_tide.metrics)."""
    from torchtitan_tide.metrics import read_metrics as read_last_run

    return read_last_run(dump_folder)


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss_metrics/global_avg_loss"] for r in records}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; torchrun's workers run in sessions of their
    own, so a process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22), or None when
    it is gone: with the pid it names one process, even after the pid is reused."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def kill_exact(processes: list[tuple[int, int | None]]) -> None:
    """SIGKILL each ``(pid, start_time)`` that is still that very process."""
    for pid, started in processes:
        if started is not None and start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def end_tree(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """End ``proc`` and every process below it, if ``proc`` still runs: SIGTERM to
    ``proc`` (a script's trap can stop what it started), then after ``grace_s`` SIGKILL to
    all that is left (each checked by its start time: pids are reused). A ``proc`` that
    already exited waited for its children itself; nothing is touched then."""
    if proc.poll() is not None:
        return
    below = [(pid, start_time(pid)) for pid in descendants(proc.pid)]
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        below += [(pid, start_time(pid)) for pid in descendants(proc.pid)]
        proc.kill()
    kill_exact(below)
    proc.wait(10)


def run_bounded(cmd: list[str], log: Path, timeout_s: float, **popen_kwargs) -> int:
    """Run ``cmd`` with stdout and stderr into ``log``; past ``timeout_s`` end it and all
    it started (:func:`end_tree`) and raise ``AssertionError``. Returns the exit status."""
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **popen_kwargs)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{cmd[:3]} still running after {time.monotonic() - started:.0f} s:\n"
                + log.read_text()[-6000:]
            ) from None
        finally:
            end_tree(proc)
