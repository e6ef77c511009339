"""End-to-end CPU training through ./run_train.sh: 2 gloo processes, comm fsdp2 and tide."""

import math
import shutil

import pytest
from train_helpers import losses, read_metrics, train

pytestmark = pytest.mark.slow


def test_debug_model_trains_and_loss_falls(tmp_path):
    records = train(tmp_path / "run", "--training.steps", "24", "--tide.comm", "fsdp2")
    curve = losses(records)
    assert sorted(curve) == list(range(1, 25))
    assert all(math.isfinite(v) for v in curve.values())
    first, last = [curve[s] for s in range(1, 5)], [curve[s] for s in range(21, 25)]
    assert sum(last) / 4 < sum(first) / 4 - 1.0, curve
    assert (tmp_path / "run" / "tb").is_dir(), "TensorBoard logs missing"


def test_checkpoint_resume_gives_the_same_losses(tmp_path):
    folder = tmp_path / "run"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.no-last-save-model-only"]
    train(folder, "--training.steps", "8", *ckpt)
    straight = losses(read_metrics(folder))
    assert (folder / "checkpoint" / "step-4").is_dir()

    # Resume from step 4 in a fresh folder holding only that checkpoint.
    resumed_folder = tmp_path / "resumed"
    shutil.copytree(folder / "checkpoint" / "step-4", resumed_folder / "checkpoint" / "step-4")
    resumed = losses(train(resumed_folder, "--training.steps", "8", *ckpt))
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert resumed[step] == straight[step], (step, resumed, straight)


def test_tide_matches_fsdp2_bitwise(tmp_path):
    """Same seed, same data: TIDE-AG (gloo point-to-point, 2 ranks as 2 nodes and as one
    node of 2) gives the losses of stock FSDP2 exactly."""
    steps = ["--training.steps", "5"]
    stock = losses(train(tmp_path / "fsdp2", *steps, "--tide.comm", "fsdp2"))
    as_two_nodes = losses(train(tmp_path / "tide_2x1", *steps, "--tide.comm", "tide",
                                "--tide.local_world_size", "1"))
    as_one_node = losses(train(tmp_path / "tide_1x2", *steps, "--tide.comm", "tide"))
    assert stock == as_two_nodes == as_one_node, (stock, as_two_nodes, as_one_node)


def test_checkpoint_crosses_comm_modes(tmp_path):
    """A DCP checkpoint written under fsdp2 resumes under tide (TIDE-AG + TIDE-RS) and one
    written under tide resumes under fsdp2, each continuing like a run that stays in the
    writing mode (within 1e-5; 2 ranks are bitwise in practice)."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.no-last-save-model-only"]
    steps = ["--training.steps", "8"]
    for written, resumed_as in (("fsdp2", "tide"), ("tide", "fsdp2")):
        folder = tmp_path / f"{written}_straight"
        straight = losses(train(folder, *steps, *ckpt, "--tide.comm", written))
        resumed_folder = tmp_path / f"{written}_to_{resumed_as}"
        shutil.copytree(folder / "checkpoint" / "step-4", resumed_folder / "checkpoint" / "step-4")
        resumed = losses(train(resumed_folder, *steps, *ckpt, "--tide.comm", resumed_as))
        assert sorted(resumed) == [5, 6, 7, 8]
        for step in (5, 6, 7, 8):
            assert math.isclose(resumed[step], straight[step], rel_tol=1e-5), (
                written, resumed_as, step, resumed, straight)
