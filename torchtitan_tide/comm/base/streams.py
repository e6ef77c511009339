"""The CUDA streams (and the empty result tensor) TIDE's comm modes share, one per device.

- ``"tide"`` (priority -1, like FSDP's comm streams): TIDE-AG, and TIDE-RS phase 1
  when it stages in the TIDE-AG slots (one slot protocol, one stream).
- ``"tide_rs_cross"`` (-1): TIDE-RS phase 2 (cross-node point-to-point).
- ``"tide_one_sided"`` / ``"tide_one_sided_rs"`` (-1): the NCCL one-sided puts, signals
  and waits of the windows' rounds (``transports.windows.transport``) / TIDE-RS
  phase 2 (``transports.windows.ring``), nothing else.
- ``"tide_fan"`` (-1): the windows' node-local puts and signals (the fan-out, TIDE-RS's
  node-local rounds), beside the cross-node puts of ``"tide_one_sided"``.
- ``"tide_place"`` (-1): the windows' placement copies and their waits on local peers.
- ``"tide_credit"`` (-1): the credits of the windows' in-place all-gather (a signal per
  writer after a reshard point of the compute stream), nothing else.
- ``"tide_rs_accumulate"`` (0, the compute stream's priority): TIDE-RS phase 1
  kernels, so the block scheduler does not put them ahead of the compute
  stream's GEMM CTAs.
- ``"symm_mem_side"`` (0): symm_mem collectives called on the legacy default
  stream.

Streams live for the process; ``run_beside`` is how work is put on one of them
in order with the caller's current stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["empty_on", "made_on", "run_beside", "stream"]

_PRIORITIES = {
    "tide": -1, "tide_rs_cross": -1, "tide_one_sided": -1, "tide_one_sided_rs": -1,
    "tide_fan": -1, "tide_place": -1, "tide_credit": -1,
    "tide_rs_accumulate": 0, "symm_mem_side": 0,
}  # fmt: skip
_streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
_empties: dict[torch.device, torch.Tensor] = {}
T = TypeVar("T")


def stream(name: str, device: torch.device) -> torch.cuda.Stream:
    """The stream ``name`` (see the module docstring) of CUDA ``device``."""
    key = (name, device)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=device, priority=_PRIORITIES[name])
    return _streams[key]


def made_on(device: torch.device) -> dict[str, torch.cuda.Stream]:
    """Every stream of this module made on ``device`` so far, by name (a profile's
    stream numbers are named from them: ``scripts/bench/bench_cross_node.py``)."""
    return {name: s for (name, dev), s in _streams.items() if dev == device}


def run_beside(side: torch.cuda.Stream, work: Callable[[], T]) -> T:
    """Run ``work`` with ``side`` current, after everything already queued on the
    caller's current stream, which then waits for it: stream order (and so
    buffer lifetimes in the caching allocator) stays as if ``work`` ran inline."""
    current = torch.cuda.current_stream(side.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        result = work()
    current.wait_stream(side)
    return result


def empty_on(device: torch.device) -> torch.Tensor:
    """A cached 0-element tensor on ``device`` (the flat-buffer slot of FSDP's
    results, which TIDE does not have)."""
    if device not in _empties:
        _empties[device] = torch.empty(0, device=device)
    return _empties[device]
