"""Check 3, ``one_sided``: the two NCCL behaviours TIDE's one-sided protocol relies on
(docs/design/2026-12-02-one-sided.md), stress-tested between every pair of the cross-node tier.

What the protocol assumes of a put (``put_signal``) and its signal:

1. the signal is visible to the peer only after the put's data (a reordered signal makes the
   peer read stale bytes);
2. once the put completed on its stream the source may be reused (a source read later
   sends the bytes written after the put).

The pattern, on the real transport (``nccl_rma.RmaComm``, NCCL >= 2.29; on CPU the stand-in
``rma_standin.StandinRma``, the same calls): each rank of a tier registers one window
holding one send slot per peer and two receive slots per peer (rounds alternate). In every
round each rank writes a sequence-numbered payload (sender, receiver and round in every
element) into its send slot, puts it into the peer's receive slot with a signal (every
4th round one more signal without data: ``signal``), and right after the put, on the same
stream, overwrites its send slot with a source poison. Then it waits for every peer's
signals and verifies the receive slot on the receiver (stream-ordered after the wait), and
poisons it again. A rank reuses a peer's receive slot two rounds later, after the peer's
data of the round between, which the peer put after verifying (the protocol's own reuse
rule). The receiver classifies every round of every sender:

- the payload: correct;
- its own receive poison or an earlier round's payload: the signal overtook its data;
- the source poison or a later round's payload: the source was read after its reuse;
- anything else: corrupted data.

Every wait is bounded (the stand-in's deadline; on GPU the host polls an event recorded
after the rounds), so a broken network fails the check instead of hanging it. Where the
one-sided path cannot run (no cross-node tier, NCCL < 2.29, no host RMA between the nodes,
ranks of a CPU tier on different machines) the row says why; that is a failure only when
the run's ``[tide] cross_node_transport`` asks for ``"nccl_one_sided"``.

Tests only: ``TIDE_PREFLIGHT_FAKE_RMA_FAULT="RANK:FAULT[,RANK:FAULT...]"`` (FAULT:
``signal_before_data`` or ``late_source_read``) gives rank RANK's stand-in communicator that
deliberate fault (``rma_standin.Faults``), so a test sees the check catch it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan_tide.comm.transports.windows import nccl_rma, rma_standin
from torchtitan_tide.config import Tide
from torchtitan_tide.preflight.layout import JobLayout
from torchtitan_tide.preflight.report import Row, ranks_text

FAULT_ENV = "TIDE_PREFLIGHT_FAKE_RMA_FAULT"
FAULT_DELAY_S = 0.02
ROUNDS = {"cuda": 96, "cpu": 24}
SIZES = {"cuda": (256, 64 * 1024, 4 * 1024 * 1024), "cpu": (256, 4096, 64 * 1024)}
MAX_WINDOW_BYTES = 768 * 2**20
EXTRA_SIGNAL_EVERY = 4
ROUND_LIMIT = 4096  # rounds a payload's tag can tell apart
_INDEX_BITS = 24  # element index bits of a payload value (slots <= 2**24 elements)
POISON_SOURCE = -0x5A5A5A5A  # the sender's slot right after its put
POISON_RECEIVE = -0x3C3C3C3C  # the receiver's slot before the put lands
OK, STALE, SOURCE_REUSED, CORRUPT = range(4)
FINDINGS = {
    STALE: (
        "signal after data",
        "the signal arrived before its data ({n} round(s), first round {first})",
    ),
    SOURCE_REUSED: (
        "source read before reuse",
        ("the peer received the source rewritten after the put ({n} round(s), first round "
         "{first})"),
    ),
    CORRUPT: ("data intact", "corrupted data ({n} round(s), first round {first})"),
}
FIX = (
    "NCCL's one-sided path breaks TIDE's protocol here: set [tide] cross_node_transport = "
    "'p2p' (send/recv) and report the NCCL version and network (JSON beside this table)"
)


def planted_fault(rank: int, environ: Mapping[str, str] = os.environ) -> str | None:
    """This rank's planted stand-in fault from :data:`FAULT_ENV` (tests only).

    Raises:
        ValueError: a malformed entry, naming the variable.
    """
    kinds = ("signal_before_data", "late_source_read")
    for entry in filter(None, (e.strip() for e in environ.get(FAULT_ENV, "").split(","))):
        who, _, kind = entry.partition(":")
        if not who.strip().isdigit() or kind not in kinds:
            raise ValueError(f"{FAULT_ENV}: {entry!r} is not RANK:FAULT with FAULT one of "
                             f"{list(kinds)} (a test hook)")  # fmt: skip
        if int(who) == rank:
            return kind
    return None


def _payload(pair_tag: int, round_index: int, numel: int, device: torch.device) -> torch.Tensor:
    tag = pair_tag * ROUND_LIMIT + round_index
    return torch.arange(numel, dtype=torch.int64, device=device).add_(tag << _INDEX_BITS)


def _classify(got: torch.Tensor, want: torch.Tensor, pair_tag: int, round_index: int):
    """The round's code (0-d int64 tensor on ``got``'s device; no host sync)."""
    wrong = (got != want).any()
    first = got[0]
    tag = first >> _INDEX_BITS
    same_pair = (first >= 0) & (tag // ROUND_LIMIT == pair_tag)
    sent_round = tag % ROUND_LIMIT
    reused = (first == POISON_SOURCE) | (same_pair & (sent_round > round_index))
    stale = (first == POISON_RECEIVE) | (same_pair & (sent_round < round_index))
    code = torch.where(reused, SOURCE_REUSED, torch.where(stale, STALE, CORRUPT))
    return torch.where(wrong, code, OK)


class _Slots:
    """Views of one rank's window: send slot per peer, two receive slots per peer."""

    def __init__(self, window: Any, peers: int, slot_bytes: int) -> None:
        self.window, self.peers, self.slot_bytes = window, peers, slot_bytes

    def send(self, peer: int, numel: int) -> torch.Tensor:
        return self.window.tensor.narrow(0, peer * self.slot_bytes, numel * 8).view(torch.int64)

    def receive_offset(self, sender: int, parity: int) -> int:
        return (self.peers + 2 * sender + parity) * self.slot_bytes

    def receive(self, sender: int, parity: int, numel: int) -> torch.Tensor:
        offset = self.receive_offset(sender, parity)
        return self.window.tensor.narrow(0, offset, numel * 8).view(torch.int64)

    def poison_receives(self) -> None:
        base = self.peers * self.slot_bytes
        self.window.tensor.narrow(0, base, 2 * self.peers * self.slot_bytes).view(
            torch.int64).fill_(POISON_RECEIVE)  # fmt: skip


