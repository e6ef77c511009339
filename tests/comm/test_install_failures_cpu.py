"""Install failures on CPU/gloo as a cluster meets them: an install error with
``[tide] fallback = "fsdp2"`` (every rank trains stock FSDP2, the model untouched), a
failure or a silent rank inside the collective set-up (every rank raises within
``[tide] install_timeout_s``, naming the rank), path changes after ``comm.apply``, and
ranks that reduce different parameter sets (per-rank branches).

One spawn of 2 ranks runs every case in order (process start-up dominates on 2 cores).
The copy-engine set-up runs on CPU with its symmetric-memory calls replaced: the
buffers are CPU tensors and ``symm_mem.rendezvous`` a fake that, like the real one,
blocks in the store until every peer posted (or fails, or hangs, where injected)."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _harness import LogRecords as _Records
from _harness import spawn
from torch import nn
from torch.distributed.fsdp import fully_shard


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _grads(model: nn.Module) -> list[torch.Tensor]:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()
    return [p.grad.to_local().clone() for p in model.parameters()]


def _assert_stock(model: nn.Module, hooks_before: int) -> None:
    """Nothing of TIDE is left on ``model``: no mark, no hook, FSDP2's functions."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg

    from torchtitan_tide.comm.base import ranks
    from torchtitan_tide.comm.fsdp import internals as fsdp_internals
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch

    assert fsdp_patch.installed_refcount() == 0 and not ranks._GLOBAL_RANKS
    assert not hasattr(model, "_tide_comm_mode") and not hasattr(model, "_tide_ag_installed")
    for _, g in fsdp_internals.fsdp_param_groups(model):
        assert not hasattr(g, "_tide_ag_state") and not hasattr(g, "_tide_rs_state")
    assert len(model._forward_pre_hooks) == hooks_before
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    for name in fsdp_internals.PATCHED_NAMES:
        assert getattr(fpg, name) is getattr(coll, name), name


def _fallback_cases(rank: int, records: _Records) -> None:
    """Item: an install error (here: topology on rank 1) with and without fallback."""
    from torchtitan_tide.comm.plans import topology
    from torchtitan_tide.config import Tide
    from torchtitan_tide.train_specs import CommModeError, apply_comm_mode

    real_info = topology.local_rank_info

    def info_fails(device):
        raise RuntimeError("injected topology failure")

    stock_grads = _grads(_model())
    model = _model()
    hooks = len(model._forward_pre_hooks)
    if rank == 1:
        topology.local_rank_info = info_fails
    try:
        with pytest.raises(CommModeError, match=r"(?s)rank 1: RuntimeError: injected "
                           r"topology failure.*Set \[tide\] fallback = 'fsdp2'"):  # fmt: skip
            apply_comm_mode(model, Tide(comm="tide"))
        _assert_stock(model, hooks)
        assert apply_comm_mode(model, Tide(comm="tide", fallback="fsdp2")) == "fsdp2"
    finally:
        topology.local_rank_info = real_info
    said = records.grep(f"[rank {rank}] comm = 'tide' could not be set up (TideInstallError")
    assert len(said) == 1 and "rank 1: RuntimeError: injected topology failure" in said[0], said
    assert records.grep(f"[rank {rank}] comm mode 'fsdp2' on 3 FSDP modules")
    _assert_stock(model, hooks)
    for got, want in zip(_grads(model), stock_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _setup_cases(rank: int, records: _Records) -> None:
    """Item: a failure (or a silent rank) inside the copy-engine set-up reaches the
    other rank within install_timeout_s, with the failing rank and its message."""
    import torch.distributed._symmetric_memory as symm_mem

    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp.install import TideInstallError
    from torchtitan_tide.comm.plans import topology
    from torchtitan_tide.comm.plans.memory_plan import slot_alloc_bytes
    from torchtitan_tide.comm.transports.copy_engine import SymmSlots

    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=40))  # the store/group timeout (minutes in a job)
    waiter = store.clone()  # the fake rendezvous blocks here, not on the default client
    real = (topology.choose_transport, SymmSlots.allocate, symm_mem.rendezvous)
    topology.choose_transport = lambda *a, **k: ("copy_engine", "forced by the test", None)
    SymmSlots.allocate = staticmethod(
        lambda slot_bytes, device: torch.zeros(2 * slot_alloc_bytes(slot_bytes), dtype=torch.uint8)
    )
    bound = 3
    try:
        for case in ("fails", "hangs"):

            def rendezvous(buffer, group_name, _case=case):
                if rank == 1 and _case == "fails":
                    raise RuntimeError("injected rendezvous failure")
                if rank == 1:
                    time.sleep(2 * bound)  # hung: never posts
                waiter.get(f"fake-rendezvous/{_case}/{1 - rank}")  # the peer never posts
                raise AssertionError("unreachable: rank 1 never posts")

            symm_mem.rendezvous = rendezvous
            model = _model()
            hooks = len(model._forward_pre_hooks)
            start = time.monotonic()
            with pytest.raises(TideInstallError) as info:
                comm.apply(model, "tide", install_timeout_s=bound)
            elapsed = time.monotonic() - start
            message = str(info.value)
            print(f"[rank {rank}] rendezvous {case}: raised after {elapsed:.2f} s")
            if case == "fails":
                assert elapsed < bound, (elapsed, message)
                assert "rank 1 failed in TIDE-AG symmetric-memory rendezvous: RuntimeError: " \
                       "injected rendezvous failure" in message or (
                    rank == 1 and "rank 1: RuntimeError: injected rendezvous failure" in message
                ), message  # fmt: skip
            else:
                assert elapsed < bound + 2, (elapsed, message)
                assert "did not complete within [tide] install_timeout_s = 3 s" in message
            _assert_stock(model, hooks)
    finally:
        topology.choose_transport, symm_mem.rendezvous = real[0], real[2]
        SymmSlots.allocate = staticmethod(real[1])


