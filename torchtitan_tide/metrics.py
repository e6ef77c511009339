"""Per-step metrics as JSON lines, beside TorchTitan's TensorBoard/W&B loggers.

``<dump_folder>/metrics.jsonl`` gets one object per logged step on the metrics rank
(``{"step": 5, "loss_metrics/global_avg_loss": ..., ...}``), with floats at full
precision: loss curves of runs in different comm modes compare step by step, and
resumed runs append to the same file.
"""

import json
import os
from typing import Any

import torch
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    build_metrics_processor,
)

METRICS_FILE = "metrics.jsonl"


class JsonlLogger(BaseLogger):
    """Appends ``{"step": step, **metrics}`` lines to ``path``; flushes every line."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open until close()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


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
    loggers.add_logger(JsonlLogger(os.path.join(job_config.job.dump_folder, METRICS_FILE)))
    processor.logger = loggers
    return processor
