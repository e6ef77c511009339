"""FSDP2 at world size 1, for profiling one rank's work of a multi-GPU step on one GPU.

TorchTitan 0.2.2 applies no FSDP at world size 1: the one-GPU trainer keeps fp32 weights
and runs forward under ``torch.autocast``, which is not the work a rank of an N-GPU FSDP2
job does (bf16 unsharded weights, FSDP2's hooks, copy-in / copy-out, fp32 gradient
reduce). With ``TIDE_FSDP_AT_WORLD_SIZE_1=1`` a one-process run applies FSDP2 over a
real one-rank ``fsdp`` mesh instead (TorchTitan would give a size-1 dimension a fake
process group), so one GPU runs, per step, the compute of one rank of an N-rank job with
the same per-rank batch. What differs from such a rank, by construction: the shards are
the whole model (optimizer, grad-norm clip and FSDP2's layout copies work on N times the
rank's numel) and the collectives have no peer (copies inside one GPU).

This is for benchmarks (``scripts/bench/bench_step.py --fsdp-at-world-size-1``; the
simulator reports the in-step level such a step measures, docs/design/2026-12-02-simulator.md),
not for training runs.
:func:`install` patches two named members of ``ParallelDims`` (reversible:
:func:`uninstall`); the training entry point calls it when the variable is set and
refuses it in a run of more than one process.
"""

import os
from typing import Any

ENV = "TIDE_FSDP_AT_WORLD_SIZE_1"

_originals: dict[str, object] = {}


def requested(environ: Any = os.environ) -> bool:
    """True when ``TIDE_FSDP_AT_WORLD_SIZE_1`` asks for it ("1"); "0" or unset: False.
    Raises ``ValueError`` naming the variable for any other value."""
    value = environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}={value!r} is not valid; use 1 (FSDP2 at world size 1) or 0")
    return value == "1"


def _fsdp_enabled(self: Any) -> bool:
    return True if self.world_size == 1 else _originals["fsdp_enabled"].fget(self)  # type: ignore[attr-defined]


def _mesh_exist(self: Any, name: str, degree: int) -> bool:
    if name == "fsdp" and self.world_size == 1:
        return True  # a real one-rank process group, not TorchTitan's fake one
    return _originals["_mesh_exist"](self, name, degree)  # type: ignore[operator]


def install(world_size: int) -> None:
    """Make TorchTitan apply FSDP2 at world size 1. ``world_size``: the run's process
    count; raises ``ValueError`` naming the variable when it is not 1. Idempotent."""
    if world_size != 1:
        raise ValueError(
            f"{ENV}=1 is for one-process runs (it profiles one rank's work on one GPU); this "
            f"run has WORLD_SIZE={world_size}, where FSDP2 is applied anyway: unset {ENV}"
        )
    if _originals:
        return
    from torchtitan.distributed.parallel_dims import ParallelDims  # not at import: see train.py

    _originals["fsdp_enabled"] = ParallelDims.__dict__["fsdp_enabled"]
    _originals["_mesh_exist"] = ParallelDims.__dict__["_mesh_exist"]
    ParallelDims.fsdp_enabled = property(_fsdp_enabled)  # type: ignore[assignment,method-assign]
    ParallelDims._mesh_exist = _mesh_exist  # type: ignore[method-assign]


def uninstall() -> None:
    """Undo :func:`install` (no-op when not installed)."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    for name, original in _originals.items():
        setattr(ParallelDims, name, original)
    _originals.clear()


def installed() -> bool:
    return bool(_originals)
