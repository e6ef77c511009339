"""Checkpoint integrity for TorchTitan 0.2.2's CheckpointManager: manifests, partial and
corrupt step folders.

- Before any save into ``step-N`` (sync or async), rank 0 clears what marks the folder
  complete and verified: its manifest parts and DCP's ``.metadata`` (written last by the
  save, so a save killed half way leaves a *partial* folder, never old metadata next to
  new shards). A folder marked corrupt by an earlier load (:data:`CORRUPT_MARK`) is moved
  to ``<folder>/corrupt/step-N`` first, logged with its new path.
- Manifests: each rank hashes the files it wrote (DCP's ``__<rank>_*`` files; rank 0 also
  ``.metadata`` and any other file) and writes them with its rank and the save's world
  size as its part ``step-N/.tide_sha256.<rank>.json`` (atomically: a temporary name,
  then a rename). No collective: a slow hasher holds nobody but itself. Synchronous save:
  right after the save, on the training thread (the bytes were just written, read back
  from the page cache). Asynchronous save: when the save's future completes, on the
  save's own thread; TorchTitan's next wait on that future (the next save, the last
  step's save) also waits for the manifest.
- ``load()`` of the latest step (``checkpoint.load_step = -1``) walks the step folders
  from the newest: a folder without ``.metadata`` is partial and skipped, logged; a
  folder with a manifest is verified (sizes, then sha256, split across the loading ranks,
  the first problem shared with every rank; this runs before step 1, under TorchTitan's
  init timeout). A bad file gives :class:`CheckpointCorruptError` naming it and the
  previous good step (``[tide] corrupt_checkpoint = "stop"``; the folder is marked
  corrupt, nothing is moved or deleted), or, with ``"previous"``, the bad folder is moved
  to ``<folder>/corrupt/step-N`` (TorchTitan's step search and purge do not look there)
  and the walk goes on. An explicit ``checkpoint.load_step`` is verified the same way and
  never replaced.
- A folder with ``.metadata`` but no manifest (older runs, a process ended between the
  save and its hash) loads unverified, with a warning; ranks whose part is missing are
  named, the other parts are still checked.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

__all__ = [
    "CORRUPT_MARK",
    "MANIFEST",
    "CheckpointCorruptError",
    "install",
    "manifest_part",
    "prepare_save",
    "select_step",
    "set_policy",
    "uninstall",
    "verify_step",
    "write_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST = ".tide_sha256"  # parts: <step dir>/.tide_sha256.<rank>.json
CORRUPT_MARK = ".tide_corrupt.txt"  # written into a folder found corrupt at load
CORRUPT_DIR = "corrupt"
COMPLETE_MARKS = (".metadata", "model.safetensors.index.json")  # written last by a save
_LEGACY_MANIFEST = MANIFEST + ".json"  # one manifest of all files (before 2026-12-01)
_STEP = re.compile(r"^step-(\d+)$")
_DCP_RANK_FILE = re.compile(r"^__(\d+)_")  # DCP's FileSystemWriter: __<plan index>_<n>.distcp
_originals: dict[str, Any] = {}
_async_logged: dict[str, bool] = {"done": False}


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's files do not match its manifest; the message names the file and
    the previous good step."""


def _rank_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (one process: ``[obj]``)."""
    if _rank_world()[1] == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def manifest_part(step_dir: str, rank: int) -> str:
    """Path of rank ``rank``'s manifest part in ``step_dir``."""
    return os.path.join(step_dir, f"{MANIFEST}.{rank}.json")


