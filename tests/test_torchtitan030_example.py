"""scripts/examples/torchtitan_0_3/comm_apply_llama3.py: ``comm.apply`` on a TorchTitan 0.3.0 model
(its llama3 debugmodel, sharded by its own ``parallelize_llama``), 2 gloo ranks on CPU:
TIDE's losses bitwise equal to stock FSDP2's over 3 steps, and TIDE-AG and TIDE-RS ran for
every FSDP group.

Runs where TorchTitan 0.3.x is installed (scripts/test_torchtitan030.sh makes that venv;
.ci/run runs it); the suite's TorchTitan 0.2.2 venv skips it."""

import importlib.metadata
import importlib.util
import os
import socket
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "scripts" / "examples" / "torchtitan_0_3" / "comm_apply_llama3.py"
STEPS = 3

pytestmark = pytest.mark.skipif(
    not importlib.metadata.version("torchtitan").startswith("0.3."),
    reason="needs TorchTitan 0.3.x (bash scripts/test_torchtitan030.sh)",
)


def _example():
    spec = importlib.util.spec_from_file_location("comm_apply_llama3", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker(rank: int, world: int, port: int, results) -> None:
    from torchtitan_tide.comm import fsdp_patch
    from torchtitan_tide.comm import reduce_scatter as tide_rs
    from torchtitan_tide.comm.fsdp_internals import fsdp_param_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    example = _example()
    ran: dict[str, set[str]] = {"ag": set(), "rs": set()}
    orig_ag, orig_rs = fsdp_patch.tide_all_gather, tide_rs.tide_reduce

    def counted_ag(state, *args, **kwargs):
        ran["ag"].add(state.fqn)
        return orig_ag(state, *args, **kwargs)

    def counted_rs(state, *args, **kwargs):
        ran["rs"].add(state.fqn)
        return orig_rs(state, *args, **kwargs)

    fsdp_patch.tide_all_gather, tide_rs.tide_reduce = counted_ag, counted_rs
    try:
        spec, (parallelism, dims) = example.cpu_spec(), example.cpu_parallelism(world)
        vocab = spec.model.vocab_size
        stock = example.train(example.build(spec, parallelism, dims, None), vocab, STEPS)
        assert not ran["ag"] and not ran["rs"], ran  # stock FSDP2 never reaches TIDE
        model = example.build(spec, parallelism, dims, "tide")
        groups = {fqn for fqn, _ in fsdp_param_groups(model)}
        tide = example.train(model, vocab, STEPS)
        example.comm.remove(model)
        if rank == 0:
            results.update(stock=stock, tide=tide, groups=groups, ran=ran)
    finally:
        fsdp_patch.tide_all_gather, tide_rs.tide_reduce = orig_ag, orig_rs
        dist.destroy_process_group()


def test_comm_apply_on_torchtitan030_llama3_matches_fsdp2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, port, results), nprocs=2)
    assert len(results["stock"]) == STEPS
    assert results["tide"] == results["stock"]  # 2 ranks: bitwise
    assert results["stock"][-1] < results["stock"][0]  # it trains
    assert len(results["groups"]) >= 3  # embeddings, blocks, norm + head
    assert results["ran"]["ag"] == results["groups"], results["ran"]
    assert results["ran"]["rs"] == results["groups"], results["ran"]
