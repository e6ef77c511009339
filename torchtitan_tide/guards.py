"""Run guards around TorchTitan 0.2.2's Trainer: the TIDE watchdog and non-finite steps.

:func:`install` patches five named functions (reversibly, :func:`uninstall`):

- ``Trainer.train``: starts the TIDE watchdog (``comm.watchdog``) for the run, with
  ``[tide] watchdog_timeout_s`` or ``comm.train_timeout_seconds`` as the deadline
  (at least ``comm.init_timeout_seconds`` while the first step of this process runs,
  whatever its number: lazy init, compilation and the first TIDE rendezvous happen
  there, also in a resumed run, which TorchTitan leaves under its init timeout),
  heartbeats in the default group's store; stops it when training returns.
- ``Trainer.train_step``: tells the watchdog the step (and, from the second step of this
  process on, the train deadline); resets the step's losses.
- ``Trainer.forward_backward_step``: keeps each microbatch's (detached) loss.
- ``torchtitan.distributed.utils.clip_grad_norm_`` (called by ``train_step`` right
  before the optimizer step): checks the step's loss and gradient norm. The norm is
  already global; the loss is summed over all ranks (one scalar all-reduce), so
  every rank decides alike. Non-finite and ``[tide] nonfinite = "stop"``: raises
  :class:`NonFiniteTrainingError` (step, loss, norm) on every rank before the
  optimizer step and the checkpoint save. ``"skip"``: drops the gradients
  (``grad = None``: the optimizer leaves those parameters alone), logs it, and
  training goes on; the ``[tide] max_skipped_steps``-th non-finite step in a row is
  skipped too and then raises :class:`NonFiniteTrainingError` as ``"stop"`` does.
- ``CheckpointManager.save``: no checkpoint of a step that was skipped (logged when the
  step was due for one); the next due step saves as usual.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_tide import checkpoint
from torchtitan_tide.comm.base import watchdog

__all__ = ["NonFiniteTrainingError", "install", "uninstall"]

logger = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """A step's loss or gradient norm is NaN/inf under ``[tide] nonfinite = "stop"``."""


# The step being trained and its microbatch losses (one trainer per process).
_step_state: dict[str, Any] = {
    "step": 0, "losses": [], "policy": "stop", "max_skipped": 10,
    "skipped": 0,  # steps skipped by this process
    "consecutive_skipped": 0,  # ... since the last finite step
    "last_skipped": False,  # the step being trained (or just trained) was skipped
    "steps_run": 0,  # train_step calls of this process
}  # fmt: skip
_originals: dict[str, Any] = {}


def _start_watchdog(job_config: Any) -> watchdog.Watchdog:
    override = int(job_config.tide.watchdog_timeout_s)
    timeout = override or int(job_config.comm.train_timeout_seconds)
    first = override or max(timeout, int(job_config.comm.init_timeout_seconds))
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as e:  # noqa: BLE001 - no store: no heartbeats, deadlines still hold
        logger.warning("TIDE watchdog: no process group store (%s); no heartbeats", e)
        store = None
    wd = watchdog.Watchdog(
        first, rank=dist.get_rank(), world_size=dist.get_world_size(), store=store,
        dump_folder=job_config.job.dump_folder,
    )  # fmt: skip
    _step_state["timeout_s"] = float(timeout)  # from this process's second step on
    return watchdog.start(wd)


def _train(self, *args, **kwargs):
    tide = self.job_config.tide
    _step_state.update(policy=tide.nonfinite, max_skipped=tide.max_skipped_steps, skipped=0,
                       consecutive_skipped=0, last_skipped=False, steps_run=0)  # fmt: skip
    checkpoint.set_policy(self.job_config.tide.corrupt_checkpoint)
    _start_watchdog(self.job_config)
    # On failure the watchdog keeps running: ``explain_failure`` still reads heartbeats.
    result = _originals["train"](self, *args, **kwargs)
    watchdog.stop()
    return result


def _train_step(self, *args, **kwargs):
    first = _step_state["steps_run"] == 0  # keeps the init deadline, whatever self.step is
    _step_state.update(step=self.step, losses=[], last_skipped=False,
                       steps_run=_step_state["steps_run"] + 1)  # fmt: skip
    watchdog.set_step(self.step, None if first else _step_state.get("timeout_s"))
    return _originals["train_step"](self, *args, **kwargs)