def _rs_calls(model: nn.Module) -> int:
    from torchtitan_tide.comm.fsdp.internals import fsdp_param_groups

    return sum(g._tide_rs_state.calls for _, g in fsdp_param_groups(model)
               if hasattr(g, "_tide_rs_state"))  # fmt: skip


def _after_apply_cases(rank: int, records: _Records) -> None:
    """Item: a path change after comm.apply is logged once per group; fallback lines
    name parameters by FQN."""
    from torch.distributed.tensor import Shard

    from torchtitan_tide import comm

    stock_grads = _grads(_model())
    model = _model()
    comm.apply(model, "tide")
    _grads(model)
    assert _rs_calls(model) == 2
    if hasattr(model, "set_separate_reduce_scatter_group"):  # torch >= 2.13
        model.set_separate_reduce_scatter_group(True)
        for _ in range(2):
            model.zero_grad()
            grads = _grads(model)
        assert _rs_calls(model) == 2  # FSDP2's reduce-scatter from now on ...
        said = records.grep("no longer the all-gather group TIDE-RS was set up on")
        assert sorted(m.split(":")[0] for m in said) == ["TIDE-RS 0", "TIDE-RS 1"], said  # ... said
        for got, want in zip(grads, stock_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    comm.remove(model)

    torch.manual_seed(0)
    sharded_dim1 = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    fully_shard(sharded_dim1[0], shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0))
    fully_shard(sharded_dim1[1])
    fully_shard(sharded_dim1)
    comm.apply(sharded_dim1, "tide")
    if rank == 0:  # rank 0 logs the decisions
        assert records.grep("0: FSDP2 path (0.weight: Shard(1) placement)"), records.messages
    assert not records.grep("param(16, 16)")
    comm.remove(sharded_dim1)


