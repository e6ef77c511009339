"""The one-sided set-up of a process group: communicators, host RMA, windows; every outcome
agreed by all its ranks, every step bounded, everything made freed on any failure.

``install`` calls, per (process group, device) whose TIDE groups could use one-sided
transports:

1. :func:`probe` (before the transports are chosen): every rank's reason not to try (an
   old NCCL on one node, no CUDA), exchanged; the ``slots`` communicator (its unique id made
   by group rank 0 and exchanged, then the collective creation); its host-RMA answer,
   exchanged. The result says whether the group CAN use windows, and why not.
2. :func:`agree` (``install``: whether TIDE-AG goes in place, which sizes the window's
   arena): a local decision of every rank made one for all.
3. :func:`connect` (once install chose what runs): the sizes every rank computed, compared;
   the memory of each window this group needs, allocated as a LOCAL step whose outcome is
   exchanged before anyone enters the collective registration; the registrations; for
   TIDE-AG in place its credit communicator (``ag_credit``); for TIDE-RS phase 2 its two
   communicators (``data``, ``credit``) and its ring window. A unique id is made only for a
   communicator about to be created.

A rank that fails in a collective step (a creation, a registration) tells its peers through
the store at once (``SetupSteps.run``): their waits in that step stop within a poll, and
every rank's outcome is the failure. Any failure aborts every communicator made (their
windows freed), frees memory allocated and not registered, gives up the ids made, waits
(bounded) for steps abandoned in helper threads to end what they made late, and comes back
as a reason: ``install`` falls back under ``auto`` and raises under an explicit option.
Test hooks (:data:`FAIL_ON`) plant a failure at any step on chosen ranks.

The API is NCCL's one-sided calls (``transports/windows/nccl_rma.py``) for CUDA tensors on an NCCL
group, or the CPU stand-in (``transports/windows/rma_standin.py``) for CPU tensors on a gloo group
when ``TIDE_RMA_STANDIN=1`` (tests and the CPU preflight). Decisions:
docs/design/2026-12-04-windows.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...base.ranks import group_global_ranks
from ...base.setup_steps import SetupFailed, SetupSteps
from . import nccl_rma, rma_standin

__all__ = [
    "FAIL_ON", "NOT_NCCL", "STANDIN_ENV", "OneSidedApi", "Probe", "agree", "api_for", "connect",
    "probe",
]  # fmt: skip

logger = logging.getLogger(__name__)

STANDIN_ENV = "TIDE_RMA_STANDIN"
NOT_NCCL = "needs CUDA parameters and an NCCL process group"
# Seconds install waits, after a failed set-up, for the helper threads of abandoned steps to
# end what they made (a communicator created, a window registered after the rank gave up).
SETTLE_S = 10.0
# Test hook: set-up steps that fail on the given group ranks, as a real failure of that step
# would (what it allocated freed). Steps: "unique id:<comm>", "communicator:<comm>" (comm:
# slots, ag_credit, data, credit), "window allocation", "window registration", "ring
# allocation", "ring registration".
FAIL_ON: dict[str, set[int]] = {}


def _planted(step: str, rank: int) -> None:
    if rank in FAIL_ON.get(step, ()):
        raise RuntimeError(f"{step} failed on group rank {rank} (test hook)")


def _text(e: BaseException) -> str:
    return str(e) if isinstance(e, nccl_rma.NcclError) else f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class OneSidedApi:
    """Where the one-sided calls go: ``"nccl"`` (``nccl_rma``) or ``"standin"``."""

    name: str

    def new_unique_id(self) -> bytes:
        return nccl_rma.new_unique_id() if self.name == "nccl" else rma_standin.new_unique_id()

    def abandon_unique_id(self, unique_id: bytes) -> None:
        """Give up an id whose communicator failed somewhere (its maker, group rank 0).
        Stand-in: its folder goes and ranks blocked in its collective calls raise. NCCL has
        no call for it: the bootstrap root of an id no rank will join stays until the
        process ends (docs/design/2026-12-07-in-place-robust.md)."""
        if self.name == "standin":
            rma_standin.abandon_unique_id(unique_id)

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
    ``made``: every communicator made for this group (install aborts or destroys them);
    ``ids``: the unique ids this rank made (group rank 0), given up when their communicator
    failed; ``steps``: the bounded steps it ran on (waited for after a failure)."""

    api: OneSidedApi | None
    reason: str | None
    slots_comm: object = None
    ag_credit_comm: object = None  # made by ``connect(ag_credit=True)``
    made: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    steps: SetupSteps | None = None

    @property
    def capable(self) -> bool:
        return self.reason is None

    def abort(self) -> None:
        """End every communicator made (their windows freed), give up the ids, and wait
        (bounded) for abandoned steps to end what they made late."""
        for comm in self.made:
            try:
                comm.abort()
            except Exception as e:  # noqa: BLE001 - freeing on a failure path
                logger.debug("one-sided abort: %s", e)
        self.made.clear()
        self.slots_comm = self.ag_credit_comm = None
        for unique_id in self.ids:
            self.api.abandon_unique_id(unique_id)
        self.ids.clear()
        if self.steps is not None and not self.steps.settle(SETTLE_S):
            logger.warning("TIDE: a one-sided set-up step abandoned after a failure did not end "
                           "within %.0f s (its thread stays blocked in the backend)", SETTLE_S)


