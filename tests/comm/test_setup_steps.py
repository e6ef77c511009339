"""SetupSteps.run's helper thread runs the step on the CUDA device the caller names.

A new thread starts on CUDA device 0 (whatever the caller's is); on every rank but local rank 0 a symmetric-memory
rendezvous or process-group creation run there would use another rank's GPU. CUDA is
mocked (the set-up's store is not touched: the step succeeds at once).
"""

from __future__ import annotations

import threading

import torch

from torchtitan_tide.comm.base.setup_steps import SetupSteps


def _steps() -> SetupSteps:
    steps = object.__new__(SetupSteps)  # no default store needed: the step succeeds
    steps.store, steps.prefix, steps.rank = None, "tide_install/0", 3
    steps.timeout_s, steps.poll_s = 5.0, 0.01
    return steps


def test_step_runs_on_the_named_cuda_device(monkeypatch):
    current = threading.local()  # CUDA's current device is per thread
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(current, "device", d.index))
    current.device = 3  # the caller's device: the helper thread does not inherit it

    rank_device = torch.device("cuda", 3)
    seen = _steps().run("rendezvous", "node0", [2, 3], torch.cuda.current_device, rank_device)
    assert seen == 3
    assert _steps().run("rendezvous", "node0", [2, 3], torch.cuda.current_device) == 0


def test_step_on_cpu_sets_no_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    assert _steps().run("new_group", "node0", [0, 1], lambda: "ok", torch.device("cpu")) == "ok"
    assert _steps().run("new_group", "node0", [0, 1], lambda: "ok") == "ok"
    assert calls == []


def test_store_polling_slows_down_with_the_world_size():
    from torchtitan_tide.comm.base.setup_steps import default_poll_s

    assert default_poll_s(2) == default_poll_s(64) == 0.05
    assert default_poll_s(1024) == 1024 / 2000  # ~2000 store checks/s for the whole job
    assert default_poll_s(100_000) == 1.0
