"""The FSDP process groups TorchTitan 0.2.2 builds, by size, and the check of
``[tide] local_world_size`` against them: one function for the launcher (before any
process starts), the train spec (before ``comm.apply``) and ``install`` (per group).

``ParallelDims.build_mesh`` shards dense parameters over ``fsdp = dp_shard x cp`` and,
with expert parallelism (``ep > 1``), routed experts over
``efsdp = dp_shard x cp x tp / (ep x etp)``; TIDE's nodes are blocks of
``local_world_size`` consecutive ranks of each such group, so the value must divide
every group that has more than one rank (a group of one gathers nothing).
"""

from __future__ import annotations

from ..options import TideOptionError

__all__ = ["check_local_world_size", "fsdp_group_sizes"]


def fsdp_group_sizes(
    dp_shard: int, cp: int = 1, tp: int = 1, ep: int = 1, etp: int = 1
) -> dict[str, int]:
    """``{description: ranks}`` of the FSDP groups TorchTitan builds for these degrees
    (``dp_shard`` already resolved from -1), groups of one rank left out."""
    sizes = {f"fsdp = dp_shard {dp_shard} x cp {cp}": dp_shard * cp}
    if ep > 1:
        sizes[f"efsdp = dp_shard {dp_shard} x cp {cp} x tp {tp} / (ep {ep} x etp {etp})"] = (
            dp_shard * cp * tp // (ep * etp)
        )
    return {name: size for name, size in sizes.items() if size > 1}


def check_local_world_size(
    local_world_size: int | None, sizes: dict[str, int], label: str = ""
) -> None:
    """``local_world_size`` (None or 0: detected, always valid) must divide every
    group of ``sizes`` (:func:`fsdp_group_sizes`, or install's own groups). ``label``:
    how the message names the setting (default ``[tide] local_world_size = N``).

    Raises:
        TideOptionError: naming the key, the groups it does not divide and the values
            that work.
    """
    if not local_world_size or not sizes:
        return
    bad = [f"{size} ({name})" for name, size in sizes.items() if size % local_world_size]
    if not bad:
        return
    common = [
        d for d in range(1, min(sizes.values()) + 1) if all(s % d == 0 for s in sizes.values())
    ]
    label = label or f"[tide] local_world_size = {local_world_size}"
    raise TideOptionError(
        f"{label} must divide the FSDP group size {' and '.join(bad)} (ranks per node as "
        f"TIDE sees them); use one of {common}, or 0 to detect the nodes (kernel boot id "
        "and launcher node rank)"
    )
