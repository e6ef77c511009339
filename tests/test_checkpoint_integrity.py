"""Checkpoint manifests: every damage the issue tried is found, named, and either stops
the run or falls back to the previous good step; nothing is deleted. Each rank hashes the
files it wrote; re-saves (sync or async, real DCP) into an existing folder never leave a
stale manifest; a corrupt folder is moved aside before a save writes over it."""

import json
import logging
import multiprocessing
import os
import shutil
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchtitan_tide import checkpoint
from torchtitan_tide.checkpoint import CheckpointCorruptError, manifest_part, select_step


def _save(folder, step: int, manifest: bool = True) -> str:
    """A step folder shaped like a DCP save: shards, then .metadata, then the manifest."""
    step_dir = folder / f"step-{step}"
    step_dir.mkdir(parents=True)
    for rank in (0, 1):
        (step_dir / f"__{rank}_0.distcp").write_bytes(os.urandom(3 * 4096 + step))
    (step_dir / ".metadata").write_bytes(os.urandom(700))
    if manifest:
        for rank in (0, 1):
            checkpoint.write_manifest(str(step_dir), rank, world=2)
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


def _part(step_dir, rank: int) -> dict:
    return json.loads(open(manifest_part(str(step_dir), rank)).read())


def test_each_rank_lists_the_files_it_wrote(folder):
    part0, part1 = _part(folder / "step-8", 0), _part(folder / "step-8", 1)
    assert sorted(part0["files"]) == [".metadata", "__0_0.distcp"] and part0["world"] == 2
    assert sorted(part1["files"]) == ["__1_0.distcp"] and part1["rank"] == 1
    assert part0["files"]["__0_0.distcp"][0] == 3 * 4096 + 8
    assert select_step(str(folder), "stop") == 8


def test_rank_hashes_its_own_shard_at_any_world_size(tmp_path):
    """Sorted as strings, __10_0 comes before __2_0: ``sorted(files)[rank::world]`` gave
    rank 2 the file of rank 10. Each rank must hash its own ``__<rank>_*`` files."""
    for rank in range(12):
        (tmp_path / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 10)
    (tmp_path / ".metadata").write_bytes(b"m")
    for rank in range(12):
        assert checkpoint.write_manifest(str(tmp_path), rank, world=12) == (10 + (rank == 0))
        expected = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
        assert sorted(_part(tmp_path, rank)["files"]) == sorted(expected)


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
    assert sorted(os.listdir(moved)) == sorted([".metadata", "__0_0.distcp", "__1_0.distcp",
                                                ".tide_sha256.0.json", ".tide_sha256.1.json"])
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
    assert "no .tide_sha256.*.json: loaded unverified" in caplog.text


def test_missing_part_leaves_the_other_ranks_files_verified(folder, caplog):
    os.remove(manifest_part(str(folder / "step-8"), 1))
    with caplog.at_level(logging.WARNING, logger="torchtitan_tide.checkpoint"):
        assert select_step(str(folder), "stop") == 8
    assert "no manifest part from rank(s) 1" in caplog.text
    _overwrite(str(folder / "step-8" / "__0_0.distcp"), bytes(64))
    with pytest.raises(CheckpointCorruptError, match="__0_0.distcp: sha256 differs"):
        select_step(str(folder), "stop")


def test_legacy_single_manifest_is_still_verified(tmp_path):
    step_dir = _save(tmp_path / "checkpoint", 3, manifest=False)
    files = {name: [os.path.getsize(os.path.join(step_dir, name)),
                    checkpoint._sha256(os.path.join(step_dir, name))]
             for name in os.listdir(step_dir)}  # fmt: skip
    with open(os.path.join(step_dir, ".tide_sha256.json"), "w") as f:
        json.dump({"files": files}, f)
    assert select_step(str(tmp_path / "checkpoint"), "stop") == 3
    _overwrite(os.path.join(step_dir, "__1_0.distcp"), bytes(64))
    with pytest.raises(CheckpointCorruptError, match="__1_0.distcp: sha256 differs"):
        select_step(str(tmp_path / "checkpoint"), "stop")


