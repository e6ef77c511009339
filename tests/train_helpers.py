"""Run ./run_train.sh as a user would and read back its metrics.jsonl."""

import os
import socket
import subprocess
import sys
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
