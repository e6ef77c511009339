"""Run guards. Non-finite steps: ``[tide] nonfinite = "stop"`` raises with the step and
the value on every rank, ``"skip"`` drops the step's gradients up to ``max_skipped_steps``
in a row and never checkpoints a skipped step; a diverging run ends before its non-finite
step is checkpointed. The watchdog deadline of the first step of a (resumed) process."""

import logging
import math
import multiprocessing
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from torchtitan_tide import guards
from torchtitan_tide.comm.base import watchdog
from torchtitan_tide.config import Tide, TideConfigError
from torchtitan_tide.guards import NonFiniteTrainingError, check_step


def _params() -> list[torch.Tensor]:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    return [p]


@pytest.fixture
def step_state():
    saved = dict(guards._step_state)
    yield guards._step_state
    guards._step_state.clear()
    guards._step_state.update(saved)


def test_finite_step_passes(step_state):
    step_state.update(step=3, losses=[torch.tensor(2.5)], policy="stop")
    params = _params()
    assert check_step(torch.tensor(1.25), params) and params[0].grad is not None


@pytest.mark.parametrize("loss, norm", [(math.nan, 1.0), (2.0, math.inf), (-math.inf, 1.0)])
def test_stop_names_step_and_value(step_state, loss, norm):
    step_state.update(step=3, losses=[torch.tensor(loss)], policy="stop")
    with pytest.raises(NonFiniteTrainingError) as err:
        check_step(torch.tensor(norm), _params())
    message = str(err.value)
    assert "step 3:" in message and f"loss {loss}" in message and f"gradient norm {norm}" in message
    assert "not checkpointed" in message and 'nonfinite = "skip"' in message


def test_skip_drops_the_gradients(step_state, caplog):
    step_state.update(step=5, losses=[torch.tensor(1.0)], policy="skip", skipped=0)
    params = _params()
    assert not check_step(torch.tensor(math.nan), params)
    assert params[0].grad is None and step_state["skipped"] == 1
    assert "step 5: loss 1.0 (summed over ranks), gradient norm nan is not finite: step skipped" in caplog.text


def test_skip_stops_after_max_skipped_steps_in_a_row(step_state):
    step_state.update(step=5, losses=[torch.tensor(math.nan)], policy="skip", max_skipped=3,
                      skipped=0, consecutive_skipped=0)  # fmt: skip
    assert not check_step(torch.tensor(1.0), _params())
    step_state["losses"] = [torch.tensor(1.0)]
    assert check_step(torch.tensor(1.0), _params())  # a finite step restarts the count
    step_state["losses"] = [torch.tensor(math.nan)]
    for _ in range(2):
        assert not check_step(torch.tensor(1.0), _params())
    params = _params()
    with pytest.raises(NonFiniteTrainingError) as err:
        check_step(torch.tensor(1.0), params)
    message = str(err.value)
    assert "3 steps in a row were skipped" in message and "max_skipped_steps = 3" in message
    assert "training stops" in message and "not checkpointed" in message
    assert step_state["skipped"] == 3


@pytest.mark.parametrize("value", [0, -1])
def test_max_skipped_steps_must_be_positive(value):
    with pytest.raises(TideConfigError, match=rf"\[tide\] max_skipped_steps = {value} must be an integer >= 1"):
        Tide(max_skipped_steps=value)


def test_skipped_step_is_never_checkpointed(step_state, monkeypatch, caplog):
    saved: list[tuple[int, bool]] = []
    monkeypatch.setitem(guards._originals, "checkpoint_save",
                        lambda self, step, last_step=False: saved.append((step, last_step)))  # fmt: skip
    manager = SimpleNamespace(_should_save=lambda step, last_step=False: step % 2 == 0 or last_step)
    step_state.update(step=6, losses=[torch.tensor(math.nan)], policy="skip", max_skipped=10,
                      consecutive_skipped=0, last_skipped=False)  # fmt: skip
    assert not check_step(torch.tensor(1.0), _params())
    with caplog.at_level(logging.WARNING, logger="torchtitan_tide.guards"):
        guards._checkpoint_save(manager, 6)
        guards._checkpoint_save(manager, 6, last_step=True)
    assert saved == [] and caplog.text.count("step 6 was skipped") == 2
    step_state.update(step=7, last_skipped=False, losses=[torch.tensor(1.0)])
    assert check_step(torch.tensor(1.0), _params())
    guards._checkpoint_save(manager, 7, last_step=True)
    assert saved == [(7, True)]


