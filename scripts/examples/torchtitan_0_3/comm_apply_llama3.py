"""TIDE on a TorchTitan 0.3.0 model: TorchTitan's own ``parallelize_llama`` (FSDP2 through its
``apply_fsdp_to_decoder``), then ``torchtitan_tide.comm.apply`` on the sharded model.

This project's trainer stays on TorchTitan 0.2.2 (the ``[tide]`` TOML section and
``run_train.sh --config`` live there). ``comm.apply`` imports nothing from TorchTitan and
works on any ``fully_shard`` model, so a TorchTitan 0.3.0 run gets TIDE by wrapping its
model spec's ``parallelize_fn`` (:func:`with_tide`)::

    spec = model_registry("8B")
    spec.parallelize_fn = with_tide(spec.parallelize_fn, "tide")

Here, on CPU: 2 gloo processes on 127.0.0.1 train the 0.3.0 llama3 ``debugmodel`` for a few
steps twice, stock FSDP2 and TIDE, from the same weights and batches, and print both loss
series (bitwise equal on 2 ranks). 0.3.0's language models attend with FlexAttention
(block-causal masks) or varlen attention, neither of which has a CPU backward, so this
example swaps in the causal SDPA backend TorchTitan 0.3.0 ships (no document masking);
on GPUs keep the model's own backend. Needs torch >= 2.12, ``torchtitan==0.3.0`` (with
``datasets<4.8``) and this repository on ``PYTHONPATH``:

    python scripts/examples/torchtitan_0_3/comm_apply_llama3.py --steps 3
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtitan_tide import comm

BATCH, SEQ_LEN = 2, 64


def with_tide(parallelize_fn: Callable, mode: str = "tide", **options) -> Callable:
    """``parallelize_fn`` (a TorchTitan 0.3.0 model spec's, keyword arguments as the
    Trainer passes them), followed by ``comm.apply(model, mode, **options)``."""

    def parallelize(model, **kwargs):
        model = parallelize_fn(model, **kwargs)
        comm.apply(model, mode, **options)
        return model

    return parallelize


def cpu_spec():
    """The 0.3.0 llama3 ``debugmodel`` spec with SDPA attention (CPU has a backward for it)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec


def cpu_parallelism(world: int):
    """0.3.0's parallelism config and dims for FSDP over ``world`` CPU ranks."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    # FSDP2 over plain parameters; 0.3.0's default "spmd_types" and its "full_dtensor"
    # backends shard DTensors of the full SPMD mesh (dp_mesh_dims): not covered here
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=world, spmd_backend="partial_dtensor"
    )
    parallel_dims_module.device_type = "cpu"  # TorchTitan falls back to "cuda" without GPUs
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    return parallelism, dims


def build(spec, parallelism, parallel_dims, mode: str | None):
    """The model of ``spec`` from seed 0, sharded by ``spec.parallelize_fn`` (with
    :func:`with_tide` unless ``mode`` is None) as TorchTitan 0.3.0's Trainer calls it."""
    from torchtitan.config import CompileConfig, TrainingConfig

    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    parallelize = spec.parallelize_fn if mode is None else with_tide(spec.parallelize_fn, mode)
    model = parallelize(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(),  # bf16 parameters, fp32 reduce
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    for module in model.modules():  # gloo has no AVG / PREMUL_SUM
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    return model


def train(model, vocab_size: int, steps: int) -> list[float]:
    """``steps`` AdamW steps on random tokens (seeded per rank); each step's mean loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(steps):
        tokens = torch.randint(vocab_size, (BATCH, SEQ_LEN + 1), generator=data)
        logits = model(tokens[:, :-1])
        target = tokens[:, 1:].flatten()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _worker(rank: int, world: int, port: int, steps: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        spec, (parallelism, dims) = cpu_spec(), cpu_parallelism(world)
        vocab = spec.model.vocab_size
        stock = train(build(spec, parallelism, dims, None), vocab, steps)
        tide_model = build(spec, parallelism, dims, "tide")
        tide = train(tide_model, vocab, steps)
        comm.remove(tide_model)
        if rank == 0:
            results["fsdp2"], results["tide"] = stock, tide
    finally:
        dist.destroy_process_group()


def run(steps: int = 3, world: int = 2) -> dict[str, list[float]]:
    """Stock FSDP2's and TIDE's losses per step, on ``world`` CPU processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, port, steps, results), nprocs=world)
    return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = run(args.steps)
    for step, (a, b) in enumerate(zip(results["fsdp2"], results["tide"]), start=1):
        print(f"step {step}: fsdp2 {a:.6f}  tide {b:.6f}  {'equal' if a == b else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
