"""Topology of one FSDP process group: which of its ranks share a node, and what TIDE
can use between them.

At install every rank of a process group contributes one :class:`RankInfo`
(:func:`local_rank_info`, gathered by install's first agreement); the rest is computed
from the gathered list, identically on every rank:

- nodes (:func:`node_keys`, :func:`resolve_local_world_size`): a node is the kernel
  boot (``/proc/sys/kernel/random/boot_id``: containers on one machine share it, two
  machines never do) plus the launcher's node rank (torchrun's ``GROUP_RANK``, else
  ``SLURM_NODEID``), so identical host names (containers) do not merge nodes and two
  launchers on one machine are two nodes; the host name is the last resort;
- node-local groups (:func:`node_local_group_ranks`, :func:`make_node_local_group`):
  the group ranks of each node, mapped to global ranks for ``dist.new_group``;
- the transport (:func:`choose_transport`): the copy engine needs CUDA, P2P access to
  the GPUs of the node's OTHER ranks of this group (found by device UUID, not every
  visible GPU), and a backend with point-to-point when there is more than one node;
  point-to-point needs a backend that has it (:func:`backend_has_p2p`).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from functools import cache

import torch
import torch.distributed as dist

from ..options import TideOptions
from .group_sizes import check_local_world_size
from .plan import WorldLayout

__all__ = [
    "RankInfo",
    "backend_has_p2p",
    "choose_transport",
    "local_peer_access",
    "local_rank_info",
    "make_node_local_group",
    "node_keys",
    "node_local_group_ranks",
    "resolve_local_world_size",
    "shares_device",
    "windows_wanted",
]

logger = logging.getLogger(__name__)

SHARED_GPU = "run on this rank's GPU"  # local_peer_access's words for a shared device
# Backends whose process groups implement isend/irecv/batch_isend_irecv.
_P2P_BACKENDS = ("nccl", "gloo", "mpi", "xccl")


@dataclass(frozen=True)
class RankInfo:
    """What one rank tells its group at install."""

    host: str
    boot_id: str  # "" where /proc has none
    launcher_node: str  # torchrun GROUP_RANK or SLURM_NODEID; "" when neither is set
    device_uuid: str  # CUDA device UUID; "" on CPU
    global_rank: int


@cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def local_rank_info(device: torch.device) -> RankInfo:
    launcher_node = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", ""))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return RankInfo(socket.gethostname(), _boot_id(), launcher_node, _device_uuid(device), rank)


def node_keys(infos: list[RankInfo]) -> list[str]:
    """One string per rank; equal strings = same node (module docstring)."""
    return [f"{i.boot_id or i.host}/{i.launcher_node}" for i in infos]


def resolve_local_world_size(options: TideOptions, keys: list[str]) -> tuple[int, str]:
    """Ranks per node of a group whose rank ``r`` is on node ``keys[r]``; returns
    ``(local_world_size, how it was found)``.

    The option wins (it must divide the group size:
    :func:`~.group_sizes.check_local_world_size`, a ``ValueError``). Otherwise
    the nodes decide: if every node holds one contiguous, equal-size block of group
    ranks, that block size; if not (e.g. an FSDP group strided across nodes with
    tensor parallelism inside the node), 1: every rank is treated as its own node,
    which is always correct (point-to-point only)."""
    world = len(keys)
    if options.local_world_size is not None:
        lws = options.local_world_size
        check_local_world_size(lws, {"this FSDP group": world})
        return lws, "option local_world_size"
    runs: list[list] = []  # [node key, count] per run of equal consecutive keys
    for key in keys:
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    if len({k for k, _ in runs}) == len(runs) and len({c for _, c in runs}) == 1:
        return runs[0][1], f"{len(runs)} node(s) with {runs[0][1]} consecutive group ranks each"
    return 1, "ranks of a node are not one contiguous equal-size block: one rank per node"


def node_local_group_ranks(layout: WorldLayout) -> list[list[int]]:
    """GROUP ranks of every node's node-local group, node by node."""
    return [list(layout.node_ranks(node)) for node in range(layout.num_nodes)]


