"""Checkpoint manifests (one process): every damage the issue tried is found, named, and
either stops the run or falls back to the previous good step; nothing is deleted."""

import json
import logging
import os

import pytest

from torchtitan_tide import checkpoint
from torchtitan_tide.checkpoint import MANIFEST, CheckpointCorruptError, select_step


def _save(folder, step: int, manifest: bool = True) -> str:
    """A step folder shaped like a DCP save: shards, then .metadata, then the manifest."""
    step_dir = folder / f"step-{step}"
    step_dir.mkdir(parents=True)
    for rank in (0, 1):
        (step_dir / f"__{rank}_0.distcp").write_bytes(os.urandom(3 * 4096 + step))
    (step_dir / ".metadata").write_bytes(os.urandom(700))
    if manifest:
        checkpoint.write_manifest(str(step_dir))
    return str(step_dir)


def _overwrite(path: str, data: bytes, at: int = 4096) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "checkpoint"
    _save(root, 4)
    _save(root, 8)
    return root


def test_manifest_lists_every_file(folder):
    entries = json.loads((folder / "step-8" / MANIFEST).read_text())["files"]
    assert sorted(entries) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert entries["__0_0.distcp"][0] == 3 * 4096 + 8
    assert select_step(str(folder), "stop") == 8


@pytest.mark.parametrize(
    "damage, what",
    [
        (lambda p: _overwrite(p, os.urandom(4096)), "sha256 differs"),
        (lambda p: _overwrite(p, bytes(4096)), "sha256 differs"),
        (lambda p: os.truncate(p, 5000), "5000 bytes, the save wrote 12296"),
    ],
    ids=["4KiB_random", "4KiB_zeros", "truncated"],
)
def test_damaged_shard_stops_naming_file_and_previous_step(folder, damage, what):
    shard = str(folder / "step-8" / "__1_0.distcp")
    damage(shard)
    with pytest.raises(CheckpointCorruptError) as err:
        select_step(str(folder), "stop")
    message = str(err.value)
    assert shard in message and what in message, message
    assert "previous good checkpoint: step 4" in message and "load_step 4" in message
    assert (folder / "step-8").is_dir(), "stop must not move or delete anything"


def test_damaged_shard_falls_back_when_asked(folder):
    _overwrite(str(folder / "step-8" / "__0_0.distcp"), bytes(4096))
    assert select_step(str(folder), "previous") == 4
    assert not (folder / "step-8").exists()
    moved = folder / "corrupt" / "step-8"
    assert sorted(os.listdir(moved)) == sorted([".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST])
    assert select_step(str(folder), "stop") == 4  # the moved folder is not found again


def test_partial_folder_is_skipped_and_logged(folder, caplog):
    os.remove(folder / "step-8" / ".metadata")
    with caplog.at_level(logging.WARNING, logger="torchtitan_tide.checkpoint"):
        assert select_step(str(folder), "stop") == 4
    assert "step-8 is partial (no .metadata" in caplog.text
    assert (folder / "step-8").is_dir()


def test_every_checkpoint_corrupt_stops_even_with_fallback(folder):
    for step in (4, 8):
        _overwrite(str(folder / f"step-{step}" / "__0_0.distcp"), bytes(16), at=0)
    with pytest.raises(CheckpointCorruptError, match="No good checkpoint is left"):
        select_step(str(folder), "previous")
    assert (folder / "step-4").is_dir() and (folder / "step-8").is_dir()


def test_folder_without_manifest_loads_unverified(tmp_path, caplog):
    root = tmp_path / "checkpoint"
    _save(root, 3, manifest=False)
    with caplog.at_level(logging.WARNING, logger="torchtitan_tide.checkpoint"):
        assert select_step(str(root), "stop") == 3
    assert "no .tide_sha256.json: loaded unverified" in caplog.text