def _rounds(comm: Any, slots: _Slots, me: int, size: int, rounds: int, sizes: tuple[int, ...],
            results: torch.Tensor, stream: Any) -> None:  # fmt: skip
    """Enqueue (GPU) or run (stand-in) every round of the pattern (module docstring)."""
    peers = [p for p in range(size) if p != me]
    for r in range(rounds):
        numel = sizes[r % len(sizes)] // 8
        extra = r % EXTRA_SIGNAL_EVERY == EXTRA_SIGNAL_EVERY - 1
        for p in peers:
            src = slots.send(p, numel)
            src.copy_(_payload(me * size + p, r, numel, src.device))
            comm.put_signal(src.view(torch.uint8), p, slots.window,
                            slots.receive_offset(me, r % 2), stream)  # fmt: skip
            if extra:
                comm.signal(p, stream)
            src.fill_(POISON_SOURCE)  # stream-ordered after the put: reuse is allowed now
        for p in peers:
            comm.wait_signal(p, 2 if extra else 1, stream)
            got = slots.receive(p, r % 2, numel)
            want = _payload(p * size + me, r, numel, got.device)
            results[r, p] = _classify(got, want, p * size + me, r)
            got.fill_(POISON_RECEIVE)


def _wait_event(event: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def run(layout: JobLayout, wait_s: float) -> dict[str, Any]:
    """This rank's part of the check (module docstring), as plain data. Collective over
    every rank (the same control exchanges on every rank, whatever its tier decided)."""
    control, rank, device = layout.control, layout.rank, layout.device
    tier = layout.tier_ranks()
    kind = "cuda" if device.type == "cuda" else "cpu"
    out: dict[str, Any] = {"tier": list(tier), "skip": None, "error": None, "host_rma": None,
                           "fault": None, "counts": {}, "rounds": ROUNDS[kind],
                           "stuck": False}  # fmt: skip
    reason = _why_not(layout, tier)
    fault = planted_fault(rank)
    if kind == "cuda":
        out["transport"] = f"NCCL {nccl_rma.version_text(nccl_rma.nccl_version())}"
        if fault:
            out["fault"] = f"{FAULT_ENV} ignored: faults are planted in the CPU stand-in only"
    else:
        out["transport"] = "CPU stand-in (rma_standin)"
        out["fault"] = fault
    first = reason is None and rank == min(tier)
    uid = None
    if first:
        try:
            uid = nccl_rma.new_unique_id() if kind == "cuda" else rma_standin.new_unique_id()
        except Exception as exc:  # noqa: BLE001 - a reason every rank of the tier learns
            reason = f"no unique id: {type(exc).__name__}: {exc}"
    posted = control.gather((reason, uid), "one_sided ids")
    reasons: dict[str, list[int]] = {}
    for r in tier:
        if posted[r][0]:
            reasons.setdefault(posted[r][0], []).append(r)
    out["skip"] = "; ".join(f"{why} ({ranks_text(rs)})" for why, rs in reasons.items()) or None
    uid = posted[min(tier)][1]
    comm = None

    def step(fn) -> str | None:
        """``fn()`` on the tier's ranks where it still goes on, then every rank's outcome
        (a control exchange on every rank); the tier's first error, or None."""
        error = None
        if out["skip"] is None and out["error"] is None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - an outcome every rank learns
                error = f"{type(exc).__name__}: {exc}"
        errors = control.gather(error, f"one_sided {fn.__name__}")
        return "; ".join(f"rank {r}: {errors[r]}" for r in tier if errors[r]) or None

    made: dict[str, Any] = {}

    def create() -> None:
        if kind == "cuda":
            made["comm"] = nccl_rma.RmaComm.create(uid, tier.index(rank), len(tier), device)
        else:
            faults = rma_standin.Faults(**{fault: True}, delay_s=FAULT_DELAY_S) if fault else None
            made["comm"] = rma_standin.StandinRma.create(uid, tier.index(rank), len(tier),
                                                         faults=faults)  # fmt: skip
            made["comm"].timeout_s = wait_s

    error = step(create)  # every step runs its control exchange on every rank: no `or`
    out["skip"] = out["skip"] or error
    comm = made.get("comm")

    def host_rma() -> None:
        out["host_rma"] = comm.host_rma_supported()

    error = step(host_rma)
    out["skip"] = out["skip"] or error
    support = control.gather(out["host_rma"], "one_sided host RMA")
    lacking = [r for r in tier if support[r] is False]
    if out["skip"] is None and lacking:
        out["skip"] = (f"NCCL {nccl_rma.version_text(nccl_rma.nccl_version())} reports no host "
                       f"RMA between these nodes ({ranks_text(lacking)})")  # fmt: skip
    sizes = SIZES[kind]
    slot_bytes = min(max(sizes), MAX_WINDOW_BYTES // (3 * len(tier)) // 8 * 8)
    sizes = tuple(min(s, slot_bytes) for s in sizes)

    def register() -> None:
        made["slots"] = _Slots(comm.register(3 * len(tier) * slot_bytes), len(tier), slot_bytes)
        made["slots"].poison_receives()
        if kind == "cuda":
            torch.cuda.synchronize(device)

    error = step(register)
    out["skip"] = out["skip"] or error
    control.barrier()  # every receive slot is poisoned before any put
    me = tier.index(rank)
    started = time.monotonic()

    def stress() -> None:
        results = torch.full((ROUNDS[kind], len(tier)), OK, dtype=torch.int64, device=device)
        if kind == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # `results` filled first
            with torch.cuda.stream(stream):
                _rounds(comm, made["slots"], me, len(tier), ROUNDS[kind], sizes, results, stream)
                done = stream.record_event()
            if not _wait_event(done, wait_s):
                out["stuck"] = True  # a stream still waits: no later check syncs the device
                raise TimeoutError(f"the {ROUNDS[kind]} rounds with the tier's peers did not "
                                   f"complete within {wait_s:.0f} s (a put or signal never "
                                   "arrived)")  # fmt: skip
        else:
            _rounds(comm, made["slots"], me, len(tier), ROUNDS[kind], sizes, results, None)
        made["results"] = results.cpu()

    out["error"] = step(stress)
    out["elapsed_s"] = round(time.monotonic() - started, 3)
    out["sizes"] = list(sizes)
    if "results" in made:
        for p, sender in enumerate(tier):
            if p == me:
                continue
            column = made["results"][:, p]
            for code in (STALE, SOURCE_REUSED, CORRUPT):
                hits = (column == code).nonzero().flatten().tolist()
                if hits:
                    out["counts"].setdefault(sender, {})[code] = (len(hits), hits[0])
    if comm is not None:  # finalize only a communicator every rank of the tier used fully
        with contextlib.suppress(Exception):
            comm.abort() if (out["error"] or out["skip"]) else comm.destroy()
    control.barrier()
    if first and kind == "cpu" and uid is not None:
        shutil.rmtree(uid.rstrip(b"\0").decode(), ignore_errors=True)  # the stand-in's files
    return out


def _why_not(layout: JobLayout, tier: tuple[int, ...]) -> str | None:
    """Why this rank cannot take part (before any collective), or None."""
    if layout.tide is None:
        return f"no TIDE layout ({layout.tide_source})"
    if len(tier) == 1:
        return (f"one node ({layout.tide.shape}): no cross-node tier; the one-sided path only "
                "carries cross-node traffic")  # fmt: skip
    if layout.device.type == "cuda":
        return nccl_rma.one_sided_missing_reason()
    machines = {layout.infos[r].boot_id or layout.infos[r].host for r in tier}
    if len(machines) > 1:
        return ("the CPU stand-in maps shared memory, and this tier spans machines (the "
                "one-sided path itself runs on GPUs only)")  # fmt: skip
    return None


def rows(gathered: list[dict[str, Any]], tide: Tide) -> list[Row]:
    """Rank 0's rows from every rank's :func:`run`."""
    asked = tide.cross_node_transport == "nccl_one_sided"
    first = gathered[0]
    out = []
    faults = sorted({g["fault"] for g in gathered if g.get("fault") and "ignored" in g["fault"]})
    for note in faults:
        out.append(Row("one_sided", "fault hook", "warn", note))
    skipped = {r: g["skip"] for r, g in enumerate(gathered) if g["skip"]}
    if len(skipped) == len(gathered):
        reason = next(iter(skipped.values()))
        if asked:
            return out + [Row("one_sided", "cross-node puts", "FAIL",
                              f"unavailable: {reason}", sorted(skipped),
                              "[tide] cross_node_transport = 'nccl_one_sided' needs it; use "
                              "'auto' (send/recv where it cannot run) or fix what the reason "
                              "names (docs/guide/transports-and-layouts.md)")]  # fmt: skip
        return out + [Row("one_sided", "cross-node puts", "skip",
                          f"unavailable (TIDE's 'auto' takes send/recv): {reason}")]
    ran = [g for g in gathered if not g["skip"]]
    tiers = {tuple(g["tier"]) for g in ran}
    pairs = sum(len(t) * (len(t) - 1) // 2 for t in tiers)
    sizes = ran[0].get("sizes", [])
    rma = {g["host_rma"] for g in ran}
    out.append(Row("one_sided", "transport", "info",
                   f"{first['transport']}: put_signal / signal / wait_signal; {len(tiers)} "
                   f"tier(s), {pairs} pair(s) x {ran[0]['rounds']} rounds x sizes "
                   f"{_bytes(min(sizes)) if sizes else '?'}-{_bytes(max(sizes)) if sizes else '?'}"
                   f"{'; host RMA ' + _yes(rma) if 'NCCL' in first['transport'] else ''}; "
                   f"{max(g.get('elapsed_s', 0) for g in ran):.2f} s"))  # fmt: skip
    if skipped:
        out.append(Row("one_sided", "cross-node puts", "FAIL" if asked else "warn",
                       f"not run on {ranks_text(sorted(skipped))}: "
                       f"{next(iter(skipped.values()))}", sorted(skipped)))  # fmt: skip
    errors = {r: g["error"] for r, g in enumerate(gathered) if g["error"]}
    if errors:
        out.append(Row("one_sided", "signals arrive", "FAIL",
                       f"{ranks_text(sorted(errors))}: {next(iter(errors.values()))}",
                       sorted(errors), FIX))  # fmt: skip
    for code, (what, text) in FINDINGS.items():
        hits = [(receiver, sender, counts[code])
                for receiver, g in enumerate(gathered)
                for sender, counts in g["counts"].items() if code in counts]  # fmt: skip
        if not hits:
            if not errors:
                out.append(Row("one_sided", what, "ok",
                               "verified on the receiver in every round of every pair"))
            continue
        receiver, sender, (n, first_round) = hits[0]
        involved = sorted({s for _, s, _ in hits})
        out.append(Row("one_sided", what, "FAIL",
                       f"rank {receiver} from rank {sender}: {text.format(n=n, first=first_round)}"
                       f"; {len(hits)} pair direction(s) affected (senders "
                       f"{ranks_text(involved)})", involved, FIX))  # fmt: skip
    return out


def _yes(values: set) -> str:
    return "yes" if values == {True} else ", ".join(map(str, sorted(values, key=str)))


def _bytes(n: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"
