"""``comm.apply(mode='tide')`` on CPU/gloo: atomic install, no-op cases, custom comms,
rebinding by someone else, backends without point-to-point, replicate-only meshes,
dispatch modes.

One spawn of 2 ranks runs every case in order (process start-up dominates on 2 cores).
Each case asserts what the user sees: the error on EVERY rank (naming the failing rank),
nothing left installed, the log line, or that TIDE really ran (``TideRSState.calls``)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from _harness import LogRecords as _Records
from _harness import spawn
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode


def _model(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no AVG/PREMUL_SUM
    return model


def _step(model: nn.Module) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()


def _rs_calls(model: nn.Module) -> int:
    from torchtitan_tide.comm.fsdp.internals import fsdp_param_groups

    return sum(g._tide_rs_state.calls for _, g in fsdp_param_groups(model)
               if hasattr(g, "_tide_rs_state"))  # fmt: skip


class _NoTensorOps(TorchDispatchMode):
    """A mode that fails any tensor op run under it (as a tracing mode would)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise RuntimeError(f"tensor op {func} under the test dispatch mode")


def _cases(rank: int, world: int) -> None:
    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import install
    from torchtitan_tide.comm.fsdp import internals as fsdp_internals
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch
    from torchtitan_tide.comm.fsdp.install import TideInstallError
    from torchtitan_tide.comm.plans import topology

    records = _Records()
    logging.getLogger("torchtitan_tide.comm").addHandler(records)  # every comm module
    logging.getLogger("torchtitan_tide.comm").setLevel(logging.INFO)

    # 1. A failure in planning on rank 1 only: every rank raises, naming rank 1.
    model = _model()
    real_choose = topology.choose_transport

    def choose_fails(*args, **kwargs):
        raise RuntimeError("injected planning failure")

    if rank == 1:
        topology.choose_transport = choose_fails
    try:
        with pytest.raises(TideInstallError, match="rank 1: RuntimeError: injected planning"):
            comm.apply(model, "tide")
    finally:
        topology.choose_transport = real_choose
    assert fsdp_patch.installed_refcount() == 0 and not hasattr(model, "_tide_comm_mode")

    # 2. A failure in the local allocation on rank 1, then in the collective set-up on
    # rank 0 only: every rank raises naming the phase and the rank, and nothing stays
    # marked (the groups take FSDP2's path; a retry works).
    for phase, failing_rank, name in (("allocation", 1, "allocate_slots"),
                                      ("set-up", 0, "connect_slots")):  # fmt: skip
        real = getattr(install, name)

        def fails(*args, _phase=phase, **kwargs):
            raise RuntimeError(f"injected {_phase} failure")

        if rank == failing_rank:
            setattr(install, name, fails)
        try:
            with pytest.raises(
                TideInstallError, match=f"{phase} on rank {failing_rank}: RuntimeError: injected"
            ):
                comm.apply(model, "tide")
        finally:
            setattr(install, name, real)
    assert fsdp_patch.installed_refcount() == 0
    assert not any(hasattr(g, "_tide_ag_state") for _, g in fsdp_internals.fsdp_param_groups(model))
    comm.apply(model, "tide")
    _step(model)
    assert _rs_calls(model) == 2  # the two layers (the root manages no parameter)
    comm.remove(model)

    # 3. Nothing to install runs no collective: a sharded model without parameters.
    real_gather = dist.all_gather_object

    def no_collective(*args, **kwargs):
        raise AssertionError("comm.apply ran a collective although it installs nothing")

    dist.all_gather_object = no_collective
    try:
        empty = nn.Sequential(nn.ReLU())
        fully_shard(empty)
        comm.apply(empty, "tide")
        assert records.grep("manage no parameters; nothing to install")
        comm.remove(empty)
        # A group set up with a custom all-gather takes FSDP2's path, said in the log;
        # then nothing is left for TIDE, so still no collective.
        custom = _model(layers=1)
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

        class UserAllGather(DefaultAllGather):
            pass

        for m in custom.modules():
            if hasattr(m, "set_custom_all_gather"):
                m.set_custom_all_gather(UserAllGather())
        comm.apply(custom, "tide")
        if rank == 0:  # other ranks say it at debug level
            assert records.grep("FSDP2 path (all-gather comm UserAllGather set on this group)")
        assert fsdp_patch.installed_refcount() == 0
        comm.remove(custom)
    finally:
        dist.all_gather_object = real_gather

    # 4. apply inside a dispatch mode: its own collectives run outside the mode.
    model = _model()
    with _NoTensorOps():
        comm.apply(model, "tide")
    _step(model)
    assert _rs_calls(model) == 2

    # 5. A custom reduce-scatter set after apply wins, said once.
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class UserReduceScatter(DefaultReduceScatter):
        pass

    model[0].set_custom_reduce_scatter(UserReduceScatter())
    calls = _rs_calls(model)
    _step(model)
    _step(model)
    assert _rs_calls(model) == calls + 2  # layer 1 only
    assert len(records.grep("set after comm.apply")) == 1

    # 6. Someone rebinds FSDP2's all-gather after TIDE: the next forward says so, once.
    real_ag = fsdp_internals.get_patched("foreach_all_gather")
    original = fsdp_patch._originals["foreach_all_gather"]
    fsdp_internals.set_patched("foreach_all_gather", lambda *a, **k: original(*a, **k))
    try:
        _step(model)
        _step(model)
    finally:
        fsdp_internals.set_patched("foreach_all_gather", real_ag)
    assert len(records.grep("FSDP2's foreach_all_gather was rebound after")) == 1
    comm.remove(model)
    assert fsdp_patch.installed_refcount() == 0

    # 7. A backend without point-to-point (as torch's threaded test backend): auto takes
    # FSDP2's path for the group, logged, instead of failing in isend later.
    real_backend = dist.get_backend
    dist.get_backend = lambda group=None: "threaded"
    try:
        model = _model()
        comm.apply(model, "tide")
    finally:
        dist.get_backend = real_backend
    if rank == 0:  # other ranks log only decisions that differ from rank 0's
        assert records.grep("backend 'threaded' has no point-to-point")
    assert fsdp_patch.installed_refcount() == 0
    _step(model)
    comm.remove(model)

    # 8. FSDP roots (each has its own reduce-scatter stream on GPU): the outermost FSDP
    # module around a group; blocks sharded without the top module are roots each.
    top = _model()
    assert set(fsdp_internals.group_root_fqns(top).values()) == {"<root>"}
    torch.manual_seed(0)
    blocks = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    for layer in blocks:
        fully_shard(layer)
    roots = fsdp_internals.group_root_fqns(blocks)
    assert sorted(roots.values()) == ["0", "1"]
    # Caches keyed by process group die with the last TIDE model (no stale peers for a
    # group created later at a reused address).
    from torchtitan_tide.comm.base import ranks

    comm.apply(top, "tide")
    _step(top)
    assert ranks._GLOBAL_RANKS
    comm.remove(top)
    assert fsdp_patch.installed_refcount() == 0 and not ranks._GLOBAL_RANKS

    # 9. replicate() (replicate-only mesh): FSDP2's path, logged, no assertion.
    replicate = pytest.importorskip("torch.distributed._composable.replicate_with_fsdp").replicate
    torch.manual_seed(0)
    rep = replicate(nn.Linear(8, 8))
    comm.apply(rep, "tide")
    if rank == 0:
        assert records.grep("FSDP2 path (replicate-only mesh: nothing to all-gather)")
    comm.remove(rep)


def test_install_is_atomic_and_falls_back_cpu():
    spawn(_cases, 2)


def test_world_of_one_rank_runs_no_collective():
    """One rank: every group is a group of 1 (FSDP2 skips the all-gather); apply logs
    it and runs no collective."""
    spawn(_one_rank, 1)


def _one_rank(rank: int, world: int) -> None:
    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch

    real_gather = dist.all_gather_object
    dist.all_gather_object = None  # any collective of apply would fail
    try:
        model = _model()
        comm.apply(model, "tide")
        assert fsdp_patch.installed_refcount() == 0
        comm.remove(model)
    finally:
        dist.all_gather_object = real_gather
