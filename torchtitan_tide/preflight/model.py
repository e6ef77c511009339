"""The small model the ``paths`` and ``parity`` checks train, sharded as the job shards.

:func:`build` makes one model per call from a fixed seed (so a ``tide`` copy and an
``fsdp2`` copy start equal) and shards it with ``fully_shard`` on the job's data-parallel
mesh, the one TorchTitan's ``parallelize`` functions give it, with the job's
``MixedPrecisionPolicy`` (``[training] mixed_precision_param`` / ``_reduce``) and TorchTitan's
reduction rule (gradient divide factor 1.0: the loss carries the scale; plain SUM forced on
gloo, which has no PREMUL_SUM). Shapes depend on the FSDP group size ``W`` so that every rank
holds rows and shards are uneven: an embedding of ``2W + 3`` rows, blocks of Linear
``(3W + 1) x 8`` and ``8 x (3W + 1)``, one-element gates, a norm and a 5-way head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DIM = 8
LAYERS = 2
CLASSES = 5
SEQ = 8
BATCH = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.gate = nn.Parameter(torch.full((1,), 0.5))
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.down(F.gelu(self.up(x)))


class SmallModel(nn.Module):
    """See the module docstring; ``vocab`` and ``hidden`` scale with the FSDP group."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, DIM)
        self.layers = nn.ModuleList(Block(DIM, hidden) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        # a fresh tensor, not a view of the matmul's output (FSDP2 warns of views returned
        # by a root module: in-place ops on them would skip its pre-backward hook)
        return self.head(self.norm(h)).clone()


def shapes_for(group_size: int) -> tuple[int, int]:
    """(vocab, hidden) of the model for an FSDP group of ``group_size`` ranks."""
    return 2 * group_size + 3, 3 * group_size + 1


def mp_policy(job_config: Any):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    training = job_config.training
    return MixedPrecisionPolicy(param_dtype=DTYPES[training.mixed_precision_param],
                                reduce_dtype=DTYPES[training.mixed_precision_reduce])  # fmt: skip


def build(dp_mesh: Any, group_size: int, job_config: Any, device: torch.device) -> nn.Module:
    """A :class:`SmallModel` from seed 1234 on ``device``, ``fully_shard``-ed per block and at
    the root on ``dp_mesh`` (module docstring)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(1234)
    model = SmallModel(*shapes_for(group_size)).to(device)
    config = {"mesh": dp_mesh, "mp_policy": mp_policy(job_config)}
    for layer in model.layers:
        fully_shard(layer, **config)
    fully_shard(model, **config)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # TorchTitan: the loss carries the scale
            if device.type == "cpu" and hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def batch(vocab: int, rank: int, step: int, device: torch.device):
    """(tokens, targets) of ``rank`` at ``step``: the same on every copy, different per rank."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, CLASSES, (BATCH, SEQ), generator=gen)
    return tokens.to(device), targets.to(device)


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
