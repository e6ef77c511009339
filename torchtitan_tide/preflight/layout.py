"""The job's layout as the checks use it: the FSDP mesh TorchTitan builds for this config, and
how TIDE splits each FSDP group into nodes.

:func:`job_layout` builds TorchTitan's own meshes (``ParallelDims`` of the job's
``[parallelism]``, as the trainer does) and takes the data-parallel mesh its
``parallelize`` functions give ``fully_shard`` (``["dp_replicate", "fsdp"]`` under HSDP,
else ``"fsdp"``). Every rank's :class:`~torchtitan_tide.comm.plans.topology.RankInfo` is gathered
once; TIDE's nodes of this rank's FSDP group are resolved with the very functions install
uses (``topology.node_keys``, ``topology.resolve_local_world_size``) and the run's
``[tide]`` options, so the tiers here are the ones TIDE will run:

- node-local tier: the ranks of this rank's node in its FSDP group;
- cross-node tier: the ranks of its FSDP group with the same local index on every node
  (TIDE's cross-node exchanges run between them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_tide.comm.options import TideOptions
from torchtitan_tide.comm.plans import topology
from torchtitan_tide.comm.plans.plan import WorldLayout
from torchtitan_tide.preflight.bounds import Control


@dataclass
class JobLayout:
    """This rank's view of the job (module docstring)."""

    rank: int
    world_size: int
    device: torch.device
    control: Control
    degrees: dict[str, int]
    dp_mesh: Any  # DeviceMesh given to fully_shard, or None (no FSDP in this job)
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    shard_ranks: tuple[int, ...]  # global ranks of this rank's FSDP group, in group order
    infos: list[topology.RankInfo]  # every rank's, by global rank
    tide: WorldLayout | None  # TIDE's nodes x ranks of this rank's FSDP group
    tide_source: str  # how TIDE found it (or why it could not)

    @property
    def shard_rank(self) -> int:
        return self.shard_ranks.index(self.rank)

    def node_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's node in its FSDP group (TIDE's nodes)."""
        if self.tide is None:
            return (self.rank,)
        node = self.tide.node_of(self.shard_rank)
        return tuple(self.shard_ranks[r] for r in self.tide.node_ranks(node))

    def tier_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's cross-node tier (same local index, every node)."""
        if self.tide is None:
            return (self.rank,)
        local = self.tide.local_of(self.shard_rank)
        return tuple(self.shard_ranks[self.tide.rank_of(n, local)]
                     for n in range(self.tide.num_nodes))  # fmt: skip


def _parallel_dims(job_config: Any, world_size: int):
    from torchtitan.distributed import ParallelDims

    p = job_config.parallelism
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree, world_size=world_size,
    )  # fmt: skip


def job_layout(
    job_config: Any, device: torch.device, control: Control, options: TideOptions
) -> JobLayout:
    """The layout of this job (module docstring). Collective over every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dims = _parallel_dims(job_config, world_size)
    dims.build_mesh()
    degrees = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
               "tp": dims.tp, "pp": dims.pp, "ep": dims.ep}  # fmt: skip
    dp_mesh = shard_group = replicate_group = None
    if dims.fsdp_enabled:
        if dims.dp_replicate_enabled:
            dp_mesh = dims.get_mesh(["dp_replicate", "fsdp"])
            shard_group, replicate_group = dp_mesh.get_group("fsdp"), dp_mesh.get_group(
                "dp_replicate")  # fmt: skip
        else:
            dp_mesh = dims.get_mesh("fsdp")
            shard_group = dp_mesh.get_group()
    shard_ranks = (
        tuple(dist.get_process_group_ranks(shard_group)) if shard_group is not None else (rank,)
    )
    infos = control.gather(topology.local_rank_info(device))
    tide, source = None, "no FSDP group (data_parallel_shard_degree x context_parallel_degree = 1)"
    if shard_group is not None:
        keys = topology.node_keys([infos[r] for r in shard_ranks])
        try:
            lws, source = topology.resolve_local_world_size(options, keys)
            tide = WorldLayout(len(shard_ranks), lws)
        except ValueError as exc:
            source = str(exc)
    return JobLayout(rank, world_size, device, control, degrees, dp_mesh, shard_group,
                     replicate_group, shard_ranks, infos, tide, source)  # fmt: skip