class _Soft:
    """One group's set-up steps: each a bounded collective (``SetupSteps``, run on the
    group's device) whose error is an outcome every rank learns, not a failure. A rank's
    own error in a collective step is reported to its peers at once (``SetupSteps.run``):
    their waits in it stop, their outcome is a failure too."""

    def __init__(self, steps: SetupSteps, scope: str, peers: list[int], device: torch.device):
        self.steps, self.scope, self.peers, self.device = steps, scope, peers, device

    def exchange(self, what: str, value: object) -> list:
        """Every rank's ``value`` (raises ``SetupFailed`` once a peer reported a failure in
        this scope and did not post in time)."""
        return self.steps.exchange(what, self.scope, self.peers, value)

    def agree(self, what: str, error: str | None) -> str | None:
        """Every rank's ``error`` of a step; None when none failed."""
        try:
            posted = self.exchange(f"{what} outcome", error)
        except SetupFailed as e:
            return error or str(e)
        bad = [(r, e) for r, e in enumerate(posted) if e]
        return "; ".join(f"group rank {r}: {e}" for r, e in bad) or None

    def attempt(self, what: str, fn, collective: bool = True, on_abandoned=None):
        """``(fn's value or None, None or every failing rank's error)``; ``on_abandoned``:
        ends what a collective step this rank gave up made late (``SetupSteps.run``)."""
        value, error = None, None
        try:
            if collective:
                value = self.steps.run(what, self.scope, self.peers, fn, self.device,
                                       on_abandoned)  # fmt: skip
            else:
                value = fn()
        except SetupFailed as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - an outcome every rank learns
            error = _text(e)
        return value, self.agree(what, error)


def _soft(steps: SetupSteps, scope: str, group: dist.ProcessGroup, device: torch.device) -> _Soft:
    return _Soft(steps, scope, list(group_global_ranks(group)), device)


def agree(
    steps: SetupSteps, scope: str, group: dist.ProcessGroup, device: torch.device, what: str,
    reason: str | None,
) -> str | None:  # fmt: skip
    """Every rank of ``group`` learns every rank's ``reason`` not to do ``what`` (a local
    decision that shapes a window, e.g. TIDE-AG in place); None when no rank has one, else
    one text naming the ranks (the same on every rank)."""
    return _soft(steps, scope, group, device).agree(what, reason)


def _communicator(soft: _Soft, found: Probe, name: str, group: dist.ProcessGroup,
                  device: torch.device) -> tuple[object | None, str | None]:  # fmt: skip
    """A new communicator ``name`` over ``group``'s ranks: group rank 0 makes its unique id
    now (only ids of communicators made are ever made), every rank learns it, every rank
    creates (collective, bounded). ``(comm, None)`` or ``(None or this rank's comm, why)``;
    every comm made is in ``found.made``, every id made in ``found.ids``."""
    rank, size = group.rank(), group.size()
    uid, failure = None, None
    if rank == 0:
        try:
            _planted(f"unique id:{name}", rank)
            uid = found.api.new_unique_id()
            found.ids.append(uid)
        except Exception as e:  # noqa: BLE001 - told to every rank
            failure = _text(e)
    try:
        failure, uid = soft.exchange(f"one-sided {name} unique id", (failure, uid))[0]
    except SetupFailed as e:
        return None, str(e)
    if failure is not None:
        return None, f"{name} communicator: group rank 0: {failure}"

    def create():
        _planted(f"communicator:{name}", rank)
        return found.api.create(uid, rank, size, device)

    comm, failure = soft.attempt(f"one-sided {name} communicator", create,
                                 on_abandoned=lambda late: late.abort())  # fmt: skip
    if comm is not None:
        found.made.append(comm)
    if failure is None and rank == 0:
        found.ids.remove(uid)  # in use: its communicator ends it
    return comm, failure


