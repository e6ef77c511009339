"""Public API of torchtitan_tide.comm: modes, options, apply/remove, fallback."""

import pytest
import torch
import torch.distributed as dist
from _harness import Scenario, TinyModel, build, spawn
from torch import nn

from torchtitan_tide import comm
from torchtitan_tide.comm import TideOptions
from torchtitan_tide.comm.plans.topology import resolve_local_world_size


def test_apply_on_non_fsdp_model_raises():
    with pytest.raises(ValueError, match="no FSDP2 module"):
        comm.apply(TinyModel(), "tide")
    assert not hasattr(TinyModel(), "_tide_comm_mode")


def test_modes():
    with pytest.raises(ValueError, match=r"unknown comm mode 'nccl'.*fsdp2.*symm_mem.*tide"):
        comm.apply(nn.Linear(2, 2), "nccl")
    with pytest.raises(ValueError, match="no FSDP2 module"):
        comm.apply(nn.Linear(2, 2), "symm_mem")
    model = nn.Linear(2, 2)
    comm.apply(model, "fsdp2")  # no-op, logged
    comm.remove(model)
    with pytest.raises(ValueError, match="takes no options"):
        comm.apply(model, "fsdp2", pacing=1)


def test_register_mode():
    seen = []
    comm.register_mode(
        "test_mode", lambda m, **o: seen.append(("apply", o)), lambda m: seen.append("rm")
    )
    try:
        model = nn.Linear(2, 2)
        comm.apply(model, "test_mode", x=1)
        comm.remove(model)
        assert seen == [("apply", {"x": 1}), "rm"]
    finally:
        comm._MODES.pop("test_mode")


def test_options_validation():
    with pytest.raises(ValueError, match=r"ag_transport \(comm.apply option transport\) = 'nvls'"):
        TideOptions(transport="nvls")
    with pytest.raises(ValueError, match="local_world_size = -1"):
        TideOptions(local_world_size=-1)
    with pytest.raises(ValueError, match=r"option pacing\) = -1"):
        TideOptions(pacing=-1)
    with pytest.raises(ValueError, match=r"unknown tide option\(s\) \['pace'\]"):
        TideOptions.from_kwargs(pace=2)
    with pytest.raises(ValueError, match="must divide the FSDP group size 4"):
        resolve_local_world_size(TideOptions(local_world_size=3), ["a"] * 4)
    assert resolve_local_world_size(TideOptions(local_world_size=2), ["a"] * 4)[0] == 2
    assert resolve_local_world_size(TideOptions(), ["a"] * 4)[0] == 4
    assert resolve_local_world_size(TideOptions(), ["a"] * 8 + ["b"] * 8)[0] == 8
    # Strided across hosts (TP inside the node) or uneven: one rank per node.
    assert resolve_local_world_size(TideOptions(), ["a", "b", "a", "b"])[0] == 1
    assert resolve_local_world_size(TideOptions(), ["a", "a", "b"])[0] == 1


def _remove_and_fallback(rank: int, world_size: int) -> None:
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fpg
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from torchtitan_tide.comm.fsdp import all_gather as tide_ag
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch

    orig_ag, orig_out = fpg.foreach_all_gather, fpg.foreach_all_gather_copy_out
    calls = []
    tide_ag.set_debug_hooks(after=lambda outs: calls.append(len(outs)))
    dev = torch.device("cpu")
    scn = Scenario()
    a, b = build(scn, dev), build(scn, dev)
    comm.apply(a, "tide")
    comm.apply(b, "tide", transport="gloo", pacing=2)
    assert fsdp_patch.installed_refcount() == 2 and fpg.foreach_all_gather is not orig_ag
    with pytest.raises(ValueError, match="already applied"):
        comm.apply(a, "tide")
    a(torch.randint(0, 11, (2, 5))).sum().backward()
    assert calls, "TIDE-AG not used"
    comm.remove(a)
    assert fsdp_patch.installed_refcount() == 1
    calls.clear()
    a(torch.randint(0, 11, (2, 5))).sum().backward()
    assert not calls, "removed model still uses TIDE-AG"
    comm.remove(b)
    assert fsdp_patch.installed_refcount() == 0
    assert fpg.foreach_all_gather is orig_ag and fpg.foreach_all_gather_copy_out is orig_out
    comm.remove(b)  # idempotent

    # Bad forced transports / layouts are named errors.
    c = build(scn, dev)
    with pytest.raises(ValueError, match=r"transport='copy_engine' \(\[tide\] ag_transport\) needs CUDA"):
        comm.apply(c, "tide", transport="copy_engine")
    with pytest.raises(ValueError, match=r"transport='nccl_p2p' \(\[tide\] ag_transport\) needs CUDA"):
        comm.apply(c, "tide", transport="nccl_p2p")
    with pytest.raises(ValueError, match="must divide the FSDP group size 2"):
        comm.apply(c, "tide", local_world_size=4)
    assert fsdp_patch.installed_refcount() == 0

    # A group with a Shard(1) parameter takes FSDP2's path; the others TIDE's.
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = TinyModel(dim=8, hidden=14)  # even dim 1 (Shard(1) needs even sharding)
        fully_shard(m.layers[0], shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0))
        for layer in m.layers[1:]:
            fully_shard(layer)
        fully_shard(m)
        for mod in m.modules():
            if hasattr(mod, "set_force_sum_reduction_for_comms"):
                mod.set_force_sum_reduction_for_comms(True)
        models.append(m)
    ref, tide = models
    comm.apply(tide, "tide")
    st = {n: getattr(g, "_tide_ag_state", None) for n, g in fsdp_patch.fsdp_param_groups(tide)}
    assert st["layers.0"] is None, st
    assert all(st[n] is not None for n in ("<root>", "layers.1", "layers.2")), st
    x = torch.randint(0, 11, (2, 5))
    for m in models:
        m(x).float().pow(2).mean().backward()
    for p, q in zip(ref.parameters(), tide.parameters()):
        assert torch.equal(p.grad.to_local(), q.grad.to_local())
    comm.remove(tide)
    tide_ag.set_debug_hooks()
    dist.barrier()


def test_remove_restores_stock_and_fallback_groups():
    spawn(_remove_and_fallback, 2)
