"""Per-step metrics as JSON lines, beside TorchTitan's TensorBoard/W&B loggers.

``<dump_folder>/metrics.jsonl`` on the metrics rank. Every line is one JSON object
(strict JSON: a NaN or infinite value is written as the string ``"nan"``, ``"inf"`` or
``"-inf"``, which ``float()`` reads back). Runs append to the file; each run writes:

- a header ``{"event": "run_start", "run_id", "start_time", "comm", "steps", "config"}``
  when its metrics logger is built;
- a marker ``{"event": "resume", "run_id", "first_step"}`` before its first record when
  that first logged step is not 1 (a checkpoint resume: TorchTitan always logs step 1 of
  a fresh run). Records of earlier runs at steps >= ``first_step`` are superseded by this
  run's; nothing is deleted;
- one ``{"step": 5, "run_id": ..., "loss_metrics/global_avg_loss": ..., ...}`` record per
  logged step, floats at full precision.

:func:`read_metrics` applies these rules: it returns the step records of the last run,
preceded (for a resumed run) by the records of the run it resumed, recursively, at the
steps before the resume. So a 120-step run and a later fresh 20-step run in one folder
read as the 20-step run; a run resumed at step 50 reads as steps 1..49 of the first run
and 50.. of the resumed one.
"""

import dataclasses
import json
import math
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    build_metrics_processor,
)

METRICS_FILE = "metrics.jsonl"
RUN_START = "run_start"
RESUME = "resume"


class JsonlLogger(BaseLogger):
    """Appends this run's header, resume marker and ``{"step": step, **metrics}`` lines
    to ``path`` (module doc); flushes every line."""

    def __init__(self, path: str, header: dict[str, Any] | None = None) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.run_id = uuid.uuid4().hex[:12]
        self._first_step_seen = False
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open until close()
        self._write({
            "event": RUN_START,
            "run_id": self.run_id,
            "start_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **(header or {}),
        })

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self._first_step_seen:
            self._first_step_seen = True
            if step != 1:
                self._write({"event": RESUME, "run_id": self.run_id, "first_step": step})
        self._write({"step": step, "run_id": self.run_id,
                     **{k: _plain(v) for k, v in metrics.items()}})

    def close(self) -> None:
        self._file.close()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(to_json_line(record) + "\n")
        self._file.flush()


def to_json_line(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON: non-finite floats become "nan"/"inf"/"-inf",
    objects JSON does not know become their ``str``."""
    return json.dumps(_finite(record), allow_nan=False, default=str)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The step records of ``path`` (a ``metrics.jsonl`` or its folder) that describe the
    last run, resumes resolved as the module doc says. Files written before run headers
    existed read as one run."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    runs: list[dict[str, Any]] = []  # {"first_step": int | None, "records": [...]}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        event = record.get("event")
        if event == RUN_START or not runs:
            runs.append({"first_step": None, "records": []})
        if event == RESUME:
            runs[-1]["first_step"] = record["first_step"]
        elif event is None:
            runs[-1]["records"].append(record)
    chain: list[dict[str, Any]] = []
    limit = None  # steps below which earlier runs still count
    for run in reversed(runs):
        if not run["records"]:
            continue
        chain[:0] = [r for r in run["records"] if limit is None or r["step"] < limit]
        if run["first_step"] is None:
            break
        limit = run["first_step"] if limit is None else min(limit, run["first_step"])
    return chain


def run_header(job_config) -> dict[str, Any]:
    """What the ``run_start`` record says about a run: comm mode, steps, the whole config."""
    config = dataclasses.asdict(job_config) if dataclasses.is_dataclass(job_config) else {}
    return {
        "comm": job_config.tide.comm,
        "steps": job_config.training.steps,
        "dump_folder": job_config.job.dump_folder,
        "config": config,
    }


def build_metrics_processor_with_jsonl(
    job_config, parallel_dims, model_args=None, tag: str | None = None
) -> MetricsProcessor:
    """TorchTitan's metrics processor, plus :class:`JsonlLogger` on the metrics rank
    when ``[tide] metrics_jsonl`` is on."""
    from torchtitan.components.metrics import _get_metrics_rank

    processor = build_metrics_processor(job_config, parallel_dims, model_args, tag)
    if not job_config.tide.metrics_jsonl:
        return processor
    if torch.distributed.get_rank() != _get_metrics_rank(parallel_dims, job_config):
        return processor
    loggers = LoggerContainer()
    loggers.add_logger(processor.logger)
    loggers.add_logger(
        JsonlLogger(os.path.join(job_config.job.dump_folder, METRICS_FILE), run_header(job_config))
    )
    processor.logger = loggers
    return processor
