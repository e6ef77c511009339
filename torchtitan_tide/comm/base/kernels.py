"""The TIDE-RS accumulate kernel: a few CTAs sum rows of gradients in fp32, then exit.

``accumulate_rows(rows, out, accumulate, divisor, num_ctas)`` computes, element-wise,

    out = ((out if accumulate else 0) + rows[0] + rows[1] + ... + rows[R-1]) / divisor

with every addition in fp32, in row order, and IEEE round-to-nearest division,
so the Triton kernel (CUDA) and the torch fallback (CPU, or CUDA without
Triton) give bitwise equal results. ``rows`` is ``[R, numel]`` in any float
dtype (bf16 gradients from peers, fp32 partials from other nodes); ``out`` is
fp32 ``[numel]``. Both contiguous, same device.

Two launch shapes (``num_ctas``):

- ``num_ctas > 0``: a persistent grid of that many programs, each striding
  over the whole range: the kernel never takes more than ``num_ctas`` SMs, and
  its length, not its width, grows with the gradient size. Measured on H200
  (bench_accumulate, 8a9ccda): about 50 GB/s per CTA, so the SM-weighted cost (time x
  CTAs / SMs) is the same for any count; fewer CTAs = longer.
- ``num_ctas == 0``: short-lived programs, one block (``_BLOCK`` elements,
  microseconds) each, scheduled by the hardware on whatever SMs are free. Run
  on a low-priority stream (TIDE-RS does), a concurrent GEMM's CTAs are
  scheduled first and never wait behind a long-lived accumulate CTA.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch

from . import streams

__all__ = ["accumulate_beside", "accumulate_rows", "triton_status"]

logger = logging.getLogger(__name__)

# Elements per program per loop iteration, 16 warps: 32 elements (64 B of bf16)
# per thread per row, so one iteration keeps ~64 KiB of loads in flight per SM;
# memory parallelism, not the CTA count, sets the kernel's bandwidth.
_BLOCK = 16384
_NUM_WARPS = 16
_STREAMING = False
# How the kernel divides: not at all (divisor 1), by multiplying with an exact
# reciprocal (divisor a power of two: the same correctly rounded result as the
# division), or by IEEE round-to-nearest division (any other divisor).
_DIVIDE_NONE, _DIVIDE_EXACT_SCALE, _DIVIDE_RN = 0, 1, 2
_logged_large = {"done": False}


@functools.cache
def _triton_kernel():
    """The jitted kernel, or None when Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # noqa: BLE001 - any import failure means "no Triton"
        logger.info("TIDE-RS: Triton unavailable (%s); accumulate uses torch ops", e)
        return None

    @triton.jit
    def _accumulate_rows_kernel(
        rows_ptr,
        row_stride,
        out_ptr,
        numel,
        divisor,
        DIVIDE: tl.constexpr,
        NUM_ROWS: tl.constexpr,
        ACCUMULATE: tl.constexpr,
        BLOCK: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
        STREAMING: tl.constexpr,
    ):
        # Offsets are int32 arithmetic; accumulate_rows keeps every offset
        # (rows x row_stride + BLOCK) under 2**31 or takes the torch path.
        # STREAMING: rows are read once and the output is not read again by
        # this kernel, so loads evict first and stores bypass L1 (".cs").
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, numel, NUM_PROGRAMS * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            if ACCUMULATE:
                acc = tl.load(out_ptr + offs, mask=mask, other=0.0)
            else:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
            for r in tl.static_range(NUM_ROWS):
                if STREAMING:
                    row = tl.load(
                        rows_ptr + r * row_stride + offs,
                        mask=mask,
                        other=0.0,
                        eviction_policy="evict_first",
                    )
                else:
                    row = tl.load(rows_ptr + r * row_stride + offs, mask=mask, other=0.0)
                acc += row.to(tl.float32)
            # DIVIDE (see _DIVIDE_*; a jitted function reads no Python globals):
            if DIVIDE == 1:  # divisor holds 2**-k: x * 2**-k == x / 2**k
                acc = acc * divisor
            elif DIVIDE == 2:
                acc = tl.math.div_rn(acc, divisor)
            if STREAMING:
                tl.store(out_ptr + offs, acc, mask=mask, cache_modifier=".cs")
            else:
                tl.store(out_ptr + offs, acc, mask=mask)

    return _accumulate_rows_kernel


def triton_status() -> str:
    """ "triton" when the CUDA path uses the Triton kernel, else why not."""
    return "triton" if _triton_kernel() is not None else "torch fallback (no Triton)"


