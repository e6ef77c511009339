"""The one-sided cross-node transport where it cannot run (CPU, gloo) and its pure parts.

On CPU the choice must be visible and safe: ``auto`` keeps send/recv and logs why,
``nccl_one_sided`` is a named error on every rank at ``comm.apply`` (and nothing stays
installed), ``p2p`` says it was asked for. The GPU behaviour is in test_one_sided_gpu.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from _harness import LogRecords, spawn
from torch import nn
from torch.distributed.fsdp import fully_shard

from torchtitan_tide.comm.options import TideOptionError, TideOptions
from torchtitan_tide.comm.transports.windows import nccl_rma
from torchtitan_tide.comm.transports.windows.ring import rs_ring_bytes


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    return model


def _cases(rank: int, world: int) -> None:
    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch
    from torchtitan_tide.comm.fsdp.install import TideConfigError

    records = LogRecords()
    logging.getLogger("torchtitan_tide.comm").addHandler(records)
    logging.getLogger("torchtitan_tide.comm").setLevel(logging.INFO)

    # auto on gloo: send/recv with the reason, and TIDE-RS phase 2 really runs over it.
    model = _model()
    comm.apply(model, "tide", local_world_size=1)
    model(torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
    groups = [g for _, g in fsdp_patch.fsdp_param_groups(model)]
    assert all(g._tide_rs_state.cross_node.name == "p2p" for g in groups)
    assert all(g._tide_rs_state.calls > 0 for g in groups)
    comm.remove(model)
    if rank == 0:
        lines = records.grep("cross-node p2p (auto: needs CUDA parameters and an NCCL")
        assert lines, records.messages
        assert records.grep("cross-node p2p"), records.messages

    # explicit one-sided: the same named error on every rank, nothing installed.
    model = _model()
    with pytest.raises(TideConfigError, match=r"cross_node_transport = 'nccl_one_sided' cannot"):
        comm.apply(model, "tide", local_world_size=1, cross_node_transport="nccl_one_sided")
    assert fsdp_patch.installed_refcount() == 0

    # p2p asked for: said so.
    records.messages.clear()
    model = _model()
    comm.apply(model, "tide", local_world_size=1, cross_node_transport="p2p")
    comm.remove(model)
    if rank == 0:
        assert records.grep("cross-node p2p (option cross_node_transport='p2p')"), records.messages

    # one node: no cross-node line at all.
    records.messages.clear()
    model = _model()
    comm.apply(model, "tide")
    comm.remove(model)
    assert not records.grep("cross-node"), records.messages
    dist.barrier()


def test_cross_node_transport_choice_on_cpu():
    spawn(_cases, 2)


def test_option_validation_names_the_key():
    assert TideOptions().cross_node_transport == "auto"
    with pytest.raises(TideOptionError, match=r"\[tide\] cross_node_transport = 'rdma'"):
        TideOptions(cross_node_transport="rdma")


def test_toml_section_carries_the_key():
    from torchtitan_tide.config import Tide

    assert Tide(cross_node_transport="p2p").tide_options().cross_node_transport == "p2p"
    with pytest.raises(ValueError, match="cross_node_transport"):
        Tide(cross_node_transport="nope")


def test_nccl_library_absent_on_cpu_is_a_reason_not_an_error():
    reason = nccl_rma.one_sided_missing_reason()
    assert reason is not None and ("CUDA" in reason or "NCCL" in reason)
    assert nccl_rma.version_text(23007) == "2.30.7" and nccl_rma.version_text(None) == "none"


def test_phase2_window_is_constant_in_the_node_count():
    # 2 send + 2 receive regions of 1000 B rounded to 1024, whatever N; +1 for a bf16 wire
    assert rs_ring_bytes(inflight=2, shard_bytes=1000, wire=False) == 4 * 1024
    assert rs_ring_bytes(inflight=2, shard_bytes=1000, wire=True) == 5 * 1024
