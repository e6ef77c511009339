"""``python -m torchtitan_tide.torchrun ...``: torchrun (``torch.distributed.run``) that gives
the workers left after a worker failed ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default
here :data:`SHUTDOWN_GRACE_S`) between SIGTERM and SIGKILL.

torch 2.11-2.13's agent closes the workers after a failure with ``PContext.close()``'s
default 30 s (``SubprocessContext._poll``, ``LocalElasticAgent._stop_workers``), whatever
the configured shutdown timeout. A stopped (SIGSTOP) or hung worker never acts on
SIGTERM, so after the TIDE watchdog ended the survivors the job would linger those 30 s;
TorchTitan does nothing on SIGTERM that needs them.
"""

import os
import runpy

SHUTDOWN_GRACE_S = 5
_original_close = None


def shutdown_grace_s() -> int:
    """Seconds between SIGTERM and SIGKILL of the remaining workers."""
    return int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_GRACE_S))


def _close(self, death_sig=None, timeout: int = 30) -> None:
    _original_close(self, death_sig=death_sig, timeout=min(timeout, shutdown_grace_s()))


def patch_agent() -> None:
    """Cap ``PContext.close``'s wait before SIGKILL at :func:`shutdown_grace_s`."""
    global _original_close
    from torch.distributed.elastic.multiprocessing.api import PContext

    if _original_close is None:
        _original_close = PContext.close
        PContext.close = _close


if __name__ == "__main__":
    patch_agent()
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
