"""Test hook for a training run, loaded as its custom import
(``--experimental.custom_import tide_stop_rank`` with this folder on ``PYTHONPATH``): the
process of global rank ``TIDE_TEST_STOP_RANK`` stops itself (SIGSTOP) in step
``TIDE_TEST_STOP_STEP`` as it enters its first TIDE all-gather, after writing its pid to
the file ``TIDE_TEST_STOP_MARKER``. Its peers are then inside TIDE's cross-node wait on
it (the step's token-count all-reduce, a stock collective whose result the host reads,
is behind them): what a node that hangs looks like to them. Used by
tests/test_emulation_train_gpu.py; a run without the variables is not affected."""

import os
import signal
from pathlib import Path

import torch.distributed as dist
from torchtitan.train import Trainer

import torchtitan_tide.train_specs  # noqa: F401 - the custom import this one stands in for
from torchtitan_tide.comm.fsdp import patch as fsdp_patch

_train_step = Trainer.train_step
_tide_all_gather = fsdp_patch.tide_all_gather
_step = {"now": 0}


def _stop_here() -> bool:
    stop_step = os.environ.get("TIDE_TEST_STOP_STEP")
    stop_rank = os.environ.get("TIDE_TEST_STOP_RANK")
    if stop_step is None or stop_rank is None:
        return False
    return _step["now"] == int(stop_step) and dist.get_rank() == int(stop_rank)


def train_step(self, *args, **kwargs):
    _step["now"] = self.step
    return _train_step(self, *args, **kwargs)


def tide_all_gather(*args, **kwargs):
    if _stop_here():
        marker = os.environ.get("TIDE_TEST_STOP_MARKER")
        if marker:
            Path(marker).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    return _tide_all_gather(*args, **kwargs)


Trainer.train_step = train_step
fsdp_patch.tide_all_gather = tide_all_gather
