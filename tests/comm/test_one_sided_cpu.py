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
from torchtitan_tide.comm.transport import nccl_rma
from torchtitan_tide.comm.transport.one_sided import _pieces, ag_window_bytes, rs_window_bytes


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
    from torchtitan_tide.comm import fsdp_patch
    from torchtitan_tide.comm.install import TideConfigError

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


def test_put_waves_split_runs_the_same_way_on_both_sides():
    runs = [(0, 4)]  # recursive doubling's last step of 8 nodes: 4 consecutive entries
    assert _pieces(runs, 0) == [[(0, 4)]]
    assert _pieces(runs, 3) == [[(0, 1), (1, 1), (2, 1)], [(3, 1)]]
    assert _pieces([], 2) == []
    # sender's and receiver's wave sizes match for the same count of entries
    send, recv = _pieces([(4, 4)], 3), _pieces([(0, 4)], 3)
    assert [len(w) for w in send] == [len(w) for w in recv]


def test_window_sizes():
    assert ag_window_bytes(num_nodes=4, entry_bytes=1000) == 8000
    # 2 in flight + 2 parities x 4 nodes regions of 1000 B rounded to 1024
    assert rs_window_bytes(num_nodes=4, inflight=2, shard_bytes=1000) == 10 * 1024


class _Posted:
    """A stand-in for install's bounded steps: ``exchange`` returns what every rank posted."""

    def __init__(self, others: list) -> None:
        self.others, self.posted = others, None

    def exchange(self, what: str, value: object) -> list:
        self.posted = value
        return [value, *self.others]


def test_every_rank_learns_any_rank_reason_not_to_try(monkeypatch):
    from torchtitan_tide.comm import install

    monkeypatch.setattr(nccl_rma, "new_unique_id", lambda: b"u" * 128)
    ids, why = install._agree_to_try(_Posted([(None, None)]), None, True, 2)
    assert why is None and ids == [b"u" * 128] * 2
    # another node loaded an older NCCL: every rank falls back alike, naming it
    older = "NCCL 2.28.9 is loaded; the one-sided API needs NCCL >= 2.29"
    ids, why = install._agree_to_try(_Posted([(older, None)]), None, True, 2)
    assert ids == [] and why == f"group rank 1: {older}"

    # the first rank cannot make ids: a reason like any other, posted instead of ids
    def fails():
        raise nccl_rma.NcclError("ncclGetUniqueId failed")

    monkeypatch.setattr(nccl_rma, "new_unique_id", fails)
    soft = _Posted([(None, None)])
    ids, why = install._agree_to_try(soft, None, True, 1)
    assert ids == [] and "group rank 0: NcclError: ncclGetUniqueId failed" in why
    assert soft.posted[1] is None


def test_window_partials_are_never_reallocated():
    from torchtitan_tide.comm.reduce_scatter import RSBuffers

    buffers = RSBuffers(inflight=2, partials=[torch.zeros(8), torch.zeros(8)],
                        partial_free=[None, None], partials_fixed=True)  # fmt: skip
    slot, view = buffers.take_partial(8, torch.device("cpu"))
    assert view.data_ptr() == buffers.partials[slot].data_ptr()
    with pytest.raises(RuntimeError, match="cross_node_transport = 'p2p'"):
        buffers.take_partial(9, torch.device("cpu"))


def test_library_path_picks_the_nccl_torch_calls(monkeypatch, caplog):
    """Several mapped libnccl copies: the one holding ncclGetVersion as libtorch_cuda sees
    it, else as the global scope does, else a named error (nccl_version: None and a
    warning); never the first by address."""
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 1, raising=False)
    wheel, torch_own = "/wheel/libnccl.so.2", "/torch/lib/libnccl.so.2"
    ranges = [(0x1000, 0x2000, wheel), (0x5000, 0x6000, torch_own), (0x6000, 0x7000, torch_own)]
    monkeypatch.setattr(nccl_rma, "_mapped_nccl_ranges", lambda: ranges)
    monkeypatch.setattr(nccl_rma, "_torch_nccl_symbol", lambda: 0x6100)  # libtorch_cuda's
    monkeypatch.setattr(nccl_rma, "_global_nccl_symbol", lambda: 0x1100)
    assert nccl_rma.library_path() == torch_own
    monkeypatch.setattr(nccl_rma, "_torch_nccl_symbol", lambda: None)  # then the global one
    assert nccl_rma.library_path() == wheel
    monkeypatch.setattr(nccl_rma, "_mapped_nccl_ranges", lambda: ranges[1:])
    monkeypatch.setattr(nccl_rma, "_global_nccl_symbol", lambda: None)
    assert nccl_rma.library_path() == torch_own  # one library: no question
    monkeypatch.setattr(nccl_rma, "_mapped_nccl_ranges", lambda: ranges)
    with pytest.raises(nccl_rma.NcclLibraryAmbiguous, match="2 NCCL libraries are mapped"):
        nccl_rma.library_path()
    monkeypatch.setattr(nccl_rma, "_lib", None)
    with caplog.at_level(logging.WARNING, logger=nccl_rma.__name__):
        assert nccl_rma.nccl_version() is None
    assert "NCCL version unknown" in caplog.text and wheel in caplog.text
    monkeypatch.setattr(nccl_rma, "_mapped_nccl_ranges", list)
    assert nccl_rma.library_path() is None


def test_mapped_nccl_ranges_reads_this_process():
    """On this machine: every range parsed, each a libnccl file that exists (none on CPU torch)."""
    for start, end, path in nccl_rma._mapped_nccl_ranges():
        assert start < end and "/libnccl.so" in path
