"""Checkpoint integrity for TorchTitan 0.2.2's CheckpointManager: manifests, partial and
corrupt step folders.

- After a synchronous save of ``step-N`` completes, a sha256 manifest of every file in
  the folder (``.metadata`` included) is written into it as :data:`MANIFEST`
  (atomically: written to a temporary name, then renamed). Hashing is split across
  ranks (rank r hashes files r, r + world, ...), rank 0 writes the manifest.
  Asynchronous saves get no manifest (logged once); they load unverified.
- ``load()`` of the latest step (``checkpoint.load_step = -1``) walks the step folders
  from the newest: a folder without ``.metadata`` (DCP writes it last) is partial and
  skipped, logged; a folder with a manifest is verified (sizes, then sha256, split
  across ranks, result shared with every rank). A bad file gives
  :class:`CheckpointCorruptError` naming it and the previous good step
  (``[tide] corrupt_checkpoint = "stop"``), or, with ``"previous"``, the bad folder is
  moved to ``<folder>/corrupt/step-N`` (nothing is deleted; TorchTitan's step search
  and purge do not look there) and the walk goes on. An explicit
  ``checkpoint.load_step`` is verified the same way and never replaced.
- A folder without a manifest but with ``.metadata`` (older runs, async saves, a run
  killed between the two) loads unverified, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from typing import Any

import torch.distributed as dist

__all__ = [
    "MANIFEST",
    "CheckpointCorruptError",
    "install",
    "select_step",
    "set_policy",
    "uninstall",
    "verify_step",
    "write_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST = ".tide_sha256.json"
CORRUPT_DIR = "corrupt"
_STEP = re.compile(r"^step-(\d+)$")
_originals: dict[str, Any] = {}
_async_logged: dict[str, bool] = {"done": False}


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's files do not match its manifest; the message names the file and
    the previous good step."""


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (one process: ``[obj]``)."""
    if _rank_world()[1] == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _files(step_dir: str) -> list[str]:
    """Files under ``step_dir`` (relative, sorted), the manifest excluded."""
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != MANIFEST and not rel.startswith(MANIFEST + "."):
                out.append(rel)
    return sorted(out)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(step_dir: str) -> None:
    """Hash every file of a completed save into ``step_dir/MANIFEST`` (collective when
    distributed: every rank calls it)."""
    rank, world = _rank_world()
    files = _files(step_dir)
    mine = {rel: [os.path.getsize(os.path.join(step_dir, rel)), _sha256(os.path.join(step_dir, rel))]
            for rel in files[rank::world]}  # fmt: skip
    entries: dict[str, list] = {}
    for part in _gather(mine):
        entries.update(part)
    if rank == 0:
        tmp = os.path.join(step_dir, MANIFEST + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"files": entries}, f, indent=0, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(step_dir, MANIFEST))
    if world > 1:
        dist.barrier()  # nobody loads before the manifest exists


def verify_step(step_dir: str) -> str | None:
    """Check ``step_dir`` against its manifest (collective when distributed); the first
    problem as ``"<file>: <what>"``, or None when every file matches. No manifest:
    None (nothing to check)."""
    path = os.path.join(step_dir, MANIFEST)
    rank, world = _rank_world()
    problem = None
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                entries = json.load(f)["files"]
        except (OSError, ValueError, KeyError) as e:
            entries, problem = {}, f"{MANIFEST}: unreadable ({type(e).__name__}: {e})"
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
    return os.path.isfile(os.path.join(step_dir, ".metadata")) or os.path.isfile(
        os.path.join(step_dir, "model.safetensors.index.json")
    )


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
        if not os.path.isfile(os.path.join(step_dir, MANIFEST)):
            logger.warning("checkpoint %s has no %s: loaded unverified", step_dir, MANIFEST)
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
    if policy != "previous" or good < 0:
        raise CheckpointCorruptError(
            f"checkpoint {os.path.join(folder, f'step-{step}')} is corrupt: {problem}. "
            f"The previous good checkpoint: {previous}. Nothing was deleted. To resume from "
            "it, set [tide] corrupt_checkpoint = \"previous\" (moves the corrupt folder to "
            f"{os.path.join(folder, CORRUPT_DIR)}/) or --checkpoint.load_step {good}."
            if good >= 0 else
            f"checkpoint {os.path.join(folder, f'step-{step}')} is corrupt: {problem}. "
            "No good checkpoint is left; nothing was deleted."
        )  # fmt: skip
    rank, world = _rank_world()
    if rank == 0:
        target = os.path.join(folder, CORRUPT_DIR)
        os.makedirs(target, exist_ok=True)
        for bad, _ in corrupt:
            src, dst = os.path.join(folder, f"step-{bad}"), os.path.join(target, f"step-{bad}")
            n = 1
            while os.path.exists(dst):
                dst, n = os.path.join(target, f"step-{bad}.{n}"), n + 1
            shutil.move(src, dst)
            logger.warning("checkpoint step-%d moved to %s (corrupt)", bad, dst)
    if world > 1:
        dist.barrier()
    logger.warning(
        "[tide] corrupt_checkpoint = \"previous\": resuming from step %d instead of %s",
        good, ", ".join(f"step {s}" for s, _ in corrupt),
    )  # fmt: skip
    return good


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
            problem = verify_step(self._create_checkpoint_id(step))
            if problem is not None:
                raise CheckpointCorruptError(
                    f"--checkpoint.load_step {step}: checkpoint is corrupt: {problem}"
                )
    return _originals["load"](self, step)


def _dcp_save(self, state_dict, checkpoint_id, async_mode, *args, **kwargs):
    ret = _originals["dcp_save"](self, state_dict, checkpoint_id, async_mode, *args, **kwargs)
    if str(getattr(async_mode, "value", async_mode)) == "disabled":
        write_manifest(checkpoint_id)
    elif not _async_logged["done"]:
        _async_logged["done"] = True
        logger.warning("asynchronous checkpoint: no sha256 manifest (loaded unverified)")
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
