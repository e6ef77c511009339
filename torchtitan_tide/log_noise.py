"""Known-harmless messages of TorchTitan/torch in our runs: hidden, and said so once.

The training entry point calls :func:`install_noise_filters` after TorchTitan's
``init_logger``. It hides the messages listed here (on CPU, those that only concern GPUs
or the CPU shim; on any device, deprecation notes of libraries we pin), shows a
re-looping dataset once at INFO instead of every pass, and logs one line naming what it
hides. ``TIDE_LOG_ALL=1`` keeps every message. Everything else passes unchanged; the
docs/guide/failures-and-messages.md ("Messages you may see") explains the messages that stay.
"""

import logging
import os
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownMessage:
    """A log message of TorchTitan (matched by ``text``, a substring) and why it is safe
    to hide; ``once``: shown the first time at INFO, hidden after."""

    text: str
    why: str
    cpu_only: bool = True
    once: bool = False


KNOWN_LOG_MESSAGES = (
    KnownMessage("Error running lspci", "no GPU to identify for the peak-FLOPS table"),
    KnownMessage(
        "Peak flops undefined for: CPU",
        "MFU on CPU is against TorchTitan's A100 fallback peak and means nothing",
    ),
    KnownMessage("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING]", "an NCCL setting; CPU runs use gloo"),
    KnownMessage("is being re-looped", "the dataset started another pass", cpu_only=False,
                 once=True),
)
# Python warnings (``warnings.warn``), matched at the start of the message.
KNOWN_WARNINGS = (
    KnownMessage(
        "DTensor random operators may not have complete support on cpu device mesh",
        "initialization on a CPU mesh is the same on every rank (seeded)",
    ),
    KnownMessage(
        "DTensor manual_seed() may not have complete support on cpu device mesh",
        "initialization on a CPU mesh is the same on every rank (seeded)",
    ),
    KnownMessage("'set_vital' is deprecated", "torchdata's note to TorchTitan's dataloader",
                 cpu_only=False),
)


class KnownNoiseFilter(logging.Filter):
    """Drops records whose message contains one of ``messages``; a ``once`` message
    passes the first time, demoted to INFO."""

    def __init__(self, messages: tuple[KnownMessage, ...]) -> None:
        super().__init__()
        self.messages = messages
        self.seen: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        for known in self.messages:
            if known.text in text:
                count = self.seen[known.text] = self.seen.get(known.text, 0) + 1
                if known.once and count == 1:
                    record.levelno, record.levelname = logging.INFO, "INFO"
                    record.msg, record.args = f"{text} (shown once: {known.why})", None
                    return True
                return False
        return True


def install_noise_filters(device_type: str, logger: logging.Logger | None = None) -> str | None:
    """Hide the known messages that apply on ``device_type`` ("cpu" or "cuda") on
    ``logger`` (default: the root logger TorchTitan logs to) and in Python's warnings.
    Returns the line logged about it, or None with ``TIDE_LOG_ALL=1`` (nothing hidden)."""
    if os.environ.get("TIDE_LOG_ALL", "") == "1":
        return None
    logger = logger if logger is not None else logging.getLogger()

    def applies(known: KnownMessage) -> bool:
        return device_type == "cpu" or not known.cpu_only

    messages = tuple(m for m in KNOWN_LOG_MESSAGES if applies(m))
    hidden_warnings = [m for m in KNOWN_WARNINGS if applies(m)]
    names = [m.text for m in messages if not m.once] + [m.text for m in hidden_warnings]
    line = (
        f"torchtitan-tide: hiding known-harmless messages on {device_type} "
        f"({'; '.join(names)}); TIDE_LOG_ALL=1 shows them (docs/guide/failures-and-messages.md)"
    )
    logger.info(line)  # before the filter, which would drop this line (it names them)
    logger.addFilter(KnownNoiseFilter(messages))
    for known in hidden_warnings:
        warnings.filterwarnings("ignore", message=re.escape(known.text), category=UserWarning)
    return line
