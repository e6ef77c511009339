"""TIDE's schedule as data: which phase of TIDE-AG and TIDE-RS runs on which engine and
stream, in what order, and which phases overlap.

Pure Python (no torch). The one description of the schedule the code runs: the step
simulator (``torchtitan_tide/simulator/step.py``) models whatever :data:`CURRENT` says,
and the implementation's docstrings (``all_gather.py``, ``reduce_scatter.py``,
``transport/``) describe the same phases. Change the code's schedule and this module
together (docs/design/2026-12-04-simulator.md).

Engines (what does the work; the simulator charges each as measured for it):

- ``sm``: kernels on the SMs (the fp32 -> bf16 cast of the own shard, TIDE-RS's fp32
  accumulate kernel).
- ``copy_engine``: copies with no SM (``cudaMemcpyBatchAsync`` through symmetric memory
  or NCCL windows, NCCL puts between ranks of one node).
- ``transport``: the cross-node move, by ``[tide] cross_node_transport``: NCCL send/recv
  kernels (``p2p``, SMs) or NCCL one-sided puts (``nccl_one_sided``: NCCL's RMA proxy
  over IB/RoCE, no SM).

Two schedules:

- :data:`SERIAL` (the code before 2026-12-04): TIDE-AG packs (casts) the own shard, runs
  every cross-node step, then the node-local phase, then (one-sided, one rank per node)
  copies every entry from the window into the parameters' storage: one after the other
  on TIDE's stream.
- :data:`PIPELINED` (the code since 2026-12-04, ``transport/windows.py`` running
  ``window_rounds.ag_round_ops``; docs/design/2026-12-04-windows.md): TIDE-AG's cross-node
  recursive doubling by one-sided puts between rail peers in waves of at most ``[tide]
  ag_pacing`` entries (0: one wave per step); after each wave's arrival its entries are
  fanned out to the L-1 local peers by copy-engine puts (the puts' stream) and placed
  into the parameters' storage (one batched copy per wave, the placement stream) while
  the next wave's puts fly. TIDE-RS phase 1 adds a batched copy-engine pack of the
  gradient slices into the window before its puts. Where the windows cannot run
  (``auto``'s fallback) the transports of the serial schedule remain.

Both run TIDE-RS phase 2 (cross-node partials) on its own stream, pipelined with phase 1
across FSDP groups (at most ``[tide] rs_inflight`` partials in flight), and phase 1 on
TIDE's all-gather stream when the slots are shared (``[tide] slot_reuse``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COPY_ENGINE",
    "CURRENT",
    "ENGINES",
    "PIPELINED",
    "SCHEDULES",
    "SERIAL",
    "SM",
    "TRANSPORT",
    "Phase",
    "TideSchedule",
    "schedule_named",
]

SM, COPY_ENGINE, TRANSPORT = "sm", "copy_engine", "transport"
ENGINES = (SM, COPY_ENGINE, TRANSPORT)

# TIDE's streams (``comm/streams.py``): the all-gather stream (also TIDE-RS phase 1 under
# slot reuse), the one-sided puts' stream, TIDE-RS phase 2's stream.
AG_STREAM, PUT_STREAM, RS_CROSS_STREAM = "tide", "tide_one_sided", "tide_rs_cross"
PLACE_STREAM = "tide_place"  # the windows' placement copies (``transport/windows.py``)


@dataclass(frozen=True)
class Phase:
    """One phase of a collective: ``name``, the ``engine`` that moves or computes it, the
    TIDE ``stream`` it is issued on, and what it moves (``what``)."""

    name: str
    engine: str
    stream: str
    what: str

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"phase {self.name!r}: engine {self.engine!r} not in {ENGINES}")


@dataclass(frozen=True)
class TideSchedule:
    """TIDE-AG's and TIDE-RS's phases in issue order, and how they overlap.

    ``ag_waves_pipelined``: False: TIDE-AG's phases run one after the other (each
    waits for the whole previous one); True: the cross-node phase goes in waves and each
    wave's node-local fan-out and placement overlap the next wave's puts.
    ``ag_place_after_one_sided``: the entries received in the window are copied into
    the parameters' storage (a ``place`` phase) when the cross-node transport is
    one-sided. ``ag_one_sided_any_layout``: TIDE-AG goes one-sided for every layout N x
    L (False: only with one rank per node; several ranks per node keep send/recv).
    ``rs_pack``: TIDE-RS phase 1 first packs the gradient slices into the
    window (a copy-engine copy of the slices sent to local peers)."""

    name: str
    ag: tuple[Phase, ...]
    rs_local: tuple[Phase, ...]
    rs_cross: tuple[Phase, ...]
    ag_waves_pipelined: bool
    ag_place_after_one_sided: bool
    ag_one_sided_any_layout: bool
    rs_pack: bool


_CAST = Phase("pack", SM, AG_STREAM, "fp32 -> bf16 cast of the own shard (FSDP2's foreach)")
_RS_LOCAL = (
    Phase("push", COPY_ENGINE, AG_STREAM, "bf16 gradient slices to the L-1 local peers"),
    Phase("accumulate", SM, AG_STREAM, "the L rows summed into the fp32 partial"),
)
_RS_CROSS = (
    Phase("partials", TRANSPORT, RS_CROSS_STREAM, "fp32 (or bf16) partials, N-1 peers"),
    Phase("accumulate", SM, RS_CROSS_STREAM, "received partials added into the output"),
)

SERIAL = TideSchedule(
    name="serial",
    ag=(
        _CAST,
        Phase("cross_node", TRANSPORT, AG_STREAM, "recursive doubling between rail peers"),
        Phase("node_local", COPY_ENGINE, AG_STREAM, "the N node shards to the L-1 peers"),
        Phase("place", COPY_ENGINE, AG_STREAM, "window entries into the parameters"),
    ),
    rs_local=_RS_LOCAL,
    rs_cross=_RS_CROSS,
    ag_waves_pipelined=False,
    ag_place_after_one_sided=True,
    ag_one_sided_any_layout=False,
    rs_pack=False,
)

PIPELINED = TideSchedule(
    name="pipelined",
    ag=(
        _CAST,
        Phase("cross_node", TRANSPORT, PUT_STREAM, "waves of <= ag_pacing entries, puts"),
        Phase("node_local", COPY_ENGINE, PUT_STREAM, "each arrived wave to the L-1 peers"),
        Phase("place", COPY_ENGINE, PLACE_STREAM, "each wave's entries into the parameters"),
    ),
    rs_local=(
        Phase("pack", COPY_ENGINE, AG_STREAM, "gradient slices into the window, batched"),
        Phase("push", COPY_ENGINE, PUT_STREAM, "one put per local peer's row"),
        _RS_LOCAL[1],
    ),
    rs_cross=_RS_CROSS,
    ag_waves_pipelined=True,
    ag_place_after_one_sided=True,
    ag_one_sided_any_layout=True,
    rs_pack=True,
)

SCHEDULES = {s.name: s for s in (SERIAL, PIPELINED)}

CURRENT = PIPELINED
"""The schedule the code runs. Issue 34 (TIDE-AG one-sided and pipelined) sets this to
:data:`PIPELINED` when it lands; the simulator then models it with no other change."""


def schedule_named(name: str | None) -> TideSchedule:
    """The schedule ``name`` (None: :data:`CURRENT`); a named error for an unknown one."""
    if name is None:
        return CURRENT
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"TIDE schedule {name!r}: choose from {sorted(SCHEDULES)}") from None