def shares_device(infos: list[RankInfo], layout: WorldLayout, rank: int) -> list[int]:
    """Group ranks of this rank's node that run on this rank's GPU (other than itself)."""
    me = infos[rank]
    if not me.device_uuid:
        return []
    return [r for r in layout.node_ranks(layout.node_of(rank))
            if r != rank and infos[r].device_uuid == me.device_uuid]  # fmt: skip


def local_peer_access(infos: list[RankInfo], layout: WorldLayout, rank: int) -> tuple[bool, str]:
    """Whether this rank's GPU can reach, by CUDA P2P, the GPU of every OTHER rank of
    its node in this group (looked up by UUID among the GPUs visible here), each on a GPU
    of its own (torch's symmetric memory refuses two ranks of one device)."""
    me = infos[rank]
    if not me.device_uuid:
        return False, "not CUDA"
    if shared := shares_device(infos, layout, rank):
        return False, (f"group ranks {shared} {SHARED_GPU} (torch's symmetric memory refuses "
                       "two ranks of one device)")  # fmt: skip
    visible = {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }
    my_index = visible[me.device_uuid]
    peers = [r for r in layout.node_ranks(layout.node_of(rank)) if r != rank]
    hidden = [r for r in peers if infos[r].device_uuid not in visible]
    if hidden:
        return (
            False,
            f"the GPUs of group ranks {hidden} are not visible here (CUDA_VISIBLE_DEVICES)",
        )
    blocked = [
        r for r in peers
        if not torch.cuda.can_device_access_peer(my_index, visible[infos[r].device_uuid])
    ]  # fmt: skip
    if blocked:
        return False, f"no CUDA P2P access to the GPUs of group ranks {blocked}"
    return True, f"CUDA P2P to the GPUs of the {len(peers)} other rank(s) of this node"


def backend_has_p2p(backend: str) -> bool:
    """Whether a process group of ``backend`` (``dist.get_backend``'s string, e.g.
    ``"cpu:gloo,cuda:nccl"``) can run isend/irecv."""
    return any(name in backend.lower() for name in _P2P_BACKENDS)


def windows_wanted(options: TideOptions, layout: WorldLayout, peer_access: tuple[bool, str]) -> bool:
    """Whether :func:`choose_transport` takes NCCL windows where they can run: forced, or
    under ``auto`` across nodes (unless ``cross_node_transport = "p2p"``) and between local
    peers that torch's symmetric memory cannot join (a shared GPU, no CUDA P2P)."""
    if options.transport == "nccl_windows":
        return True
    if options.transport != "auto":
        return False
    if layout.num_nodes > 1:
        return options.cross_node_transport != "p2p"
    return layout.local_world_size > 1 and not peer_access[0]


def choose_transport(
    options: TideOptions,
    layout: WorldLayout,
    device: torch.device,
    backend: str,
    peer_access: tuple[bool, str],
    windows: tuple[bool, str] = (False, "not probed"),
) -> tuple[str | None, str, str | None]:
    """``(transport kind "windows" | "copy_engine" | "p2p" | None, reason, fallback)``;
    None: no TIDE transport can run on this group (FSDP2's path); ``fallback``: the kind
    ``auto`` takes if the windows' set-up fails (None: not windows, or forced). Raises
    ``ValueError`` for a forced transport that cannot work here. ``peer_access``: this
    rank's :func:`local_peer_access`; ``windows``: whether every rank of the group can use
    NCCL windows (``transports.windows.connect.probe``), and why (not)."""
    backend = backend.lower()
    forced = options.transport
    shape = layout.shape
    if forced == "nccl_windows":
        if not windows[0]:
            raise ValueError(
                f"tide option transport='nccl_windows' ([tide] ag_transport) cannot run here: "
                f"{windows[1]}; use 'auto'"
            )
        if layout.num_nodes > 1 and options.cross_node_transport == "p2p":
            raise ValueError(
                "[tide] ag_transport = 'nccl_windows' moves the cross-node all-gather by "
                "one-sided puts, but [tide] cross_node_transport = 'p2p' asks for send/recv; "
                "set one of them to 'auto'"
            )
        return "windows", f"forced by option transport='nccl_windows' ({windows[1]})", None
    kind, why = _without_windows(options, layout, device, backend, peer_access)
    if forced != "auto" or not windows_wanted(options, layout, peer_access):
        return kind, why, None
    if not windows[0]:
        return kind, why + (f" (NCCL windows: {windows[1]})" if windows[1] else ""), None
    if layout.num_nodes > 1:
        detail = ("one-sided puts across nodes" + (", copy-engine puts in the node"
                  if layout.local_world_size > 1 else ""))  # fmt: skip
    else:
        detail = f"copy-engine puts between local peers ({peer_access[1]})"
    return "windows", f"auto: {shape}: NCCL windows, {detail} ({windows[1]})", kind