# ------------------------------------------------------- real DCP through the patched manager
@pytest.fixture
def manager(monkeypatch):
    """TorchTitan's ``CheckpointManager.dcp_save`` with TIDE's patch, on a bare manager
    (``pg`` None: DCP's default group, or one process)."""
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

    checkpoint.install()
    hashed_on: list[str] = []
    real = checkpoint.write_manifest

    def recording(*args, **kwargs):
        hashed_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_manifest", recording)

    def save(step_dir, value: float, mode: str = "disabled"):
        state = {"w": torch.full((256,), value), "step": torch.tensor(int(value))}
        out = CheckpointManager.dcp_save(SimpleNamespace(pg=None, sd_adapter=None),
                                         state, str(step_dir), AsyncMode(mode))  # fmt: skip
        return out.result() if mode == "async" else out

    yield SimpleNamespace(save=save, hashed_on=hashed_on)
    checkpoint.uninstall()


def _loaded(step_dir) -> float:
    state = {"w": torch.zeros(256), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(step_dir))
    return float(state["w"][0])


def test_async_resave_into_an_existing_folder_gets_its_own_manifest(tmp_path, manager):
    """The issue's sequence: steps 4 and 8 saved; a rerun loaded step 4 and re-saved step 8
    asynchronously (then step 12); the next resume from step 8 must verify it, not call it
    corrupt (before: the async save left step 8's first manifest in place)."""
    root = tmp_path / "checkpoint"
    manager.save(root / "step-4", 4.0)
    manager.save(root / "step-8", 8.0)
    assert manager.hashed_on == ["MainThread"] * 2  # synchronous: right after the save
    manager.save(root / "step-8", 8.5, mode="async")
    manager.save(root / "step-12", 12.0, mode="async")
    assert len(manager.hashed_on) == 4 and "MainThread" not in manager.hashed_on[2:]
    assert checkpoint.verify_step(str(root / "step-8")) is None
    assert select_step(str(root), "stop") == 12
    assert _loaded(root / "step-8") == 8.5 and _loaded(root / "step-12") == 12.0
    shutil.rmtree(root / "step-12")
    assert select_step(str(root), "stop") == 8