def _own_files(step_dir: str, rank: int, world: int = 1) -> list[str]:
    """Files under ``step_dir`` (relative, sorted) that ``rank`` of ``world`` hashes;
    TIDE's own ``.tide_*`` files excluded. ``__<r>_*`` files (DCP) are rank r's, as are
    ``.metadata`` and ``*.index.json`` rank 0's; the others (a last-step HF export's
    safetensors, which every rank writes a share of) are spread over the ranks by their
    sorted position, so no rank hashes the whole model alone."""
    dcp, other = [], []
    for root, _, names in os.walk(step_dir):
        for name in names:
            if name.startswith(".tide_"):
                continue
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            m = _DCP_RANK_FILE.match(name)
            if m:
                if int(m.group(1)) == rank:
                    dcp.append(rel)
            elif name == ".metadata" or name.endswith(".index.json"):
                if rank == 0:
                    dcp.append(rel)
            else:
                other.append(rel)
    spread = [rel for i, rel in enumerate(sorted(other)) if i % max(world, 1) == rank]
    return sorted(dcp + spread)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(step_dir: str, rank: int = 0, world: int = 1) -> int:
    """Hash the files ``rank`` wrote into ``step_dir`` (a completed save of ``world``
    ranks) into its part :func:`manifest_part`; local, no collective. Returns the bytes
    hashed."""
    entries = {}
    for rel in _own_files(step_dir, rank, world):
        full = os.path.join(step_dir, rel)
        entries[rel] = [os.path.getsize(full), _sha256(full)]
    path = manifest_part(step_dir, rank)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "world": world, "files": entries}, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return sum(size for size, _ in entries.values())


def _manifest_paths(step_dir: str) -> list[str]:
    parts = glob.glob(os.path.join(glob.escape(step_dir), f"{MANIFEST}.*.json"))
    legacy = os.path.join(step_dir, _LEGACY_MANIFEST)
    return sorted(parts) + ([legacy] if os.path.isfile(legacy) else [])