def probe(
    steps: SetupSteps, scope: str, group: dist.ProcessGroup, device: torch.device,
    api: OneSidedApi | None, why_not: str,
) -> Probe:  # fmt: skip
    """Step 1 of the module docstring for ``group`` (collective over its ranks, bounded).
    ``api``/``why_not``: this rank's :func:`api_for`."""
    soft = _soft(steps, scope, group, device)
    failure = None if api is not None else why_not
    try:
        posted = soft.exchange("one-sided reasons", failure)
    except SetupFailed as e:
        return Probe(api, str(e))
    reasons = [(r, why) for r, why in enumerate(posted) if why is not None]
    if reasons:
        return Probe(api, "; ".join(f"group rank {r}: {why}" for r, why in reasons))
    result = Probe(api, None, steps=steps)
    comm, failure = _communicator(soft, result, "slots", group, device)
    if failure is None:
        support, failure = soft.attempt("one-sided host RMA query", comm.host_rma_supported,
                                        collective=False)  # fmt: skip
        if failure is None:
            try:
                answers = soft.exchange("one-sided host RMA", support)
            except SetupFailed as e:
                answers, failure = [], str(e)
            lacking = [r for r, ok in enumerate(answers) if ok is False]
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
    communicator of ``found`` then aborted, its windows and ids freed). ``slots_bytes`` /
    ``ring_bytes`` 0: that window is not needed. ``ag_credit``: also make the in-place
    all-gather's credit communicator (``found.ag_credit_comm``). What sizes the windows must
    be the same on every rank: it is compared first."""
    soft = _soft(steps, scope, group, device)
    rank = group.rank()
    comm = found.slots_comm

    def fail(why: str):
        found.abort()
        return None, None, why

    try:
        shapes = soft.exchange("one-sided window sizes", (slots_bytes, ring_bytes, ag_credit))
    except SetupFailed as e:
        return fail(str(e))
    if len(set(shapes)) > 1:
        return fail("ranks size the windows differently ((window, ring, in-place credits) per "
                    f"group rank: {shapes})")

    def window(owner, nbytes: int, what: str):
        """``(window, None)`` or ``(None, why)``: ``nbytes`` allocated on every rank as a
        local step whose outcome all learn, then registered (collective) on ``owner``."""

        def allocate():
            _planted(f"{what} allocation", rank)
            return owner.allocate(nbytes)

        memory, failure = soft.attempt(f"one-sided {what} allocation ({nbytes} B)", allocate,
                                       collective=False)  # fmt: skip
        if failure is not None:
            if memory is not None:
                owner.free(memory)
            return None, f"allocation: {failure}"

        def register():
            try:
                _planted(f"{what} registration", rank)
            except RuntimeError:
                owner.free(memory)  # as a failed registration does (nccl_rma, rma_standin)
                raise
            return owner.register(memory)

        # A registration that ends after this rank gave up stays with ``owner``: its abort
        # (``fail``) frees it.
        registered, failure = soft.attempt(f"one-sided {what} registration", register)
        return (None, f"registration: {failure}") if failure is not None else (registered, None)

    slots_window = None
    if slots_bytes:
        slots_window, failure = window(comm, slots_bytes, "window")
        if failure is not None:
            return fail(f"window {failure}")
        if ag_credit:
            made, failure = _communicator(soft, found, "ag_credit", group, device)
            found.ag_credit_comm = made
            if failure is not None:
                return fail(f"TIDE-AG in-place credit communicator: {failure}")
    ring = None
    if ring_bytes:
        comms = []
        for name in ("data", "credit"):
            made, failure = _communicator(soft, found, name, group, device)
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
