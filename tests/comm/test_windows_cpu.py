"""TIDE on NCCL windows (``transports/windows/transport.py``, phase 2 over
``transports/windows/ring.py``), end to end under FSDP2 on CPU: the real transports run their
real ops against the CPU stand-in of NCCL's one-sided calls (``TIDE_RMA_STANDIN=1``,
``transports/windows/rma_standin.py``), gloo ranks laid out N nodes x L. Checked against
stock FSDP2: losses and parameters after every step (``_harness.run_parity``: TIDE-AG outputs
NaN-poisoned before every all-gather, TIDE-RS outputs and window halves poisoned after their
last read), the window transport and the phase-2 ring asserted to have moved the bytes. Also
the set-up's failure path: a window allocation that fails on one rank makes every rank keep
send/recv under ``auto`` at once, naming the rank, and is a named error under the explicit
option.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch.distributed as dist
from _harness import LogRecords, Scenario, build, run_parity, spawn

SCENARIOS = [
    Scenario(bf16=True, prefetch=True, grad_accum=2, steps=2),
    Scenario(reshard_after_forward=False, bf16=False, steps=2),
]


def _check_windows(expect_ring: bool):
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch
    from torchtitan_tide.comm.transports.windows.transport import WindowTransport

    seen = {}

    def post_apply(model):
        groups = [g for _, g in fsdp_patch.fsdp_param_groups(model)]
        transports = {id(g._tide_ag_state.transport): g._tide_ag_state.transport for g in groups}
        assert all(isinstance(t, WindowTransport) for t in transports.values()), transports
        for g in groups:
            rs = g._tide_rs_state
            assert rs.transport is g._tide_ag_state.transport, "TIDE-RS rows not in the window"
            assert (rs.cross_node is not None and rs.cross_node.name == "nccl_one_sided") == (
                expect_ring
            ), rs.cross_node
        seen["transports"] = list(transports.values())
        seen["rings"] = {id(g._tide_rs_state.cross_node): g._tide_rs_state.cross_node
                         for g in groups if g._tide_rs_state.cross_node is not None}  # fmt: skip

    return post_apply, seen


def _parity_worker(rank: int, world: int, lws: int, tolerance: float, extra: dict,
                   expect_full: bool = False, swap: str = "native") -> None:  # fmt: skip
    from torchtitan_tide.comm.transports.windows import storage_swap

    os.environ["TIDE_RMA_STANDIN"] = "1"
    if swap == "ctypes":  # as on torch 2.11, which lacks UntypedStorage._swap_data_ptr_
        storage_swap._native_available = lambda: False
        extra = {**extra, "ag_storage_swap": "ctypes"}
    records = LogRecords()
    logging.getLogger("torchtitan_tide").addHandler(records)
    logging.getLogger("torchtitan_tide").setLevel(logging.INFO)
    nodes = world // lws
    post_apply, seen = _check_windows(expect_ring=nodes > 1)

    def checked(model):
        post_apply(model)
        seen.setdefault("models", []).append(model)

    run_parity(rank, world, SCENARIOS, {"local_world_size": lws, **extra}, post_apply=checked,
               tolerance=tolerance)  # fmt: skip
    counters = [t.counters for t in seen["transports"]]
    assert sum(c.all_gathers for c in counters) > 0
    in_place = sum(c.in_place_all_gathers for c in counters)
    placed = sum(c.placed_copies for c in counters)
    if world > 1:
        assert sum(c.puts for c in counters) > 0
    from torchtitan_tide.comm import TideOptions

    groups_in_place = extra.get("ag_in_place_groups", TideOptions().ag_in_place_groups)
    if nodes > 1 and groups_in_place > 0:
        # across nodes (any ranks per node): straight into parameter storage on the arena;
        # placement only for the all-gathers that found the arena full
        assert in_place > 0, "no all-gather went in place"
        assert sum(c.credits for c in counters) > 0, "no arena range was released"
        full = sum(c.arena_full for c in counters)
        assert (placed > 0) == (full > 0), (placed, full)
        if expect_full:
            assert full > 0, "the arena never ran full"
        if rank == 0:
            assert records.grep(f"storage swap: {'ctypes' if swap == 'ctypes' else 'Untyped'}"), (
                records.messages[:20]
            )
    elif world > 1:
        assert in_place == 0 and placed > 0, (in_place, placed)
    if lws > 1:
        assert sum(c.rs_rounds for c in counters) > 0 and sum(c.waits for c in counters) > 0
    if nodes > 1:
        assert sum(r.counters.puts for r in seen["rings"].values()) > 0, "phase 2 never put"
        assert sum(r.counters.credits for r in seen["rings"].values()) > 0
    if rank == 0:
        assert records.grep("transport=windows"), records.messages[:20]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,lws,extra",
    [(4, 2, {}), (4, 1, {}), (2, 2, {}), (6, 2, {}),
     (4, 2, {"rs_rows": 1, "pacing": 1, "rs_inflight": 1, "rs_wire_dtype": "bfloat16"}),
     (3, 1, {"ag_in_place_groups": 1}), (4, 1, {"ag_in_place_groups": 0}), (2, 1, {}),
     (3, 1, {"swap": "ctypes"}), (4, 2, {"ag_in_place_groups": 1}),
     (4, 2, {"ag_in_place_groups": 0}), (8, 4, {"pacing": 2})],
    ids=["2x2-in-place", "4x1-in-place", "1x2", "3x2-in-place", "2x2-rows1-paced-ring1-bf16wire",
         "3x1-arena1", "4x1-placement", "2x1-in-place", "3x1-in-place-ctypes-swap",
         "2x2-arena1", "2x2-placement", "2x4-in-place-paced"],
)  # fmt: skip
def test_windows_parity_with_fsdp2(world, lws, extra):
    # two ranks add in one order only; more reduce in another order than gloo; a bf16 wire
    # rounds each node's partial once (docs/design/2026-12-02-rs-wire.md)
    tolerance = 0.0 if world == 2 else 1e-2 if extra.get("rs_wire_dtype") else 1e-5
    # an arena of one group's size runs full whenever two groups are unsharded at once
    # (prefetch, reshard_after_forward=False): those all-gathers take the placement path
    expect_full = extra.get("ag_in_place_groups") == 1
    options = {k: v for k, v in extra.items() if k != "swap"}
    spawn(_parity_worker, world, lws, tolerance, options, expect_full, extra.get("swap", "native"))


# (step of window_setup.FAIL_ON, the group rank it fails on, text the fallback reason names)
PLANTED = [
    ("unique id:slots", 0, "unique id:slots"),
    ("communicator:slots", 1, "communicator:slots"),
    ("window allocation", 1, "allocation"),
    ("window registration", 1, "registration"),
    ("unique id:ag_credit", 0, "credit communicator"),
    ("communicator:ag_credit", 1, "credit communicator"),
    ("communicator:data", 1, "data communicator"),
    ("communicator:credit", 1, "credit communicator"),
    ("ring allocation", 1, "phase-2 window allocation"),
    ("ring registration", 1, "phase-2 window registration"),
]


def _planted_failure(rank: int, world: int) -> None:
    """Every set-up step in turn fails on one rank: every rank falls back (``auto``) or
    raises (the explicit option) within seconds, the reason naming the rank and the step,
    and nothing this process made is left: communicators ended, window memory freed, ids
    given up (the stand-in's folders gone)."""
    import torch

    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch
    from torchtitan_tide.comm.fsdp.install import TideConfigError
    from torchtitan_tide.comm.transports.windows import connect as window_setup
    from torchtitan_tide.comm.transports.windows import rma_standin

    os.environ["TIDE_RMA_STANDIN"] = "1"
    records = LogRecords()
    logging.getLogger("torchtitan_tide").addHandler(records)
    logging.getLogger("torchtitan_tide").setLevel(logging.INFO)
    ledger = rma_standin.LEDGER
    made: list[str] = []  # the stand-in's folders (its ids) this process made, in /dev/shm
    new_unique_id = rma_standin.new_unique_id

    def recorded_id() -> bytes:
        unique_id = new_unique_id()
        made.append(unique_id.rstrip(b"\0").decode())
        return unique_id

    rma_standin.new_unique_id = recorded_id
    for step, bad_rank, named in PLANTED:
        window_setup.FAIL_ON.clear()
        window_setup.FAIL_ON[step] = {bad_rank}
        records.messages.clear()
        try:
            started = time.monotonic()
            model = build(Scenario(), torch.device("cpu"))
            comm.apply(model, "tide", local_world_size=1, install_timeout_s=60)
            took = time.monotonic() - started
            assert took < 20, f"{step}: the fallback took {took:.0f} s (a peer waited it out)"
            groups = [g for _, g in fsdp_patch.fsdp_param_groups(model)]
            assert all(g._tide_ag_state.transport.name == "gloo" for g in groups), step
            assert all(g._tide_rs_state.cross_node.name == "p2p" for g in groups), step
            comm.remove(model)
            if rank == 0:
                lines = [m for m in records.messages if f"group rank {bad_rank}" in m]
                assert any(named in m for m in lines), (step, records.messages[:12])
            model = build(Scenario(), torch.device("cpu"))
            started = time.monotonic()
            with pytest.raises(TideConfigError, match="nccl_one_sided' cannot run"):
                comm.apply(model, "tide", local_world_size=1,
                           cross_node_transport="nccl_one_sided", install_timeout_s=60)  # fmt: skip
            assert time.monotonic() - started < 20, step
            assert fsdp_patch.installed_refcount() == 0
        finally:
            window_setup.FAIL_ON.clear()
        dist.barrier()
        assert ledger["comms"] == ledger["comms_ended"], (step, dict(ledger))
        assert ledger["allocations"] == ledger["frees"], (step, dict(ledger))
        assert ledger["ids"] == ledger["ids_removed"], (step, dict(ledger))
        assert not [f for f in made if os.path.exists(f)], f"{step}: ids left behind"
        dist.barrier()
    assert made or rank != 0, "no id was made: the set-up never ran"
    assert not [f for f in made if os.path.exists(f)], "ids left behind"


@pytest.mark.slow
def test_a_failed_set_up_step_on_one_rank_falls_back_at_once_and_leaks_nothing():
    spawn(_planted_failure, 2)


def _in_place_disagreement(rank: int, world: int) -> None:
    """One rank's storage swap does not check out (its trial fails): the group agrees to
    place on every rank (windows sized alike), the log names the rank; training matches."""
    from torchtitan_tide.comm.transports.windows import storage_swap

    os.environ["TIDE_RMA_STANDIN"] = "1"
    if rank == 1:
        storage_swap.swap_backend = lambda *args, **kwargs: (None, "the trial swap failed (test)")
    records = LogRecords()
    logging.getLogger("torchtitan_tide").addHandler(records)
    logging.getLogger("torchtitan_tide").setLevel(logging.INFO)
    post_apply, seen = _check_windows(expect_ring=True)
    started = time.monotonic()
    run_parity(rank, world, SCENARIOS[:1], {"local_world_size": 1}, post_apply=post_apply)
    assert time.monotonic() - started < 60
    counters = [t.counters for t in seen["transports"]]
    assert sum(c.in_place_all_gathers for c in counters) == 0
    assert sum(c.placed_copies for c in counters) > 0
    if rank == 0:
        lines = records.grep("TIDE-AG placement copies: group rank 1: the trial swap failed")
        assert lines, records.messages[:12]


@pytest.mark.slow
def test_ranks_that_disagree_on_in_place_all_place():
    spawn(_in_place_disagreement, 2)


def _compiled_in_place(rank: int, world: int) -> None:
    from dataclasses import replace

    from _layouts import Layout, run_layout

    os.environ["TIDE_RMA_STANDIN"] = "1"
    base = Layout(local_world_sizes=(1,), expect_transport="WindowTransport", steps=2)
    for layout in (replace(base, compile=True), replace(base, ac="full"),
                   replace(base, model="qwen3_moe", num_experts=4)):  # fmt: skip
        rec = run_layout(rank, world, layout)
        counters = [t.counters for t in rec.transports.values()]
        assert sum(c.in_place_all_gathers for c in counters) > 0, layout
        assert sum(c.credits for c in counters) > 0, layout


@pytest.mark.slow
def test_in_place_under_compile_ac_and_moe():
    """One rank per node on the windows (2 x 1): TorchTitan's per-block ``torch.compile``,
    full activation checkpointing (forward re-run in backward: the group is all-gathered
    again into a new arena range) and the Qwen3 MoE model, all-gathers in place, against
    stock FSDP2 (``_layouts.run_layout``: gradients after every backward, unsharded
    parameters after every all-gather, losses)."""
    spawn(_compiled_in_place, 2)


def _interrupted_and_detached(rank: int, world: int) -> None:
    """An exception between the in-place bind and the rounds (the own-shard write raises on
    every rank): the pending plan is dropped and its range given back, so the arena is empty
    again; then a forward with reshard_after_forward=False leaves groups bound in the arena,
    and ``comm.remove`` gives every such parameter its bytes in its own storage (checked
    against the full parameter, all-gathered here)."""
    import torch

    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import all_gather as tide_ag
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch

    os.environ["TIDE_RMA_STANDIN"] = "1"
    model = build(Scenario(reshard_after_forward=False), torch.device("cpu"))
    comm.apply(model, "tide", local_world_size=1)
    transports = {id(g._tide_ag_state.transport): g._tide_ag_state.transport
                  for _, g in fsdp_patch.fsdp_param_groups(model)}.values()  # fmt: skip
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(rank))

    def fail(outputs):
        raise RuntimeError("planted: the own-shard write failed")

    tide_ag.set_debug_hooks(before=fail)
    try:
        with pytest.raises(RuntimeError, match="planted"):
            model(tokens)
    finally:
        tide_ag.set_debug_hooks()
    assert all(t._pending is None for t in transports)
    assert all(t.arena_in_use == 0 for t in transports), [t.arena_in_use for t in transports]
    comm.remove(model)
    dist.barrier()

    # The storage swap raising inside the bind, after the range was taken: a refusal
    # (RuntimeError) places the all-gather, anything else propagates; the range comes back.
    from torchtitan_tide.comm.transports.windows import transport as window_transport

    swap = window_transport.swap_storage_pairs
    for planted, expect_raise in ((ValueError, True), (RuntimeError, False)):
        model = build(Scenario(reshard_after_forward=False), torch.device("cpu"))
        comm.apply(model, "tide", local_world_size=1)
        transports = {id(g._tide_ag_state.transport): g._tide_ag_state.transport
                      for _, g in fsdp_patch.fsdp_param_groups(model)}.values()  # fmt: skip
        calls = []

        def refuse(pairs, planted=planted, calls=calls):
            calls.append(len(pairs))
            raise planted("planted: the swap refused")

        window_transport.swap_storage_pairs = refuse
        try:
            if expect_raise:
                with pytest.raises(ValueError, match="planted"):
                    model(tokens)
            else:
                with torch.no_grad():
                    model(tokens)  # every group placed, nothing bound
        finally:
            window_transport.swap_storage_pairs = swap
        assert calls, "the in-place bind never reached the swap"
        assert all(t._pending is None and not t._bindings for t in transports)
        assert all(t.arena_in_use == 0 for t in transports), [t.arena_in_use for t in transports]
        comm.remove(model)
        dist.barrier()

    model = build(Scenario(reshard_after_forward=False), torch.device("cpu"))
    comm.apply(model, "tide", local_world_size=1)
    transports = list({id(g._tide_ag_state.transport): g._tide_ag_state.transport
                       for _, g in fsdp_patch.fsdp_param_groups(model)}.values())  # fmt: skip
    with torch.no_grad():
        model(tokens)  # every group stays unsharded: bound in the arena
    bound = [fp for _, g in fsdp_patch.fsdp_param_groups(model) for fp in g.fsdp_params
             if any(id(fp) in t._bindings for t in transports)]  # fmt: skip
    assert bound, "no parameter was bound in the arena"
    window = transports[0].slots.window.tensor
    expected = []
    for fp in bound:
        full = [torch.empty_like(fp._sharded_param_data) for _ in range(world)]
        dist.all_gather(full, fp._sharded_param_data.contiguous())
        expected.append(torch.cat(full))
    comm.remove(model)
    start, end = window.data_ptr(), window.data_ptr() + window.numel()
    for fp, want in zip(bound, expected):
        got = fp.all_gather_outputs[0]
        assert not start <= got.data_ptr() < end, "a parameter still points into the window"
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0)
    assert fsdp_patch.installed_refcount() == 0


@pytest.mark.slow
def test_an_interrupted_all_gather_and_a_remove_while_bound_lose_nothing():
    spawn(_interrupted_and_detached, 2)