def _torch_accumulate(rows: torch.Tensor, out: torch.Tensor, accumulate: bool, divisor: float):
    if not accumulate:
        out.zero_()
    for r in range(rows.shape[0]):
        out.add_(rows[r])  # bf16 row promoted to fp32, added in fp32
    if divisor != 1.0:
        out.div_(divisor)


def _division(divisor: float) -> tuple[int, float]:
    """(how the kernel divides, the factor it uses): see ``_DIVIDE_*``."""
    if divisor == 1.0:
        return _DIVIDE_NONE, 1.0
    mantissa, exponent = math.frexp(divisor)
    if mantissa == 0.5 and -125 <= exponent - 1 <= 126:  # 2**k with 2**-k a normal fp32
        return _DIVIDE_EXACT_SCALE, math.ldexp(1.0, 1 - exponent)
    return _DIVIDE_RN, divisor


def accumulate_rows(
    rows: torch.Tensor,
    out: torch.Tensor,
    *,
    accumulate: bool,
    divisor: float = 1.0,
    num_ctas: int = 0,
    block: int = _BLOCK,
    num_warps: int = _NUM_WARPS,
    streaming: bool = _STREAMING,
) -> None:
    """See the module docstring. Runs on the current stream; returns at once (CUDA).
    ``num_ctas``: persistent programs, or 0 for one short program per block.
    ``block`` (elements per program and iteration, a power of two), ``num_warps``
    and ``streaming`` (cache hints) are the launch shape; the defaults are the
    measured best (bench_accumulate), the arguments exist for that benchmark.

    ``divisor`` 1.0 skips the division; a power of two multiplies by its exact
    reciprocal (bitwise the same as dividing); any other divisor divides."""
    if rows.dim() != 2 or out.dim() != 1 or rows.shape[1] != out.numel():
        raise ValueError(f"accumulate_rows: rows {tuple(rows.shape)} vs out {tuple(out.shape)}")
    if out.dtype != torch.float32 or not (rows.is_contiguous() and out.is_contiguous()):
        raise ValueError("accumulate_rows: out must be contiguous fp32, rows contiguous")
    numel = out.numel()
    if numel == 0:
        return
    # CPU tensors go to Triton only in its interpreter (TRITON_INTERPRET=1, tests).
    use_triton = out.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    kernel = _triton_kernel() if use_triton else None
    if kernel is not None and rows.shape[0] * rows.stride(0) + block >= 2**31:
        # int32 offsets in the kernel: shards this large (> 2**31 elements over all
        # rows) take the torch path, logged once.
        if not _logged_large["done"]:
            logger.warning(
                "TIDE-RS accumulate: %d rows x %d elements exceed int32 offsets; torch ops used",
                rows.shape[0], rows.stride(0),
            )  # fmt: skip
            _logged_large["done"] = True
        kernel = None
    if kernel is None:
        _torch_accumulate(rows, out, accumulate, float(divisor))
        return
    divide, scale_or_divisor = _division(float(divisor))
    blocks = -(-numel // block)
    programs = blocks if num_ctas == 0 else max(1, min(num_ctas, blocks))
    kernel[(programs,)](
        rows,
        rows.stride(0),
        out,
        numel,
        scale_or_divisor,
        DIVIDE=divide,
        NUM_ROWS=rows.shape[0],
        ACCUMULATE=accumulate,
        BLOCK=block,
        NUM_PROGRAMS=programs,
        STREAMING=streaming,
        num_warps=num_warps,
    )


def accumulate_beside(
    rows: torch.Tensor, out: torch.Tensor, *, accumulate: bool, divisor: float, num_ctas: int
) -> None:
    """:func:`accumulate_rows` as TIDE-RS phase 1 runs it: on CUDA on the
    low-priority ``tide_rs_accumulate`` stream (``streams``), ordered after
    everything queued on the current stream (the round's copies) and before anything
    it queues next (the next round's barrier, so no peer overwrites ``rows`` early);
    on the CPU inline."""
    if rows.device.type != "cuda":
        accumulate_rows(rows, out, accumulate=accumulate, divisor=divisor, num_ctas=num_ctas)
        return
    streams.run_beside(
        streams.stream("tide_rs_accumulate", rows.device),
        lambda: accumulate_rows(
            rows, out, accumulate=accumulate, divisor=divisor, num_ctas=num_ctas
        ),
    )
