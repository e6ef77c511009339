"""The one-sided set-up of a process group: communicators, host RMA, windows; every outcome
agreed by all its ranks, every step bounded, everything made freed on any failure.

``install`` calls, per (process group, device) whose TIDE groups could use one-sided
transports:

1. :func:`probe` (before the transports are chosen): every rank's reason not to try (an
   old NCCL on one node, no CUDA) and the first rank's unique ids in one exchange; the
   ``slots`` communicator (collective); its host-RMA answer, exchanged. The result says
   whether the group CAN use windows, and why not.
2. :func:`connect` (once install chose what runs): the memory of each window this group
   needs, allocated as a LOCAL step whose outcome is exchanged before anyone enters the
   collective registration (one rank out of memory no longer leaves its peers waiting
   inside it); the registrations; for TIDE-AG in place its credit communicator
   (``ag_credit``); for TIDE-RS phase 2 its two communicators (``data``, ``credit``) and
   its ring window. Any failure aborts every communicator made and frees
   every window, and comes back as a reason: ``install`` falls back under ``auto`` and
   raises under an explicit option.

The API is NCCL's one-sided calls (``transport/nccl_rma.py``) for CUDA tensors on an NCCL
group, or the CPU stand-in (``transport/rma_standin.py``) for CPU tensors on a gloo group
when ``TIDE_RMA_STANDIN=1`` (tests and the CPU preflight). Decisions:
docs/design/2026-12-04-windows.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .setup_steps import SetupSteps
from .transport import nccl_rma, rma_standin

__all__ = ["NOT_NCCL", "STANDIN_ENV", "OneSidedApi", "Probe", "api_for", "connect", "probe"]

logger = logging.getLogger(__name__)

STANDIN_ENV = "TIDE_RMA_STANDIN"
NOT_NCCL = "needs CUDA parameters and an NCCL process group"
# TIDE-AG + TIDE-RS phase 1; phase 2's puts; its credits; the in-place all-gather's credits
COMMS = ("slots", "data", "credit", "ag_credit")
# Test hook: group ranks whose window allocation fails (install's allocation step).
FAIL_ALLOCATION_ON: set[int] = set()


@dataclass(frozen=True)
class OneSidedApi:
    """Where the one-sided calls go: ``"nccl"`` (``nccl_rma``) or ``"standin"``."""

    name: str

    def new_unique_id(self) -> bytes:
        return nccl_rma.new_unique_id() if self.name == "nccl" else rma_standin.new_unique_id()

    def create(self, unique_id: bytes, rank: int, size: int, device: torch.device):
        cls = nccl_rma.RmaComm if self.name == "nccl" else rma_standin.StandinRma
        return cls.create(unique_id, rank, size, device)

    def version(self) -> str:
        if self.name == "standin":
            return "CPU stand-in"
        return f"NCCL {nccl_rma.version_text(nccl_rma.nccl_version())}"


def api_for(device: torch.device, backend: str, shared_device: bool) -> tuple[OneSidedApi | None, str]:
    """``(the API, how)`` for a group on ``device`` with ``backend`` (``dist.get_backend``),
    or ``(None, why not)``. ``shared_device``: ranks of the group share this GPU (NCCL >=
    2.30 and ``NCCL_MULTI_RANK_GPU_ENABLE=1`` then)."""
    backend = backend.lower()
    if device.type == "cpu":
        if os.environ.get(STANDIN_ENV) == "1" and "gloo" in backend:
            return OneSidedApi("standin"), f"CPU stand-in ({STANDIN_ENV}=1)"
        return None, NOT_NCCL
    if device.type != "cuda" or "nccl" not in backend:
        return None, NOT_NCCL
    if (missing := nccl_rma.one_sided_missing_reason()) is not None:
        return None, missing
    if shared_device and (missing := nccl_rma.multi_rank_gpu_missing_reason()) is not None:
        return None, missing
    return OneSidedApi("nccl"), f"NCCL {nccl_rma.version_text(nccl_rma.nccl_version())}"


@dataclass
class Probe:
    """What :func:`probe` found for one process group: ``api`` and the ``slots`` comm when
    every rank can use windows (``reason`` None), else ``reason`` names the ranks and why.
    ``ids``: the unique ids of the ``data`` and ``credit`` comms (phase 2). ``made``: every
    communicator made for this group (install aborts or destroys them)."""

    api: OneSidedApi | None
    reason: str | None
    slots_comm: object = None
    ag_credit_comm: object = None  # made by ``connect(ag_credit=True)``
    ids: dict[str, bytes] = field(default_factory=dict)
    made: list = field(default_factory=list)

    @property
    def capable(self) -> bool:
        return self.reason is None

    def abort(self) -> None:
        for comm in self.made:
            try:
                comm.abort()
            except Exception as e:  # noqa: BLE001 - freeing on a failure path
                logger.debug("one-sided abort: %s", e)
        self.made.clear()
        self.slots_comm = self.ag_credit_comm = None


class _Soft:
    """One group's set-up steps: each a bounded collective (``SetupSteps``, run on the
    group's device) whose error is an outcome every rank learns, not a failure."""

    def __init__(self, steps: SetupSteps, scope: str, peers: list[int], device: torch.device):
        self.steps, self.scope, self.peers, self.device = steps, scope, peers, device

    def exchange(self, what: str, value: object) -> list:
        return self.steps.exchange(what, self.scope, self.peers, value)

    def agree(self, what: str, error: str | None) -> str | None:
        """Every rank's ``error`` of a local step; None when none failed."""
        bad = [(r, e) for r, e in enumerate(self.exchange(f"{what} outcome", error)) if e]
        return "; ".join(f"group rank {r}: {e}" for r, e in bad) or None

    def attempt(self, what: str, fn, collective: bool = True):
        """``(fn's value or None, None or every failing rank's error)``."""

        def soft():
            try:
                return fn(), None
            except Exception as e:  # noqa: BLE001 - an outcome every rank learns
                return None, str(e) if isinstance(e, nccl_rma.NcclError) else (
                    f"{type(e).__name__}: {e}")  # fmt: skip

        if collective:
            value, error = self.steps.run(what, self.scope, self.peers, soft, self.device)
        else:
            value, error = soft()
        return value, self.agree(what, error)