def test_kill_during_sync_resave_is_partial_not_corrupt(tmp_path, manager, monkeypatch, caplog):
    """A re-save into step-8 ends after the shards, before .metadata (a kill): the folder
    is partial and skipped (before: old .metadata and manifest next to new shards read
    as corrupt)."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.api import CheckpointException

    root = tmp_path / "checkpoint"
    manager.save(root / "step-4", 4.0)
    manager.save(root / "step-8", 8.0)

    def killed(self, *args, **kwargs):
        raise RuntimeError("killed before .metadata")

    monkeypatch.setattr(filesystem._FileSystemWriter, "finish", killed)
    with pytest.raises(CheckpointException, match="killed before .metadata"):
        manager.save(root / "step-8", 9.0)
    with caplog.at_level(logging.WARNING, logger="torchtitan_tide.checkpoint"):
        assert select_step(str(root), "stop") == 4
    assert "step-8 is partial (no .metadata" in caplog.text


def test_save_over_a_corrupt_folder_moves_it_aside_first(tmp_path, manager, caplog):
    """Following the advice (--checkpoint.load_step 4) later saves step 8 again: the
    corrupt step-8 is moved to corrupt/step-8 first (logged with the path), not
    overwritten in place."""
    root = tmp_path / "checkpoint"
    manager.save(root / "step-4", 4.0)
    manager.save(root / "step-8", 8.0)
    shard = root / "step-8" / "__0_0.distcp"
    _overwrite(str(shard), bytes(64), at=0)
    damaged = shard.read_bytes()
    with pytest.raises(CheckpointCorruptError) as err:
        select_step(str(root), "stop")
    moved = root / "corrupt" / "step-8"
    assert f"a later save into it first moves it to {moved}" in str(err.value)
    assert (root / "step-8").is_dir() and not moved.exists()  # "stop" moves nothing
    with caplog.at_level(logging.WARNING, logger="torchtitan_tide.checkpoint"):
        manager.save(root / "step-8", 8.5)
    assert f"moved to {moved} before this save writes a new step-8" in caplog.text
    assert (moved / "__0_0.distcp").read_bytes() == damaged
    assert select_step(str(root), "stop") == 8 and _loaded(root / "step-8") == 8.5


def _dcp_rank(rank: int, init_file: str, root: str) -> None:
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    checkpoint.install()
    manager = SimpleNamespace(pg=None, sd_adapter=None)
    for step, mode in ((4, "disabled"), (8, "async")):
        state = {"w": torch.full((512,), float(rank + step))}
        out = CheckpointManager.dcp_save(manager, state, f"{root}/step-{step}", AsyncMode(mode))
        if mode == "async":
            out.result()
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_each_hash_their_own_dcp_files(tmp_path):
    """Real DCP on 2 gloo ranks, a sync and an async save: rank r's part lists exactly
    ``__r_0.distcp`` (rank 0: and .metadata); the folders verify in one process."""
    ctx = multiprocessing.get_context("fork")
    root = tmp_path / "checkpoint"
    procs = [ctx.Process(target=_dcp_rank, args=(r, str(tmp_path / "init"), str(root)))
             for r in (0, 1)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    for step in (4, 8):
        part0, part1 = _part(root / f"step-{step}", 0), _part(root / f"step-{step}", 1)
        assert sorted(part0["files"]) == [".metadata", "__0_0.distcp"], part0
        assert sorted(part1["files"]) == ["__1_0.distcp"] and part1["world"] == 2, part1
        assert checkpoint.verify_step(str(root / f"step-{step}")) is None
    assert select_step(str(root), "stop") == 8


def test_async_manifest_waits_for_the_save_and_skips_a_failed_one(tmp_path):
    from concurrent.futures import Future

    step_dir = _save(tmp_path / "checkpoint", 4, manifest=False)
    save = Future()
    chained = checkpoint._manifest_when_done(save, step_dir, 0, 1)
    assert not chained.done() and not os.path.exists(manifest_part(step_dir, 0))
    save.set_result("metadata")
    assert chained.result(5) == "metadata" and os.path.isfile(manifest_part(step_dir, 0))
    failed = Future()
    chained = checkpoint._manifest_when_done(failed, str(tmp_path / "step-9"), 0, 1)
    failed.set_exception(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        chained.result(5)
    assert not (tmp_path / "step-9").exists()


def test_async_manifest_future_completes_when_the_save_is_cancelled(tmp_path):
    """TorchTitan waits on the returned future without a timeout: a cancelled save
    (executor shut down) must cancel it, not leave it pending forever."""
    from concurrent.futures import CancelledError, Future

    save = Future()
    chained = checkpoint._manifest_when_done(save, str(tmp_path / "step-3"), 0, 1)
    assert save.cancel()
    assert chained.cancelled()
    with pytest.raises(CancelledError):
        chained.result(5)
    assert not (tmp_path / "step-3").exists()


def test_hf_export_files_are_spread_over_the_ranks(tmp_path):
    """A last-step HF export (consolidated safetensors that every rank writes a share
    of) must not all land on rank 0, which would hash about the whole model alone."""
    (tmp_path / "sharded").mkdir()
    for i in range(4):
        (tmp_path / f"model-{i + 1:05d}-of-00004.safetensors").write_bytes(b"w" * 10)
        (tmp_path / "sharded" / f"shard-{i + 1:05d}-model.safetensors").write_bytes(b"s" * 10)
    (tmp_path / "model.safetensors.index.json").write_bytes(b"{}")
    owned = {rank: checkpoint._own_files(str(tmp_path), rank, world=4) for rank in range(4)}
    assert all(len([f for f in files if f.endswith(".safetensors")]) == 2
               for files in owned.values()), owned  # fmt: skip
    assert "model.safetensors.index.json" in owned[0]
    every = sorted(f for files in owned.values() for f in files)
    assert len(every) == len(set(every)) == 9  # each file hashed once
