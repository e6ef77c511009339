"""The global ranks of a process group, cached per group (on every collective's path:
point-to-point peers, set-up scopes, watchdog reports)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["clear_global_ranks", "global_rank", "group_global_ranks"]

# Keyed by the group object itself (a strong reference: no other group can reuse
# its address while it is here); cleared when the last TIDE model is removed.
_GLOBAL_RANKS: dict[dist.ProcessGroup, tuple[int, ...]] = {}


def group_global_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """``dist.get_process_group_ranks(group)``, cached per group."""
    ranks = _GLOBAL_RANKS.get(group)
    if ranks is None:
        ranks = _GLOBAL_RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return ranks


def global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    """``dist.get_global_rank(group, group_rank)``, through :func:`group_global_ranks`."""
    return group_global_ranks(group)[group_rank]


def clear_global_ranks() -> None:
    _GLOBAL_RANKS.clear()
