"""``[metrics] enable_wandb = true`` on CPU: an offline W&B run folder with the loss series.

The run is 2 gloo ranks of the debug model through ./run_train.sh with ``WANDB_MODE=offline``
(nothing leaves the machine). W&B writes its run to
``<dump_folder>/tb/<YYYYmmdd-HHMM>/wandb/offline-run-*/run-<id>.wandb``; the test reads the
history records of that file back (:func:`wandb_history`) and compares the loss series with
the project's own ``metrics.jsonl``. The launcher's stdout is a pipe here, as in a batch
job's log file: the step lines must carry no ANSI colour codes.
"""

import math
import struct
from pathlib import Path

import pytest
from train_helpers import losses, read_metrics, run_train

pytestmark = pytest.mark.slow
wandb = pytest.importorskip(
    "wandb", reason="wandb is not installed (a dependency of torchtitan-tide: pip install -e .)"
)

# The record log of a .wandb file (LevelDB's log format behind a 7-byte ":W&B" header):
# 32 KiB blocks of records (crc32, length, type); a record that crosses a block is split
# into FIRST / MIDDLE / LAST pieces.
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes):
    ident, _magic, _version = struct.unpack_from("<4sHB", data, 0)
    assert ident == b":W&B", f"not a W&B run file: {ident!r}"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if left < 7 or (kind == 0 and length == 0):  # a block's zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk


def wandb_history(run_file: Path) -> dict[int, dict[str, str]]:
    """{step: {metric: value as JSON text}} of the history records in ``run_file``."""
    from wandb.proto import wandb_internal_pb2

    history: dict[int, dict[str, str]] = {}
    for raw in _records(run_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json
                     for item in record.history.item}  # fmt: skip
            history[record.history.step.num] = items
    return history


def test_wandb_offline_run_keeps_the_loss_series(tmp_path):
    folder = tmp_path / "run"
    result = run_train(folder, "--training.steps", "3", "--metrics.enable_wandb",
                       WANDB_MODE="offline", WANDB_PROJECT="tide-test")  # fmt: skip
    (run_file,) = folder.glob("tb/*/wandb/offline-run-*/run-*.wandb")  # rank 0 logs alone
    history = wandb_history(run_file)
    wandb_loss = {step: float(items["loss_metrics/global_avg_loss"])
                  for step, items in history.items() if "loss_metrics/global_avg_loss" in items}
    jsonl_loss = losses(read_metrics(folder))
    assert sorted(wandb_loss) == [1, 2, 3], history
    assert all(math.isfinite(v) for v in wandb_loss.values())
    for step, loss in jsonl_loss.items():
        assert math.isclose(wandb_loss[step], loss, rel_tol=1e-6), (step, wandb_loss, jsonl_loss)
    assert "WandB logging enabled" in result.stdout + result.stderr

    # Plain log lines: the launcher turned TorchTitan's colour off (stdout is a pipe).
    step_lines = [line for line in result.stdout.splitlines() if "step:" in line and "loss:" in line]
    assert len(step_lines) == 3, result.stdout[-3000:]
    assert "\x1b[" not in result.stdout + result.stderr
