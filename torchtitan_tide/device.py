"""Run TorchTitan 0.2.2 on CPU: the one shim that makes ``device_type`` "cpu".

TorchTitan picks its device once, at import of ``torchtitan.tools.utils``, and falls
back to "cuda" when no accelerator exists; several modules then copy ``device_type``
and ``device_module`` by name. :func:`use_cpu_device` rebinds both in every
TorchTitan module already imported, and gives them a device module that answers the
calls TorchTitan makes (``set_device``, ``memory_stats``, ...) from the process's
resident memory. It must run before the Trainer is built; the training entry point
(``torchtitan_tide.train``) calls it when CUDA is absent or ``TIDE_DEVICE=cpu``.
"""

import os
import platform
import resource
import sys
from types import SimpleNamespace
from typing import Any

import torch


def wants_cpu() -> bool:
    """True when this process should train on CPU (no CUDA, or TIDE_DEVICE=cpu)."""
    requested = os.environ.get("TIDE_DEVICE", "").strip().lower()
    if requested not in ("", "cpu", "cuda"):
        raise ValueError(f"TIDE_DEVICE={requested!r} is not valid; use 'cpu' or 'cuda' or unset it")
    if requested:
        return requested == "cpu"
    return not torch.cuda.is_available()


class CpuDeviceModule:
    """The subset of ``torch.cuda``'s API that TorchTitan calls, for the CPU.

    Memory figures are the process's resident set size (peak from ``VmHWM``, which
    ``reset_peak_memory_stats`` resets through ``/proc/self/clear_refs`` where the
    kernel allows it). Capacity is the machine's physical memory.
    """

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def set_device(self, device: Any) -> None:
        return None

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_name(self, device: Any = None) -> str:
        return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"

    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(total_memory=total, name=self.get_device_name())

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # peak then covers the whole process lifetime

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


CPU_DEVICE_MODULE = CpuDeviceModule()


def use_cpu_device() -> None:
    """Make TorchTitan treat "cpu" as its device type, in every module that copied it."""
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    titan_utils.device_module = CPU_DEVICE_MODULE
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan.") or module is None:
            continue
        if getattr(module, "device_type", None) not in (None, "cpu"):
            module.device_type = "cpu"
        if hasattr(module, "device_module") and module.device_module is not CPU_DEVICE_MODULE:
            module.device_module = CPU_DEVICE_MODULE
