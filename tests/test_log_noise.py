"""Known-harmless messages are hidden (and said so), others pass; TIDE_LOG_ALL keeps all."""

import logging
import warnings

import pytest

from torchtitan_tide import log_noise


@pytest.fixture
def quiet_logger():
    logger = logging.getLogger("test_log_noise")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    yield logger, records
    logger.removeHandler(handler)
    logger.filters.clear()


def test_cpu_noise_hidden_and_named(quiet_logger, monkeypatch):
    logger, records = quiet_logger
    monkeypatch.delenv("TIDE_LOG_ALL", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = log_noise.install_noise_filters("cpu", logger)
        warnings.warn("DTensor random operators may not have complete support on cpu device mesh")
        warnings.warn("something else")
    assert [str(w.message) for w in caught] == ["something else"]
    assert "Error running lspci" in line and "TIDE_LOG_ALL=1" in line
    logger.warning("Error running lspci: [Errno 2] No such file or directory: 'lspci'")
    logger.warning("Peak flops undefined for: CPU (x86_64, 2 cores), fallback to A100")
    logger.warning("Warmup steps (10) exceed total steps (3).")
    for _ in range(3):
        logger.warning("Dataset tide_text is being re-looped")
    shown = [(r.levelname, r.getMessage()) for r in records]
    assert shown[0] == ("INFO", line)
    assert shown[1] == ("WARNING", "Warmup steps (10) exceed total steps (3).")
    assert shown[2][0] == "INFO" and shown[2][1].startswith("Dataset tide_text is being re-looped")
    assert len(shown) == 3


def test_gpu_keeps_cpu_only_messages_and_log_all_keeps_everything(quiet_logger, monkeypatch):
    logger, records = quiet_logger
    monkeypatch.delenv("TIDE_LOG_ALL", raising=False)
    with warnings.catch_warnings():
        log_noise.install_noise_filters("cuda", logger)
    logger.warning("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3")
    assert records[-1].getMessage().startswith("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING]")
    logger.filters.clear()
    records.clear()
    monkeypatch.setenv("TIDE_LOG_ALL", "1")
    assert log_noise.install_noise_filters("cpu", logger) is None
    logger.warning("Error running lspci: no")
    assert [r.getMessage() for r in records] == ["Error running lspci: no"]
