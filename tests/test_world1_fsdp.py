"""``TIDE_FSDP_AT_WORLD_SIZE_1``: FSDP2 in a one-process run (torchtitan_tide.world1_fsdp)."""

import pytest
from torchtitan.distributed.parallel_dims import ParallelDims

from tests.train_helpers import losses, read_metrics, run_train
from torchtitan_tide import world1_fsdp


def _dims(world_size: int) -> ParallelDims:
    return ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world_size
    )


def test_requested_reads_the_variable_and_names_it_on_a_bad_value():
    assert not world1_fsdp.requested({})
    assert not world1_fsdp.requested({world1_fsdp.ENV: "0"})
    assert world1_fsdp.requested({world1_fsdp.ENV: "1"})
    with pytest.raises(ValueError, match=world1_fsdp.ENV):
        world1_fsdp.requested({world1_fsdp.ENV: "yes"})


def test_install_turns_fsdp_on_at_world_1_only_and_is_reversible():
    assert not _dims(1).fsdp_enabled
    try:
        world1_fsdp.install(1)
        world1_fsdp.install(1)  # idempotent
        assert _dims(1).fsdp_enabled
        assert _dims(1)._mesh_exist("fsdp", 1)
        assert not _dims(1)._mesh_exist("tp", 1)
        assert _dims(2).fsdp_enabled and not _dims(2)._mesh_exist("fsdp", 1)
    finally:
        world1_fsdp.uninstall()
    assert not _dims(1).fsdp_enabled and not world1_fsdp.installed()
    assert not _dims(1)._mesh_exist("fsdp", 1)


def test_install_refuses_a_multi_process_run():
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        world1_fsdp.install(2)
    assert not world1_fsdp.installed()


def test_one_process_run_applies_fsdp2_and_learns(tmp_path):
    """The path really runs: FSDP2 applied (TorchTitan's own log line), mixed precision by
    fully_shard instead of autocast, and the loss falls; without the variable the same run
    applies no FSDP."""
    out = run_train(
        tmp_path / "fsdp", "--training.steps", "4", nproc=1, **{world1_fsdp.ENV: "1"}
    ).stdout
    assert "Applied FSDP to the model" in out
    assert "Mixed precision training is handled by fully_shard" in out
    assert f"{world1_fsdp.ENV}=1: FSDP2 over a one-rank mesh" in out
    loss = losses(read_metrics(tmp_path / "fsdp"))
    assert loss[4] < loss[1]
    plain = run_train(tmp_path / "plain", "--training.steps", "1", nproc=1).stdout
    assert "Applied FSDP to the model" not in plain


def test_bench_step_runs_each_mode_under_fsdp_at_world_size_1(tmp_path):
    """bench_step --fsdp-at-world-size-1: the result has its own name, its note says what
    ran, and every run's log showed FSDP2 applied (else the row would carry an error)."""
    import json
    import subprocess
    import sys

    from tests.train_helpers import REPO, cpu_env

    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench/bench_step.py"), "--config", "debug_model",
         "--steps", "3", "--warmup", "1", "--rounds", "1", "--modes", "fsdp2",
         "--profile", "off", "--out-dir", str(tmp_path), "--log-dir", str(tmp_path),
         "--fsdp-at-world-size-1"],
        capture_output=True, text=True, timeout=420, cwd=REPO, env=cpu_env(1),
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = tmp_path.glob("*_step_world1_fsdp_debug_model.json")
    rows = json.loads(result.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["fsdp2"] and rows[0]["error"] is None
    assert "Applied FSDP to the model" in (tmp_path / "step_debug_model_fsdp2_r1.log").read_text()
    assert (
        f"{world1_fsdp.ENV}=1: FSDP2 over a one-rank mesh" in result.with_suffix(".md").read_text()
    )


@pytest.mark.gpu
def test_profiled_fsdp_step_at_world_size_1_on_one_gpu(tmp_path):
    """On one GPU: FSDP2's layout kernels (copy-in, copy-out, chunk_cat) run in the
    profiled step, which the one-GPU trainer without FSDP never launches; the breakdown
    and the top kernels are recorded."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    import torch

    from tests.train_helpers import REPO

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench/bench_step.py"), "--config", "debug_model",
         "--steps", "4", "--warmup", "1", "--rounds", "1", "--modes", "fsdp2", "--out-dir",
         str(tmp_path), "--log-dir", str(tmp_path), "--fsdp-at-world-size-1"],
        capture_output=True, text=True, timeout=420, cwd=REPO, check=False,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": first_gpu},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = tmp_path.glob("*_step_world1_fsdp_debug_model.json")
    data = json.loads(result.read_text())
    (run,) = data["runs"]["fsdp2"]
    assert run["layout"]["total_ms"] > 0, run["layout"]
    if shutil.which("nvidia-smi") and run["clock"]:  # a debug-model run may never look busy
        assert run["clock"]["sm_mhz_median"] == data["rows"][0]["sm_mhz_median"] > 0
    assert run["layout"]["per_rank"]["rank0"]["kernels"]
    assert run["breakdown"]["compute_ms"] > 0, run["breakdown"]


def test_a_two_process_run_with_the_variable_is_refused_by_name(tmp_path):
    with pytest.raises(AssertionError) as failed:
        run_train(tmp_path, "--training.steps", "1", nproc=2, **{world1_fsdp.ENV: "1"})
    assert f"{world1_fsdp.ENV}=1 is for one-process runs" in str(failed.value)
    assert "WORLD_SIZE=2" in str(failed.value)
