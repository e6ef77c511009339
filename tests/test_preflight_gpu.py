"""``run_train.sh --preflight`` on ONE GPU, through scripts/gpu/emulate.sh (markers ``gpu``,
``emulation``, ``preflight``; check.sh's ``preflight`` stage runs them):

- 2 emulated nodes, each its own NCCL node (``NCCL_HOSTID``, sockets on loopback), the
  bundled NCCL: every check passes; the one-sided row says why the path cannot run here
  (NCCL < 2.29, or no host RMA between socket "nodes"), no failure under ``auto``;
- (``one_node``) 2 ranks that NCCL sees as ONE node sharing the GPU, NCCL >= 2.30 in
  torch's place (check.sh swaps it in): the one-sided stress check really runs
  (``ncclPutSignal`` on the copy engine), every pattern verified, TIDE's own one-sided
  transport in the paths rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import REPO

from torchtitan_tide.comm.transports.windows.nccl_rma import multi_rank_gpu_missing_reason
from torchtitan_tide.launch.command import MULTICAST_OFF

EMULATE = REPO / "scripts" / "gpu" / "emulate.sh"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, pytest.mark.emulation, pytest.mark.preflight, needs_cuda]


def _emulate(folder: Path, mode: str, *args: str) -> subprocess.CompletedProcess:
    drop = ("SLURM_", "MASTER_", "NCCL_HOSTID", "NCCL_MULTI_RANK_GPU_ENABLE", "TIDE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(MULTICAST_OFF, PYTHON=sys.executable, LOG_RANK="0")
    return subprocess.run(
        ["bash", str(EMULATE), "--nodes", "2", "--mode", mode, "--", "--config", "debug_model",
         "--preflight", "--tide.comm", "tide", "--job.dump_folder", str(folder), *args],
        capture_output=True, text=True, env=env, timeout=300, cwd=REPO, check=False,
    )  # fmt: skip


def _show(title: str, stdout: str) -> None:
    """Rank 0's table and failures, for check.sh's summary (pytest -rA prints it)."""
    lines = [line.split("[rank0]:", 1)[1] for line in stdout.splitlines() if "[rank0]:" in line]
    table = [line for line in lines if line.startswith(("| ", "FAIL "))]
    print(f"=== preflight {title} ===", *table, "=== end ===", sep="\n")


def _rows(folder: Path) -> dict[tuple[str, str], dict]:
    (path,) = (folder / "preflight").glob("preflight-*.json")
    return {(r["check"], r["what"]): r for r in json.loads(path.read_text())["rows"]}


def test_preflight_on_emulated_nodes(tmp_path):
    result = _emulate(tmp_path / "auto", "nodes")
    _show("2 emulated nodes (NCCL_HOSTID, sockets), bundled NCCL", result.stdout)
    assert result.returncode == 0, result.stdout[-8000:]
    assert "| preflight | result | ok | every check passed |" in result.stdout
    rows = _rows(tmp_path / "auto")
    assert "2 nodes x 1" in rows["ranks", "TIDE nodes"]["detail"]
    sided = rows["one_sided", "cross-node puts"]
    assert sided["status"] == "skip", sided
    assert ("needs NCCL >= 2.29" in sided["detail"]
            or "no host RMA" in sided["detail"]), sided  # fmt: skip
    assert rows["parity", "losses and sharded gradients"]["status"] == "ok"
    assert "bitwise" in rows["parity", "losses and sharded gradients"]["detail"]
    assert "GPU" in rows["rates", "cross-node TIDE-AG"]["detail"]


@pytest.mark.one_node
def test_preflight_one_sided_stress_on_the_copy_engine(tmp_path):
    if why := multi_rank_gpu_missing_reason():
        pytest.skip(why)
    result = _emulate(tmp_path / "run", "one_node")
    _show("2 ranks as ONE NCCL node on one GPU, the swapped NCCL", result.stdout)
    assert result.returncode == 0, result.stdout[-8000:]
    rows = _rows(tmp_path / "run")
    transport = rows["one_sided", "transport"]["detail"]
    assert transport.startswith("NCCL 2.") and "host RMA yes" in transport, transport
    assert "1 pair(s) x 96 rounds" in transport, transport
    for what in ("signal after data", "source read before reuse", "data intact"):
        assert rows["one_sided", what]["status"] == "ok", rows["one_sided", what]
    assert "one-sided NCCL communicator" in rows["paths", "one-sided (NCCL RMA)"]["detail"]
    assert rows["parity", "losses and sharded gradients"]["status"] == "ok"
