"""The compute ops the interference benchmarks time (``bench_interference.py`` beside the
collectives of two GPUs, ``interference_one_gpu.py`` beside each engine on one GPU): a
bf16 GEMM and the grouped expert GEMM TorchTitan's MoE runs. Imports nothing of
scripts/bench, so both benchmarks import it and neither imports the other's module at
load (scripts/ has no import circle: tests/bench/test_suite.py checks it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Gemm", "GroupedGemm", "build_gemm"]


class Gemm:
    """One bf16 GEMM with random operands and a preallocated output."""

    def __init__(self, mkn: Sequence[int], device: torch.device, seed: int) -> None:
        m, k, n = mkn
        gen = torch.Generator(device=device).manual_seed(seed)
        self.a = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(k, n, device=device, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty(m, n, device=device, dtype=torch.bfloat16)

    def __call__(self) -> None:
        torch.matmul(self.a, self.b, out=self.out)


class GroupedGemm:
    """One bf16 grouped GEMM as TorchTitan's MoE runs its experts: ``torch._grouped_mm``
    of A [experts x M, K] (each expert's M rows in turn) with every expert's weight
    [N, K] transposed, random operands; the output is allocated per call (the op has no
    ``out=``)."""

    def __init__(self, shape: Sequence[int], device: torch.device, seed: int) -> None:
        experts, m, k, n = shape
        gen = torch.Generator(device=device).manual_seed(seed)
        self.a = torch.randn(experts * m, k, device=device, dtype=torch.bfloat16, generator=gen)
        self.w = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16, generator=gen)
        self.offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * m
        self.out: torch.Tensor | None = None

    def __call__(self) -> None:
        self.out = torch._grouped_mm(self.a, self.w.transpose(-2, -1), offs=self.offs)


def build_gemm(shape: Sequence[int], device: torch.device, seed: int) -> Gemm | GroupedGemm:
    """:class:`Gemm` for an (M, K, N) shape, :class:`GroupedGemm` for (experts, M, K, N)."""
    return GroupedGemm(shape, device, seed) if len(shape) == 4 else Gemm(shape, device, seed)