def probe(
    steps: SetupSteps, scope: str, group: dist.ProcessGroup, device: torch.device,
    api: OneSidedApi | None, why_not: str,
) -> Probe:  # fmt: skip
    """Step 1 of the module docstring for ``group`` (collective over its ranks, bounded).
    ``api``/``why_not``: this rank's :func:`api_for`."""
    from . import transport

    peers = list(transport.group_global_ranks(group))
    soft = _Soft(steps, scope, peers, device)
    rank, size = group.rank(), group.size()
    failure = None if api is not None else why_not
    ids = None
    if rank == 0 and api is not None:
        try:
            ids = {name: api.new_unique_id() for name in COMMS}
        except Exception as e:  # noqa: BLE001 - told to every rank
            failure = f"{type(e).__name__}: {e}"
    posted = soft.exchange("one-sided reasons and unique ids", (failure, ids))
    reasons = [(r, why) for r, (why, _) in enumerate(posted) if why is not None]
    if reasons:
        return Probe(api, "; ".join(f"group rank {r}: {why}" for r, why in reasons))
    ids = posted[0][1]
    result = Probe(api, None, ids={k: v for k, v in ids.items() if k != "slots"})
    comm, failure = soft.attempt("one-sided communicator",
                                 lambda: api.create(ids["slots"], rank, size, device))  # fmt: skip
    if comm is not None:
        result.made.append(comm)
    if failure is None:
        support, failure = soft.attempt("one-sided host RMA query", comm.host_rma_supported,
                                        collective=False)  # fmt: skip
        if failure is None:
            lacking = [r for r, ok in enumerate(soft.exchange("one-sided host RMA", support))
                       if ok is False]  # fmt: skip
            if lacking:
                failure = f"{api.version()} reports no host RMA between these ranks ({lacking})"
    if failure is not None:
        result.abort()
        result.reason = failure
        return result
    result.slots_comm = comm
    return result


def connect(
    steps: SetupSteps, scope: str, group: dist.ProcessGroup, device: torch.device,
    found: Probe, slots_bytes: int, ring_bytes: int, ag_credit: bool = False,
) -> tuple[object | None, tuple | None, str | None]:  # fmt: skip
    """Step 2 of the module docstring: ``(slots window or None, (data comm, credit comm,
    ring window) or None, None)`` on success, ``(None, None, why)`` on any failure (every
    communicator of ``found`` then aborted). ``slots_bytes`` / ``ring_bytes`` 0: that
    window is not needed. ``ag_credit``: also make the in-place all-gather's credit
    communicator (``found.ag_credit_comm``)."""
    from . import transport

    peers = list(transport.group_global_ranks(group))
    soft = _Soft(steps, scope, peers, device)
    rank, size = group.rank(), group.size()
    comm = found.slots_comm

    def window(owner, nbytes: int, what: str):
        """``(window, None)`` or ``(None, why)``: ``nbytes`` allocated on every rank as a
        local step whose outcome all learn, then registered (collective) on ``owner``."""

        def allocate():
            if rank in FAIL_ALLOCATION_ON:
                raise MemoryError(f"window allocation of {nbytes} B failed (test hook)")
            return owner.allocate(nbytes)

        memory, failure = soft.attempt(f"one-sided {what} allocation ({nbytes} B)", allocate,
                                       collective=False)  # fmt: skip
        if failure is not None:
            if memory is not None:
                owner.free(memory)
            return None, f"allocation: {failure}"
        registered, failure = soft.attempt(f"one-sided {what} registration",
                                           lambda: owner.register(memory))  # fmt: skip
        return (None, f"registration: {failure}") if failure is not None else (registered, None)

    def fail(why: str):
        found.abort()
        return None, None, why

    slots_window = None
    if slots_bytes:
        slots_window, failure = window(comm, slots_bytes, "window")
        if failure is not None:
            return fail(f"window {failure}")
        if ag_credit:
            made, failure = soft.attempt(
                "one-sided ag_credit communicator",
                lambda: found.api.create(found.ids["ag_credit"], rank, size, device),
            )  # fmt: skip
            if made is not None:
                found.made.append(made)
                found.ag_credit_comm = made
            if failure is not None:
                return fail(f"TIDE-AG in-place credit communicator: {failure}")
    ring = None
    if ring_bytes:
        comms = []
        for name in ("data", "credit"):
            made, failure = soft.attempt(
                f"one-sided {name} communicator",
                lambda name=name: found.api.create(found.ids[name], rank, size, device),
            )  # fmt: skip
            if made is not None:
                found.made.append(made)
                comms.append(made)
            if failure is not None:
                return fail(f"TIDE-RS phase-2 {name} communicator: {failure}")
        ring_window, failure = window(comms[0], ring_bytes, "ring")
        if failure is not None:
            return fail(f"TIDE-RS phase-2 window {failure}")
        ring = (comms[0], comms[1], ring_window)
    if slots_window is None and comm is not None:  # probed, not needed: let it go
        found.made.remove(comm)
        comm.abort()
        found.slots_comm = None
    return slots_window, ring, None
