"""torchtitan_tide.torchrun: after a worker failed, a stopped worker is SIGKILLed after the
shutdown grace (5 s), not torch's hard-coded 30 s."""

import subprocess
import sys
import time

from train_helpers import REPO

WORKER = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGSTOP)  # stuck: SIGTERM stays pending, only SIGKILL ends it
time.sleep(1)
sys.exit(3)
"""


def test_stopped_worker_is_killed_after_the_grace(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    begin = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_tide.torchrun", "--nproc_per_node=2", "--rdzv_backend=c10d",
         "--rdzv_endpoint=localhost:0", str(script)],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    elapsed = time.monotonic() - begin
    assert result.returncode != 0, result.stderr[-3000:]
    assert "exitcode  : 3" in result.stderr and "(SIGKILL)" in result.stderr, result.stderr[-3000:]
    # rank 0 fails after 1 s; rank 1 gets SIGTERM, then SIGKILL 5 s later (not 30 s).
    assert "forcefully exiting via 9" in result.stderr
    assert elapsed < 20, (elapsed, result.stderr[-3000:])