class _Branchy(nn.Module):
    """One FSDP group whose ``extra`` layer only rank 0 runs (a per-rank branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(x)
        return self.extra(x) if dist.get_rank() == 0 else x


def _branch_cases(rank: int) -> None:
    """Item: ranks that reduce different parameter sets get one clear error naming the
    parameters and FSDP2's setting (not a transport error); with the setting, TIDE-RS
    equals stock FSDP2 with it."""
    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp.reduce_scatter import GradientSetMismatch

    def branchy() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(_Branchy())
        fully_shard(model[0])
        fully_shard(model)
        return model

    model = branchy()
    comm.apply(model, "tide")
    with pytest.raises(GradientSetMismatch) as info:
        _grads(model)
    message = str(info.value)
    assert "group rank 1 has no gradient for ['0.extra.weight', '0.extra.bias']" in message
    assert "set_reduce_scatter_unused_params(True)" in message
    comm.remove(model)
    if not hasattr(model, "set_reduce_scatter_unused_params"):
        return
    stock, tide = branchy(), branchy()
    for m in (stock, tide):
        m.set_reduce_scatter_unused_params(True)
    comm.apply(tide, "tide")
    for got, want in zip(_grads(tide), _grads(stock), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _rs_calls(tide) == 1
    comm.remove(tide)


def _node_group_case(rank: int) -> None:
    """Item: the node-local group's real creation barrier (``dist.new_group``), bounded:
    rank 1 fails before it joins; rank 0 raises at once, naming rank 1 (bare, it waits
    in the barrier for the group timeout). Last: the abandoned barrier thread keeps the
    default store client and torch's group counter differs across ranks afterwards."""
    from torchtitan_tide.comm.base.setup_steps import SetupFailed, SetupSteps

    steps = SetupSteps(install=10**6, timeout_s=3)

    def make_group():
        if rank == 1:
            raise RuntimeError("injected new_group failure")
        return dist.new_group([0, 1], timeout=timedelta(seconds=3), use_local_synchronization=True)

    start = time.monotonic()
    with pytest.raises((SetupFailed, RuntimeError)) as info:
        steps.run("node-local group", "case", [0, 1], make_group)
    assert time.monotonic() - start < 3
    if rank == 0:
        assert isinstance(info.value, SetupFailed)
        assert "rank 1 failed in node-local group: RuntimeError: injected new_group failure" \
            in str(info.value)  # fmt: skip


def _cases(rank: int, world: int) -> None:
    records = _Records()
    logging.getLogger().addHandler(records)  # TorchTitan's logger; TIDE's propagate to it
    logging.getLogger().setLevel(logging.INFO)
    _fallback_cases(rank, records)
    _setup_cases(rank, records)
    _after_apply_cases(rank, records)
    _branch_cases(rank)
    _node_group_case(rank)


def test_install_failures_cpu():
    spawn(_cases, 2)


def _other_group_failure_case(rank: int, world: int) -> None:
    """HSDP 2 x 2: shard groups {0, 1} and {2, 3}. Install fails on rank 3 only, so
    install's own agreement (over each rank's FSDP groups) reaches ranks 2 and 3, not 0
    and 1: the job-wide agreement makes every rank fall back together (or raise)."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_tide.comm.plans import topology
    from torchtitan_tide.config import Tide
    from torchtitan_tide.train_specs import CommModeError, apply_comm_mode

    records = _Records()
    logging.getLogger().addHandler(records)
    logging.getLogger().setLevel(logging.INFO)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def hsdp_model() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def info_fails(device):
        raise RuntimeError("injected topology failure")

    if rank == 3:
        topology.local_rank_info = info_fails
    model = hsdp_model()
    hooks = len(model._forward_pre_hooks)
    assert apply_comm_mode(model, Tide(comm="tide", fallback="fsdp2")) == "fsdp2"
    _assert_stock(model, hooks)
    said = records.grep(f"[rank {rank}] comm = 'tide' could not be set up")
    assert len(said) == 1 and "injected topology failure" in said[0], said
    if rank in (0, 1):
        assert "rank(s) [2, 3]" in said[0], said
    with pytest.raises(CommModeError, match="injected topology failure"):
        apply_comm_mode(hsdp_model(), Tide(comm="tide"))


def test_install_failure_in_another_fsdp_group_reaches_every_rank_cpu():
    spawn(_other_group_failure_case, 4)
