"""Run guards around TorchTitan 0.2.2's Trainer: the TIDE watchdog and non-finite steps.

:func:`install` patches four named functions (reversibly, :func:`uninstall`):

- ``Trainer.train``: starts the TIDE watchdog (``comm.watchdog``) for the run, with
  ``[tide] watchdog_timeout_s`` or ``comm.train_timeout_seconds`` as the deadline
  (``comm.init_timeout_seconds`` while step 1 runs, as TorchTitan lowers the process
  group timeouts only after step 1), heartbeats in the default group's store; stops
  it when training returns.
- ``Trainer.train_step``: tells the watchdog the step; resets the step's losses.
- ``Trainer.forward_backward_step``: keeps each microbatch's (detached) loss.
- ``torchtitan.distributed.utils.clip_grad_norm_`` (called by ``train_step`` right
  before the optimizer step): checks the step's loss and gradient norm. The norm is
  already global; the loss is summed over all ranks (one scalar all-reduce), so
  every rank decides alike. Non-finite and ``[tide] nonfinite = "stop"``: raises
  :class:`NonFiniteTrainingError` (step, loss, norm) on every rank before the
  optimizer step and the checkpoint save. ``"skip"``: drops the gradients
  (``grad = None``: the optimizer leaves those parameters alone), logs it, and
  training goes on.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_tide import checkpoint
from torchtitan_tide.comm import watchdog

__all__ = ["NonFiniteTrainingError", "install", "uninstall"]

logger = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """A step's loss or gradient norm is NaN/inf under ``[tide] nonfinite = "stop"``."""


# The step being trained and its microbatch losses (one trainer per process).
_step_state: dict[str, Any] = {"step": 0, "losses": [], "policy": "stop", "skipped": 0}
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
    _step_state["timeout_s"] = float(timeout)  # from step 2 on
    return watchdog.start(wd)


def _train(self, *args, **kwargs):
    _step_state.update(policy=self.job_config.tide.nonfinite, skipped=0)
    checkpoint.set_policy(self.job_config.tide.corrupt_checkpoint)
    _start_watchdog(self.job_config)
    # On failure the watchdog keeps running: ``explain_failure`` still reads heartbeats.
    result = _originals["train"](self, *args, **kwargs)
    watchdog.stop()
    return result


def _train_step(self, *args, **kwargs):
    _step_state.update(step=self.step, losses=[])
    watchdog.set_step(self.step, _step_state.get("timeout_s") if self.step > 1 else None)
    return _originals["train_step"](self, *args, **kwargs)


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
        return True
    step = _step_state["step"]
    what = f"step {step}: loss {loss_value} (summed over ranks), gradient norm {norm_value}"
    if _step_state["policy"] == "skip":
        for p in parameters:
            p.grad = None
        _step_state["skipped"] += 1
        logger.warning(
            "%s is not finite: step skipped ([tide] nonfinite = \"skip\"), no optimizer "
            "update; %d step(s) skipped so far", what, _step_state["skipped"],
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
    from torchtitan.train import Trainer

    _originals.update(
        train=Trainer.train, train_step=Trainer.train_step,
        forward_backward_step=Trainer.forward_backward_step,
        clip_grad_norm_=dist_utils.clip_grad_norm_,
    )  # fmt: skip
    Trainer.train = _train
    Trainer.train_step = _train_step
    Trainer.forward_backward_step = _forward_backward_step
    dist_utils.clip_grad_norm_ = _clip_grad_norm_


def uninstall() -> None:
    """Undo :func:`install`."""
    if not _originals:
        return
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.train import Trainer

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