def _checkpoint_save(self, curr_step: int, last_step: bool = False) -> None:
    if _step_state["last_skipped"] and curr_step == _step_state["step"]:
        if self._should_save(curr_step, last_step):
            logger.warning(
                "step %d was skipped (not finite, [tide] nonfinite = \"skip\"): no "
                "checkpoint of it is saved; the newest checkpoint stays the one before",
                curr_step,
            )
        return None
    return _originals["checkpoint_save"](self, curr_step, last_step)


def _forward_backward_step(self, *args, **kwargs):
    loss = _originals["forward_backward_step"](self, *args, **kwargs)
    _step_state["losses"].append(loss.detach())
    return loss


def _clip_grad_norm_(parameters, max_norm, *args, **kwargs):
    parameters = list(parameters)
    grad_norm = _originals["clip_grad_norm_"](parameters, max_norm, *args, **kwargs)
    check_step(grad_norm, parameters)
    return grad_norm


def check_step(grad_norm: torch.Tensor, parameters: list[torch.Tensor]) -> bool:
    """Whether this step is finite (module docstring); raises or drops the gradients
    when it is not. Collective over the default group (every rank calls it)."""
    losses = _step_state["losses"]
    device = grad_norm.device
    loss = torch.stack(losses).sum().float() if losses else torch.zeros((), device=device)
    loss = loss.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        loss = loss.clone()
        dist.all_reduce(loss)  # the global loss (sum of local loss sums / global tokens)
    norm_value, loss_value = torch.stack([grad_norm.detach().float(), loss]).tolist()
    if math.isfinite(norm_value) and math.isfinite(loss_value):
        _step_state["consecutive_skipped"] = 0
        return True
    step = _step_state["step"]
    what = f"step {step}: loss {loss_value} (summed over ranks), gradient norm {norm_value}"
    if _step_state["policy"] == "skip":
        _step_state["consecutive_skipped"] += 1
        in_a_row, bound = _step_state["consecutive_skipped"], _step_state["max_skipped"]
        if in_a_row >= bound:
            raise NonFiniteTrainingError(
                f"{what} is not finite: {in_a_row} steps in a row were skipped ([tide] "
                f"nonfinite = \"skip\", max_skipped_steps = {bound}): training stops; the "
                "skipped steps are not checkpointed. Resume from the last checkpoint with a "
                "lower learning rate, or raise [tide] max_skipped_steps."
            )
        for p in parameters:
            p.grad = None
        _step_state["skipped"] += 1
        _step_state["last_skipped"] = True
        logger.warning(
            "%s is not finite: step skipped ([tide] nonfinite = \"skip\"), no optimizer "
            "update, no checkpoint; %d step(s) skipped so far, %d in a row (the run stops "
            "at %d in a row: [tide] max_skipped_steps)",
            what, _step_state["skipped"], in_a_row, bound,
        )  # fmt: skip
        return False
    raise NonFiniteTrainingError(
        f"{what} is not finite: training stops ([tide] nonfinite = \"stop\"); this step is "
        "not checkpointed. Resume from the last checkpoint (e.g. with a lower learning "
        "rate), or set [tide] nonfinite = \"skip\" to skip such steps."
    )


def install() -> None:
    """Patch the Trainer and ``clip_grad_norm_`` (module docstring); idempotent."""
    if _originals:
        return
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.train import Trainer

    _originals.update(
        train=Trainer.train, train_step=Trainer.train_step,
        forward_backward_step=Trainer.forward_backward_step,
        clip_grad_norm_=dist_utils.clip_grad_norm_, checkpoint_save=CheckpointManager.save,
    )  # fmt: skip
    Trainer.train = _train
    Trainer.train_step = _train_step
    Trainer.forward_backward_step = _forward_backward_step
    dist_utils.clip_grad_norm_ = _clip_grad_norm_
    CheckpointManager.save = _checkpoint_save


def uninstall() -> None:
    """Undo :func:`install`."""
    if not _originals:
        return
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.train import Trainer

    CheckpointManager.save = _originals.pop("checkpoint_save")
    Trainer.train = _originals.pop("train")
    Trainer.train_step = _originals.pop("train_step")
    Trainer.forward_backward_step = _originals.pop("forward_backward_step")
    dist_utils.clip_grad_norm_ = _originals.pop("clip_grad_norm_")


def explain_failure(exc: BaseException) -> None:
    """Called by ``train.main`` when training raised: name a peer that stopped
    answering, if any (``watchdog.explain_exception``), then stop the watchdog."""
    try:
        watchdog.explain_exception(exc)
    finally:
        watchdog.stop()
