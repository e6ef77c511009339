"""Non-finite steps: ``[tide] nonfinite = "stop"`` raises with the step and the value on
every rank, ``"skip"`` drops the step's gradients; a diverging run ends before its
non-finite step is checkpointed."""

import math
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from torchtitan_tide import guards
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