def _read_manifest(step_dir: str) -> tuple[dict[str, list], list[int], str | None]:
    """``(entries, ranks whose part is missing, problem)`` of ``step_dir``'s manifest."""
    entries: dict[str, list] = {}
    present, world = set(), 0
    for path in _manifest_paths(step_dir):
        try:
            with open(path, encoding="utf-8") as f:
                part = json.load(f)
            entries.update(part["files"])
            present.add(int(part.get("rank", 0)))
            world = max(world, int(part.get("world", 1)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return {}, [], f"{path}: unreadable ({type(e).__name__}: {e})"
    return entries, sorted(set(range(world)) - present), None


def _has_manifest(step_dir: str) -> bool:
    return bool(_manifest_paths(step_dir))


def verify_step(step_dir: str) -> str | None:
    """Check ``step_dir`` against its manifest (collective when distributed); the first
    problem as ``"<file>: <what>"``, or None when every listed file matches. No manifest:
    None (nothing to check)."""
    rank, world = _rank_world()
    entries, missing, problem = _read_manifest(step_dir)
    if missing and rank == 0:
        logger.warning(
            "checkpoint %s: no manifest part from rank(s) %s (that process ended between "
            "the save and its hash): their files load unverified",
            step_dir, ", ".join(map(str, missing)),
        )  # fmt: skip
    for rel in sorted(entries)[rank::world]:
        if problem is not None:
            break
        size, sha = entries[rel]
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            problem = f"{full}: missing"
        elif os.path.getsize(full) != size:
            problem = f"{full}: {os.path.getsize(full)} bytes, the save wrote {size} (truncated or appended)"
        elif _sha256(full) != sha:
            problem = f"{full}: sha256 differs from the manifest written after the save"
    found = [p for p in _gather(problem) if p is not None]
    return found[0] if found else None


def _is_complete(step_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(step_dir, mark)) for mark in COMPLETE_MARKS)


def _steps(folder: str) -> list[int]:
    if not os.path.isdir(folder):
        return []
    return sorted(
        (int(m.group(1)) for name in os.listdir(folder) if (m := _STEP.match(name))),
        reverse=True,
    )


def select_step(folder: str, policy: str) -> int:
    """The newest complete, verified step under ``folder`` (-1: none); see the module
    docstring for partial and corrupt folders and ``policy`` (``"stop"`` |
    ``"previous"``). Collective when distributed."""
    corrupt: list[tuple[int, str]] = []  # (step, problem), newest first
    for step in _steps(folder):
        step_dir = os.path.join(folder, f"step-{step}")
        if not _is_complete(step_dir):
            logger.warning(
                "checkpoint %s is partial (no .metadata: its save did not finish); skipped",
                step_dir,
            )
            continue
        if not _has_manifest(step_dir):
            logger.warning("checkpoint %s has no %s.*.json: loaded unverified", step_dir, MANIFEST)
            return _after_corrupt(folder, corrupt, step, policy)
        problem = verify_step(step_dir)
        if problem is None:
            logger.info("checkpoint %s: every file matches its sha256 manifest", step_dir)
            return _after_corrupt(folder, corrupt, step, policy)
        logger.error("checkpoint %s is corrupt: %s", step_dir, problem)
        corrupt.append((step, problem))
    return _after_corrupt(folder, corrupt, -1, policy)


def _after_corrupt(folder: str, corrupt: list[tuple[int, str]], good: int, policy: str) -> int:
    """``good`` after the newer ``corrupt`` steps were handled by ``policy``."""
    if not corrupt:
        return good
    step, problem = corrupt[0]
    previous = f"step {good}" if good >= 0 else "none (no good checkpoint is left)"
    rank, world = _rank_world()
    if policy != "previous" or good < 0:
        for bad, what in corrupt:
            _mark_corrupt(os.path.join(folder, f"step-{bad}"), what)
        kept = (
            "Nothing was deleted; the folder is marked corrupt, and a later save into it "
            f"first moves it to {os.path.join(folder, CORRUPT_DIR, f'step-{step}')}."
        )
        raise CheckpointCorruptError(
            f"checkpoint {os.path.join(folder, f'step-{step}')} is corrupt: {problem}. "
            f"The previous good checkpoint: {previous}. {kept} To resume from it, set "
            f"[tide] corrupt_checkpoint = \"previous\" (moves the corrupt folder to "
            f"{os.path.join(folder, CORRUPT_DIR)}/ now) or --checkpoint.load_step {good}."
            if good >= 0 else
            f"checkpoint {os.path.join(folder, f'step-{step}')} is corrupt: {problem}. "
            f"No good checkpoint is left. {kept}"
        )  # fmt: skip
    if rank == 0:
        for bad, _ in corrupt:
            dst = _move_aside(os.path.join(folder, f"step-{bad}"))
            logger.warning("checkpoint step-%d moved to %s (corrupt)", bad, dst)
    if world > 1:
        dist.barrier()
    logger.warning(
        "[tide] corrupt_checkpoint = \"previous\": resuming from step %d instead of %s",
        good, ", ".join(f"step {s}" for s, _ in corrupt),
    )  # fmt: skip
    return good


def _mark_corrupt(step_dir: str, problem: str) -> None:
    """Rank 0 writes :data:`CORRUPT_MARK` (the problem) into ``step_dir``."""
    if _rank_world()[0] != 0:
        return
    try:
        with open(os.path.join(step_dir, CORRUPT_MARK), "w", encoding="utf-8") as f:
            f.write(problem + "\n")
    except OSError as e:
        logger.warning("cannot mark %s corrupt: %s", step_dir, e)


def _move_aside(step_dir: str) -> str:
    """Move ``step_dir`` to ``<its folder>/corrupt/<its name>[.n]``; returns the new path."""
    target = os.path.join(os.path.dirname(step_dir), CORRUPT_DIR)
    os.makedirs(target, exist_ok=True)
    name = os.path.basename(step_dir)
    dst, n = os.path.join(target, name), 1
    while os.path.exists(dst):
        dst, n = os.path.join(target, f"{name}.{n}"), n + 1
    shutil.move(step_dir, dst)
    return dst


def prepare_save(step_dir: str) -> None:
    """Before a save into ``step_dir`` (rank 0 acts; every rank may call it): a folder
    marked corrupt is moved aside (logged with its new path); otherwise its manifest
    parts and completion marks (``.metadata``) are removed, so that until the new save
    and its hash finish the folder reads as partial or unverified, never as corrupt."""
    if _rank_world()[0] != 0 or not os.path.isdir(step_dir):
        return
    if os.path.isfile(os.path.join(step_dir, CORRUPT_MARK)):
        dst = _move_aside(step_dir)
        logger.warning(
            "checkpoint %s was found corrupt at load; moved to %s before this save writes "
            "a new %s", step_dir, dst, os.path.basename(step_dir),
        )  # fmt: skip
        return
    for path in _manifest_paths(step_dir) + [os.path.join(step_dir, m) for m in COMPLETE_MARKS]:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------- CheckpointManager patches
_policy_state: dict[str, str] = {"policy": "stop"}


def _policy() -> str:
    return _policy_state["policy"]


def _load(self, step: int = -1) -> bool:
    if self.enable and os.path.isdir(self.folder):
        if step == -1:
            step = select_step(self.folder, _policy())
            if step == -1:
                return _originals["load"](self, -1)  # nothing complete: TorchTitan decides
        else:
            step_dir = self._create_checkpoint_id(step)
            problem = verify_step(step_dir)
            if problem is not None:
                _mark_corrupt(step_dir, problem)
                raise CheckpointCorruptError(
                    f"--checkpoint.load_step {step}: checkpoint is corrupt: {problem}"
                )
    return _originals["load"](self, step)


def _hash_and_log(step_dir: str, rank: int, world: int, how: str) -> None:
    """:func:`write_manifest` for a completed save, logged; a failed hash is logged, never
    raised into training (the checkpoint itself is complete: it loads unverified)."""
    begin = time.monotonic()
    try:
        nbytes = write_manifest(step_dir, rank, world)
    except Exception as e:  # noqa: BLE001
        logger.warning("checkpoint %s: no manifest part from rank %d (%s: %s); it loads "
                       "unverified", step_dir, rank, type(e).__name__, e)  # fmt: skip
        return
    logger.info(
        "checkpoint %s: sha256 manifest of rank %d's files (%.2f GB) written in %.2f s (%s)",
        step_dir, rank, nbytes / 1e9, time.monotonic() - begin, how,
    )  # fmt: skip


def _manifest_when_done(future: Future, step_dir: str, rank: int, world: int) -> Future:
    """A future that completes like ``future``, after this rank's manifest part of the
    finished save is written (on the thread that completes ``future``). A failed save
    gets no manifest."""
    chained: Future = Future()

    def finish(done: Future) -> None:
        # ``chained`` always completes: TorchTitan waits on it without a timeout.
        if done.cancelled():  # exception() would raise CancelledError in this callback
            chained.cancel()
            return
        error = done.exception()
        if error is not None:
            chained.set_exception(error)
            return
        try:
            _hash_and_log(step_dir, rank, world, "asynchronous save, off the training thread")
        finally:
            chained.set_result(done.result())

    future.add_done_callback(finish)
    return chained


def _dcp_save(self, state_dict, checkpoint_id, async_mode, *args, **kwargs):
    is_async = str(getattr(async_mode, "value", async_mode)) != "disabled"
    # DCP names a rank's files by its index in the group it saves with (TorchTitan: the
    # default group when synchronous, its checkpoint group ``self.pg`` when asynchronous).
    rank, world = _rank_world(getattr(self, "pg", None) if is_async else None)
    prepare_save(checkpoint_id)
    ret = _originals["dcp_save"](self, state_dict, checkpoint_id, async_mode, *args, **kwargs)
    if not is_async:
        _hash_and_log(checkpoint_id, rank, world, "synchronous save")
        return ret
    if not _async_logged["done"]:
        _async_logged["done"] = True
        logger.info("asynchronous checkpoint: each rank writes its sha256 manifest part when the save completes")
    if isinstance(ret, Future):
        return _manifest_when_done(ret, checkpoint_id, rank, world)
    if dataclasses.is_dataclass(ret) and hasattr(ret, "upload_completion"):  # AsyncSaveResponse
        upload = _manifest_when_done(ret.upload_completion, checkpoint_id, rank, world)
        return dataclasses.replace(ret, upload_completion=upload)
    logger.warning("asynchronous checkpoint %s: no future returned (%s); no manifest",
                   checkpoint_id, type(ret).__name__)  # fmt: skip
    return ret


def set_policy(policy: str) -> None:
    """``[tide] corrupt_checkpoint`` of this run (``config.CORRUPT_CHECKPOINT``)."""
    _policy_state["policy"] = policy


def install() -> None:
    """Patch ``CheckpointManager.load`` and ``dcp_save``; idempotent."""
    if _originals:
        return
    from torchtitan.components.checkpoint import CheckpointManager

    _originals.update(load=CheckpointManager.load, dcp_save=CheckpointManager.dcp_save)
    CheckpointManager.load = _load
    CheckpointManager.dcp_save = _dcp_save


def uninstall() -> None:
    if not _originals:
        return
    from torchtitan.components.checkpoint import CheckpointManager

    CheckpointManager.load = _originals.pop("load")
    CheckpointManager.dcp_save = _originals.pop("dcp_save")
    _originals.clear()
