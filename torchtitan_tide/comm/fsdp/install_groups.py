"""The FSDP groups ``install`` may give TIDE, and what it decides for each, locally.

No collective here: :func:`select_candidates` (which groups TIDE may take, and why the
others take FSDP2's path), :func:`resolve_layouts` (nodes x ranks, CUDA P2P to the local
peers), :func:`choose_transports` (this rank's proposal, from ``plans.topology``),
:func:`settle_transports` (one transport for every rank of a group, from the proposals
``install`` gathered) and :func:`build_plans` (each group's ``plans.plan.GroupPlan``).
``install.py`` runs them between its agreements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..options import TideOptions
from ..plans import topology
from ..plans.plan import ParamSpec, WorldLayout, build_group_plan
from . import internals as fsdp_internals
from .internals import fsdp_param_groups

__all__ = [
    "Candidate", "build_plans", "choose_transports", "log_transports", "resolve_layouts",
    "select_candidates", "settle_transports",
]  # fmt: skip


@dataclass
class Candidate:
    """One FSDP param group TIDE may take, with what install decided for it."""

    fqn: str
    pg: object  # FSDPParamGroup
    group: dist.ProcessGroup
    device: torch.device
    root: str
    kind: str | None = None  # "windows" | "copy_engine" | "p2p" | None (FSDP2's path)
    why: str = ""
    plan: object = None  # GroupPlan
    layout: WorldLayout | None = None
    access: tuple[bool, str] = (False, "")  # topology.local_peer_access
    backend: str = ""
    fallback: str | None = None  # the kind ``auto`` takes if the windows fail
    fallback_why: str = ""


def select_candidates(model: nn.Module, decisions: list[str]) -> list[Candidate]:
    """The groups TIDE may take (no collectives); the others' reasons go to ``decisions``."""
    roots = fsdp_internals.group_root_fqns(model)
    cands: list[Candidate] = []
    for fqn, pg in fsdp_param_groups(model):
        group = fsdp_internals.shard_group(pg)
        device = pg.device
        if group is None:
            decisions.append(f"{fqn}: FSDP2 path (replicate-only mesh: nothing to all-gather)")
        elif group.size() == 1:
            decisions.append(f"{fqn}: FSDP2 path (group of 1 rank: FSDP2 skips the all-gather)")
        elif device.type not in ("cuda", "cpu"):
            decisions.append(f"{fqn}: FSDP2 path (device {device.type} not supported)")
        elif (reason := fsdp_internals.custom_comm_reason(pg)) is not None:
            decisions.append(f"{fqn}: FSDP2 path ({reason} set on this group)")
        else:
            cands.append(Candidate(fqn, pg, group, device, roots.get(id(pg), "<root>")))
    return cands


def resolve_layouts(
    cands: list[Candidate],
    options: TideOptions,
    infos: dict[int, list[topology.RankInfo]],
) -> None:
    """Per candidate: layout, CUDA P2P to its local peers, backend (local only)."""
    for c in cands:
        rank_infos = infos[id(c.group)]
        lws, lws_source = topology.resolve_local_world_size(options, topology.node_keys(rank_infos))
        layout = WorldLayout(c.group.size(), lws)
        c.access = (
            topology.local_peer_access(rank_infos, layout, c.group.rank())
            if c.device.type == "cuda" and lws > 1
            else (False, "not CUDA" if c.device.type != "cuda" else "no node-local peers")
        )
        c.backend = str(dist.get_backend(c.group))
        c.layout = layout
        c.why = f"{layout.shape} ({lws_source})"


def choose_transports(cands: list[Candidate], options: TideOptions, probes: dict) -> None:
    """Per candidate: this rank's transport proposal, given what the one-sided probe of its
    process group found (``probes``, agreed by every rank of the group)."""
    for c in cands:
        assert c.layout is not None
        found = probes.get((id(c.group), c.device))
        windows = (
            (False, "") if found is None or found.api is None
            else (True, found.api.version()) if found.capable else (False, found.reason)
        )  # fmt: skip
        kind, why, fallback = topology.choose_transport(
            options, c.layout, c.device, c.backend, c.access, windows
        )
        c.kind, c.fallback = kind, fallback
        c.why = f"{why}; {c.why}"
        if fallback is not None:
            _, c.fallback_why, _ = topology.choose_transport(
                options, c.layout, c.device, c.backend, c.access, (False, "set-up failed")
            )


def settle_transports(cands: list[Candidate], gathered: dict[int, list[dict]]) -> None:
    """Every rank of a group takes the same transport: the copy engine only where
    every rank proposed it, else point-to-point where every rank can, else FSDP2's
    path (the reason names the ranks that differ)."""
    for i, c in enumerate(cands):
        kinds = [item["kinds"][i] for item in gathered[id(c.group)]]
        if len(set(kinds)) == 1:
            continue
        differ = sorted(r for r, k in enumerate(kinds) if k != c.kind)
        c.kind = None if None in kinds else "p2p"
        c.why = (
            f"ranks disagree ({dict(enumerate(kinds))}; group ranks {differ} differ from this "
            f"rank): {'point-to-point' if c.kind else 'FSDP2 path'} on every rank"
        )


def build_plans(
    cands: list[Candidate], decisions: list[str] | None, fqns: dict[int, str], pacing: int
) -> list[Candidate]:
    """Plan every candidate with a transport (local); ``fqns``: parameter names;
    ``pacing``: the most point-to-point chunks per wave (``TideOptions.pacing``);
    ``decisions`` None: plan only (the log lines come once the transports are final)."""
    taken = []
    for c in cands:
        if c.kind is None:
            if decisions is not None:
                decisions.append(f"{c.fqn}: FSDP2 path ({c.why})")
            continue
        specs = [
            ParamSpec(
                fqn=fsdp_internals.param_fqn(fp, fqns),
                shard_numel=fp._sharded_param_data.numel(),
                dtype=str(fsdp_internals.ag_dtype(fp, c.pg)),
                unsupported=fsdp_internals.unsupported_param_reason(fp),
            )
            for fp in c.pg.fsdp_params
        ]
        assert c.layout is not None
        c.plan = build_group_plan(
            specs, c.layout, c.group.rank(), pull_local=c.kind in ("copy_engine", "windows"),
            pacing=pacing,
        )
        if not c.plan.uses_tide:
            if decisions is not None:
                decisions.append(f"{c.fqn}: FSDP2 path ({c.plan.fallback_reason})")
            continue
        taken.append(c)
    return taken


def log_transports(taken: list[Candidate], decisions: list[str]) -> None:
    for c in taken:
        decisions.append(
            f"{c.fqn}: transport={c.kind} ({c.why}); {len(c.plan.params)} params, "
            f"dtypes {list(c.plan.dtypes)}"
        )