def _without_windows(
    options: TideOptions,
    layout: WorldLayout,
    device: torch.device,
    backend: str,
    peer_access: tuple[bool, str],
) -> tuple[str | None, str]:
    """The transport of a group without NCCL windows (:func:`choose_transport`)."""
    p2p_ok = backend_has_p2p(backend)
    forced = options.transport
    if forced == "copy_engine":
        if device.type != "cuda" or (layout.num_nodes > 1 and "nccl" not in backend):
            raise ValueError(
                f"tide option transport='copy_engine' ([tide] ag_transport) needs CUDA "
                f"parameters (and an NCCL group across nodes) (device={device.type}, "
                f"backend={backend}); use 'auto', or 'gloo' on CPU"
            )
        if SHARED_GPU in peer_access[1]:
            raise ValueError(
                f"tide option transport='copy_engine' ([tide] ag_transport) cannot run here: "
                f"{peer_access[1]}; use 'auto' or 'nccl_windows'"
            )
        return "copy_engine", "forced by option transport='copy_engine'"
    if forced in ("nccl_p2p", "gloo"):
        want_device, want_backend = ("cuda", "nccl") if forced == "nccl_p2p" else ("cpu", "gloo")
        if device.type != want_device or want_backend not in backend:
            raise ValueError(
                f"tide option transport={forced!r} ([tide] ag_transport) needs "
                f"{want_device.upper()} parameters and a {want_backend} group "
                f"(device={device.type}, backend={backend}); use 'auto'"
            )
        return "p2p", f"forced by option transport={forced!r}"
    shape = layout.shape
    no_p2p = f"backend {backend!r} has no point-to-point"
    if layout.local_world_size > 1 and peer_access[0]:
        if layout.num_nodes == 1:
            return "copy_engine", f"auto: {shape}, {peer_access[1]}"
        if p2p_ok:
            return "copy_engine", (
                f"auto: {shape}, {peer_access[1]}; cross-node phase over {backend} p2p"
            )
        return None, f"auto: {shape} needs a cross-node phase but {no_p2p}"
    if not p2p_ok:
        return None, f"auto: {shape}: {no_p2p} and the copy engine cannot run here"
    if layout.local_world_size == 1:
        return "p2p", f"auto: {shape}: no node-local peers, point-to-point over {backend}"
    return "p2p", f"auto: {shape} but {peer_access[1]}: point-to-point over {backend}"


def make_node_local_group(
    group: dist.ProcessGroup,
    layout: WorldLayout,
    global_ranks: list[int],
    timeout_s: float | None = None,
) -> dist.ProcessGroup | None:
    """The process group of this rank's node within ``group`` (one node: the group
    itself), or None when it cannot be made. Collective over this rank's node only:
    ``dist.new_group(..., use_local_synchronization=True)`` of the node's GLOBAL ranks,
    which only the members call and which needs no device bound to the default group
    (``dist.split_group`` does, and TorchTitan's ``init_distributed`` binds none).
    Every rank creates its node groups in model order, so overlapping ones (e.g. the
    dense and the expert FSDP group of one node) are created in the same order.
    ``timeout_s``: the bound of the creation barrier (``[tide] install_timeout_s``; None:
    the default process-group timeout); the group runs no collective of its own (it
    names the symmetric-memory rendezvous), so the bound is all it changes."""
    if layout.num_nodes == 1:
        return group
    node = layout.node_of(group.rank())
    members = [global_ranks[r] for r in node_local_group_ranks(layout)[node]]
    try:
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        return dist.new_group(ranks=members, timeout=timeout, use_local_synchronization=True)
    except Exception as e:  # noqa: BLE001 - any failure means "no node-local group"
        logger.warning("TIDE: the node-local group of ranks %s could not be made: %s", members, e)
        return None