def test_resumed_run_keeps_init_deadline_in_its_first_step(step_state, monkeypatch, tmp_path):
    """A run resumed at step 500: step 501 (this process's first) waits under
    comm.init_timeout_seconds, step 502 under comm.train_timeout_seconds. Mocked clock:
    ``Watchdog.check(now)``, no polling thread."""
    monkeypatch.setattr(watchdog.Watchdog, "start", lambda self: None)
    monkeypatch.setattr(guards.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(guards.dist, "get_world_size", lambda group=None: 1)
    job_config = SimpleNamespace(
        tide=SimpleNamespace(watchdog_timeout_s=0, nonfinite="stop", max_skipped_steps=10,
                             corrupt_checkpoint="stop"),
        comm=SimpleNamespace(train_timeout_seconds=100, init_timeout_seconds=600),
        job=SimpleNamespace(dump_folder=str(tmp_path)),
    )  # fmt: skip
    overdue_at_150s: dict[int, bool] = {}

    def train(self):
        for _ in range(2):
            self.step += 1
            guards._train_step(self)

    def train_step(self):
        wd = watchdog.active()
        wd.watch("TIDE-AG p2p gather", "g", (1,), lambda: False)
        assert wd.check(now=0.0) is None  # stamped: deadline 0 s + this step's timeout
        overdue_at_150s[self.step] = wd.check(now=150.0) is not None
        wd._timed.clear()

    monkeypatch.setitem(guards._originals, "train", train)
    monkeypatch.setitem(guards._originals, "train_step", train_step)
    guards._train(SimpleNamespace(job_config=job_config, step=500))
    assert overdue_at_150s == {501: False, 502: True}, overdue_at_150s


def _rank(rank: int, init_file: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    # Only rank 1's loss is NaN; the gradient norm (global already) is finite.
    guards._step_state.update(step=2, losses=[torch.tensor(math.nan if rank else 1.0)],
                              policy="stop")  # fmt: skip
    try:
        check_step(torch.tensor(0.5), _params())
        out.put((rank, None))
    except NonFiniteTrainingError as e:
        out.put((rank, str(e)))
    dist.destroy_process_group()


def test_every_rank_decides_alike(tmp_path):
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = dict(out.get() for _ in procs)
    assert all(results[r] is not None and "step 2: loss nan" in results[r] for r in (0, 1)), results


@pytest.mark.slow
def test_diverging_run_stops_before_saving_the_bad_step(tmp_path):
    """lr 1e30 sends the weights to inf after step 1; step 2's loss is not finite."""
    from train_helpers import train

    folder = tmp_path / "run"
    with pytest.raises(AssertionError) as err:
        train(folder, "--training.steps", "4", "--optimizer.lr", "1e30",
              "--checkpoint.enable",
              "--checkpoint.interval", "1", "--checkpoint.no-last-save-model-only")  # fmt: skip
    message = str(err.value)
    assert "NonFiniteTrainingError" in message and "is not finite: training stops" in message
    saved = sorted(p.name for p in (folder / "checkpoint").iterdir())
    assert saved == ["step-1"], saved


@pytest.mark.slow
def test_skipping_run_stops_after_max_skipped_steps_without_saving_them(tmp_path):
    """lr 1e30: every step from 2 on is NaN; with "skip" and max_skipped_steps 2 the run
    stops at step 3 and only step 1 is saved (issue 22: it used to save step-2..step-6)."""
    from train_helpers import train

    folder = tmp_path / "run"
    with pytest.raises(AssertionError) as err:
        train(folder, "--training.steps", "6", "--optimizer.lr", "1e30",
              "--tide.nonfinite", "skip", "--tide.max_skipped_steps", "2",
              "--checkpoint.enable", "--checkpoint.interval", "1",
              "--checkpoint.no-last-save-model-only")  # fmt: skip
    message = str(err.value)
    assert "2 steps in a row were skipped" in message and "max_skipped_steps = 2" in message
    saved = sorted(p.name for p in (folder / "checkpoint").iterdir())
    assert saved == ["step-1"], saved
