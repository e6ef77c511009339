"""``comm = "symm_mem"``: stock FSDP2 with its collective buffers in NCCL symmetric memory.

The strongest public FSDP2 baseline (docs/design/2026-11-29-h200-facts.md and
docs/design/2026-11-30-symm-mem.md). FSDP2 keeps its flat
rank-major buffers, copy-in, copy-out and streams; only the buffers change: they come from
``torch.distributed._symmetric_memory``'s NCCL pool (memory NCCL registers as a window) and
are rendezvoused before each collective, so a plain ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` takes NCCL's symmetric paths by itself:

- all-gather: with NCCL's zero-CTA policy (``NCCL_CTA_POLICY=2`` when the communicator is
  created, NCCL >= 2.28) a copy-engine all-gather, no kernel on the SMs; without it
  ``ncclSymkDevKernel_AllGather_*``;
- reduce-scatter: ``ncclSymkDevKernel_ReduceScatter_*_sum_*``. The symmetric kernels reduce
  with SUM only, so force-sum reduction is set (FSDP divides after the collective, if at all).

Two implementations, one contract:

- ``"native"`` (torch >= 2.12): FSDP's own ``set_force_sum_reduction_for_comms(True)`` then
  ``set_symm_mem_for_comm("NCCL")`` on every FSDP module (FSDP's ``SymmMemAllGather`` /
  ``SymmMemReduceScatter``).
- ``"custom"`` (torch 2.11 has no ``set_symm_mem_for_comm``): :class:`SymmMemAllGather` and
  :class:`SymmMemReduceScatter` below through the public ``set_custom_all_gather`` /
  ``set_custom_reduce_scatter``; they also check and count every buffer they register.

:func:`apply` decides once per FSDP process group, identically on all its ranks: CUDA
parameters, an NCCL process group, NCCL >= 2.27, the NCCL symmetric-memory backend, P2P
between the GPUs of one host, one CTA policy; then a probe (pool allocation, rendezvous, one
all-gather and one SUM reduce-scatter on symmetric buffers, results checked) and a log line
per rank saying what is in effect. A hardware/software limit raises
:class:`SymmMemUnavailable` (``[tide] fallback = "fsdp2"`` may catch it); a missing zero-CTA
policy raises :class:`ZeroCtaPolicyError` (a launch mistake, never a silent fallback).

Buffers: FSDP owns every buffer, as in stock FSDP2. Freed buffers go back to the symmetric
pool, which keeps its segments (and their NCCL registration) for the life of the process,
also after :func:`remove`. Gradients are views of the reduce-scatter output, so they live in
the pool until ``zero_grad(set_to_none=True)``.

FSDP internals read here: ``FSDPParamGroup._all_gather_comm`` / ``_reduce_scatter_comm`` /
``force_sum_reduction_for_comms`` (saved by apply, restored by remove, checked after
install), the groups' process groups and device (through ``fsdp.internals.fsdp_param_groups``).
Everything else goes through public ``FSDPModule`` methods.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .base import streams
from .fsdp.internals import fsdp_param_groups

__all__ = [
    "ZERO_CTA_ENV",
    "CtaPolicy",
    "SymmMemAllGather",
    "SymmMemOptions",
    "SymmMemReduceScatter",
    "SymmMemState",
    "SymmMemUnavailable",
    "ZeroCtaPolicyError",
    "apply",
    "group_problems",
    "remove",
    "resolve_cta_policy",
    "state",
]

logger = logging.getLogger(__name__)

CTA_POLICY_VAR = "NCCL_CTA_POLICY"
CTA_POLICY_ZERO = "2"
# What the launcher and the train entry set before any process group exists (launch/command.py keeps
# an equal copy so it need not import torch.distributed; a test checks they agree).
ZERO_CTA_ENV = {CTA_POLICY_VAR: CTA_POLICY_ZERO}
IMPLEMENTATIONS = ("auto", "native", "custom")
MIN_NCCL = (2, 27)  # symmetric kernels
MIN_NCCL_COPY_ENGINE = (2, 28)  # copy-engine collectives (zero-CTA policy)
_STATE_ATTR = "_tide_symm_mem"
_PROBE_NUMEL = 4096  # fp32 elements per rank
# torch 2.13 renamed the flat collectives (the old names warn); 2.11 has only the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_FIX = (
    "use comm = 'fsdp2', or set [tide] fallback = 'fsdp2' to run stock FSDP2 where symm_mem "
    "cannot run"
)


class SymmMemUnavailable(RuntimeError):
    """symm_mem cannot run here (device, backend, NCCL, P2P, symmetric-memory backend).
    Raised on every rank of the FSDP process group alike; the message names the cause and
    the fix."""


class ZeroCtaPolicyError(RuntimeError):
    """The zero-CTA policy is required but this process set no ``NCCL_CTA_POLICY``, so its
    NCCL communicators were created without it."""


@dataclass(frozen=True)
class SymmMemOptions:
    """Options of ``comm.apply(model, "symm_mem", **options)``.

    implementation:
        ``"auto"``: FSDP's ``set_symm_mem_for_comm`` where torch has it (>= 2.12), else
        ``"custom"``. ``"native"`` / ``"custom"`` force one (``"custom"`` runs on every
        supported torch; ``"native"`` raises where torch lacks it).
    zero_cta:
        Require NCCL's zero-CTA policy, so the all-gather runs on copy engines (the baseline).
        ``False``: allow a process without it (symmetric kernels for both collectives, for
        comparison runs only).
    """

    implementation: str = "auto"
    zero_cta: bool = True

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"symm_mem option implementation={self.implementation!r} is not one of "
                f"{IMPLEMENTATIONS}; use 'auto'"
            )
        if not isinstance(self.zero_cta, bool):
            raise TypeError(f"symm_mem option zero_cta={self.zero_cta!r} must be True or False")

    @classmethod
    def from_kwargs(cls, **options: object) -> SymmMemOptions:
        """Build from ``apply(**options)``; unknown names raise ``ValueError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown symm_mem option(s) {unknown}; valid options are {sorted(known)}"
            )
        return cls(**options)  # type: ignore[arg-type]


# ---------------------------------------------------------------- CTA policy


@dataclass(frozen=True)
class CtaPolicy:
    """The NCCL CTA policy this process's communicators were created with, as far as it can
    be known from here: NCCL reads ``NCCL_CTA_POLICY`` once, when it creates the first
    communicator; ``run_train.sh`` and ``torchtitan_tide.train`` set it before that."""

    value: str | None  # "2" is zero-CTA; None: not set (NCCL's default policy)
    source: str

    @property
    def zero(self) -> bool:
        return self.value == CTA_POLICY_ZERO

    def describe(self) -> str:
        what = (
            "zero-CTA: copy-engine all-gather"
            if self.zero
            else "not zero-CTA: NCCL kernels for the all-gather"
        )
        return f"{self.source} ({what})"


def resolve_cta_policy(
    environ: Mapping[str, str], options_zero: bool, zero_cta: bool
) -> tuple[CtaPolicy, str | None]:
    """The CTA policy in effect and a warning, if any.

    ``options_zero``: the process group's ``ProcessGroupNCCL.Options`` ask for the zero-CTA
    policy (``config.cta_policy``), which works without the variable.

    Raises:
        ZeroCtaPolicyError: ``zero_cta`` and neither the variable nor the options set it.
    """
    value = environ.get(CTA_POLICY_VAR) or None
    if options_zero:
        return CtaPolicy(CTA_POLICY_ZERO, "ProcessGroupNCCL options config.cta_policy"), None
    if value is None:
        if zero_cta:
            raise ZeroCtaPolicyError(
                f"comm = 'symm_mem' needs NCCL's zero-CTA policy ({CTA_POLICY_VAR}="
                f"{CTA_POLICY_ZERO}) when the NCCL communicator is created, but "
                f"{CTA_POLICY_VAR} is not set in this process, so its communicators were "
                "created without it. Launch with ./run_train.sh or python -m "
                f"torchtitan_tide.train (both set it), or export {CTA_POLICY_VAR}="
                f"{CTA_POLICY_ZERO} before init_process_group; comm.apply(model, 'symm_mem', "
                "zero_cta=False) runs the symmetric-kernel variant instead"
            )
        return CtaPolicy(None, f"{CTA_POLICY_VAR} not set (NCCL default policy)"), None
    policy = CtaPolicy(value, f"{CTA_POLICY_VAR}={value} in the environment")
    warning = None
    if zero_cta and not policy.zero:
        warning = (
            f"{CTA_POLICY_VAR}={value} was set by the environment and is kept; the symm_mem "
            f"baseline uses {CTA_POLICY_ZERO} (zero-CTA copy-engine all-gather), so this run "
            "measures a different variant"
        )
    elif not zero_cta and policy.zero:
        warning = (
            f"zero_cta=False but {CTA_POLICY_VAR}={value}: NCCL still runs the copy-engine "
            "all-gather"
        )
    return policy, warning


def _options_zero_cta(pg: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``pg`` was created with ``config.cta_policy = NCCL_CTA_POLICY_ZERO``."""
    nccl_pg = getattr(dist, "ProcessGroupNCCL", None)
    zero = getattr(nccl_pg, "NCCL_CTA_POLICY_ZERO", None)
    if zero is None:
        return False
    try:
        config = pg._get_backend(device).options.config
    except (AttributeError, RuntimeError):
        return False
    return getattr(config, "cta_policy", None) == zero


# ---------------------------------------------------------------- custom comms (torch 2.11)


@dataclass
class RegistrationStats:
    """What the custom comms registered, shared by all comms of one model (custom path only).

    ``buffers[role]`` maps each pool block seen, ``(data_ptr, nbytes)``, to the world size of
    its handle; ``calls[role]`` counts rendezvous calls. Roles: ``all_gather_output``,
    ``reduce_scatter_input``, ``reduce_scatter_output``."""

    buffers: dict[str, dict[tuple[int, int], int]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    non_sum_reduce_scatters: int = 0


def _attr(handle: object, name: str) -> object:
    """A handle attribute that is a property in some torch versions, a method in others."""
    value = getattr(handle, name, None)
    return value() if callable(value) else value


def _handle_problems(handle: object, group: dist.ProcessGroup, what: str) -> list[str]:
    if handle is None:
        return [f"rendezvous of the {what} returned no symmetric-memory handle"]
    problems = []
    for name, expect in (("world_size", group.size()), ("rank", group.rank())):
        got = _attr(handle, name)
        if got is not None and got != expect:
            problems.append(f"{what}: handle {name} {got} != process group {name} {expect}")
    return problems


def _register(
    tensor: torch.Tensor, group: dist.ProcessGroup, role: str, stats: RegistrationStats
) -> None:
    """Rendezvous ``tensor``'s pool block on ``group``: host-side, before the collective is
    enqueued (FSDP's ``SymmMem*`` comms of torch >= 2.12 do the same on every call). Torch
    keeps one handle per block and group, so a repeat is a lookup (the GPU test prints its
    cost); any call is made on every rank alike, since FSDP runs the same sequence of
    collectives everywhere. The first sight of a block is checked and counted."""
    handle = symm_mem.rendezvous(tensor, group.group_name)
    storage = tensor.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes())
    stats.calls[role] = stats.calls.get(role, 0) + 1
    seen = stats.buffers.setdefault(role, {})
    if key not in seen:
        problems = _handle_problems(handle, group, role)
        if problems:
            raise RuntimeError("symm_mem: " + "; ".join(problems))
        seen[key] = int(_attr(handle, "world_size") or group.size())


def _is_sum(op: object) -> bool:
    try:
        return bool(op == dist.ReduceOp.SUM)
    except (TypeError, RuntimeError):
        return False


class _SymmPoolAlloc:
    """Shared by the symm_mem comms: pool allocation and the registration counters."""

    def __init__(self, stats: RegistrationStats) -> None:
        self._stats = stats

    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """A buffer from the NCCL symmetric-memory pool of ``device`` (FSDP calls this in
        the same order with the same sizes on every rank, so the pools stay symmetric).
        FSDP owns the tensor; dropping it returns the block to the pool, registered."""
        with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device), device):
            return torch.empty(size, dtype=dtype, device=device)


def _off_legacy_stream(device: torch.device, collective: Callable[[], dist.Work | None]):
    """Run ``collective`` on the current stream, unless that is the legacy default
    stream: with the zero-CTA policy NCCL issues a synchronous collective as
    ``cudaMemcpyBatchAsync`` on the current stream, which rejects the legacy stream
    ("invalid argument", seen on 2x H200 when FSDP unshards outside forward/backward,
    e.g. an explicit ``module.unshard()``). Then it runs on a side stream that waits
    for, and is waited by, the current one (so buffer lifetimes stay ordered)."""
    if device.type != "cuda":
        return collective()
    if torch.cuda.current_stream(device).cuda_stream != 0:
        return collective()
    return streams.run_beside(streams.stream("symm_mem_side", device), collective)


class SymmMemAllGather(_SymmPoolAlloc, AllGather):
    """FSDP all-gather whose output buffer is symmetric memory. Runs on FSDP's all-gather
    stream (the caller's current stream); the input is a view of the output, so only the
    output is rendezvoused."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        _register(output_tensor, group, "all_gather_output", self._stats)
        return _off_legacy_stream(
            output_tensor.device,
            lambda: _all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op),
        )


class SymmMemReduceScatter(_SymmPoolAlloc, ReduceScatter):
    """FSDP reduce-scatter with input and output in symmetric memory. Runs on FSDP's
    reduce-scatter stream. NCCL's symmetric reduce-scatter is SUM only: another op (force-sum
    turned off later) still runs, on NCCL's regular kernels, and is counted and logged."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        _register(input_tensor, group, "reduce_scatter_input", self._stats)
        _register(output_tensor, group, "reduce_scatter_output", self._stats)
        if not _is_sum(op):
            self._stats.non_sum_reduce_scatters += 1
            if self._stats.non_sum_reduce_scatters == 1:
                logger.warning(
                    "symm_mem: reduce-scatter with op %s, not SUM: NCCL's symmetric kernel "
                    "does not apply (force-sum reduction was turned off?)",
                    op,
                )
        return _off_legacy_stream(
            output_tensor.device,
            lambda: _reduce_scatter_flat(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            ),
        )


# ---------------------------------------------------------------- checks


def _nccl_version() -> tuple[int, ...]:
    version = torch.cuda.nccl.version()
    if isinstance(version, int):  # old encoding: 2_28_09 -> (2, 28, 9)
        return (version // 10000, version // 100 % 100, version % 100)
    return tuple(int(v) for v in version[:3])


def _device_uuid(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"{socket.gethostname()}:cuda:{index}"


def _select_nccl_backend(device: torch.device) -> None:
    """Make NCCL the symmetric-memory backend of ``device`` and create its pool."""
    get_backend = getattr(symm_mem, "get_backend", None)
    try:
        symm_mem.set_backend("NCCL")
    except Exception as exc:  # torch raises RuntimeError or ValueError, by version
        raise SymmMemUnavailable(
            f"symm_mem.set_backend('NCCL') failed ({exc}): this torch build has no NCCL "
            f"symmetric-memory backend, or another backend already allocated. {_FIX}"
        ) from exc
    backend = None
    if get_backend is not None:
        try:
            backend = get_backend(device)
        except Exception:  # noqa: BLE001 - older builds raise before the first allocation
            backend = None
    if backend not in (None, "NCCL"):
        raise SymmMemUnavailable(
            f"symmetric memory on {device} already uses backend {backend!r} (an earlier "
            "allocation, e.g. comm = 'tide' in this process, fixed it); symm_mem needs the "
            f"NCCL backend: run it in a fresh process. {_FIX}"
        )
    try:
        symm_mem.get_mem_pool(device)
    except Exception as exc:
        raise SymmMemUnavailable(
            f"no NCCL symmetric-memory pool on {device} ({exc}). {_FIX}"
        ) from exc


def _local_status(device: torch.device, cta: CtaPolicy) -> dict:
    """This rank's facts for the group decision (plain data, sent with all_gather_object)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    peers = {
        _device_uuid(j): bool(torch.cuda.can_device_access_peer(index, j))
        for j in range(torch.cuda.device_count())
        if j != index
    }
    status = {
        "rank": dist.get_rank(),
        "host": socket.gethostname(),
        "device": f"cuda:{index}",
        "uuid": _device_uuid(index),
        "peers": peers,
        "cta": cta.value,
        "problem": None,
    }
    try:
        _select_nccl_backend(device)
    except SymmMemUnavailable as exc:
        status["problem"] = str(exc)
    return status


def group_problems(statuses: list[dict]) -> list[str]:
    """Why symm_mem cannot run on a process group whose ranks reported ``statuses`` (from
    :func:`_local_status`); empty when it can. Pure: every rank computes the same answer."""
    problems = [
        f"rank {s['rank']} ({s['host']} {s['device']}): {s['problem']}"
        for s in statuses
        if s["problem"]
    ]
    for i, a in enumerate(statuses):
        for b in statuses[i + 1 :]:
            if a["host"] != b["host"]:
                continue
            if a["uuid"] == b["uuid"]:
                problems.append(
                    f"ranks {a['rank']} and {b['rank']} share one GPU ({a['host']} "
                    f"{a['device']}); symmetric memory needs one GPU per rank"
                )
                continue
            for src, dst in ((a, b), (b, a)):
                if src["peers"].get(dst["uuid"]) is False:
                    problems.append(
                        f"rank {src['rank']} ({src['host']} {src['device']}) has no P2P "
                        f"access to rank {dst['rank']}'s GPU ({dst['device']}); NCCL's "
                        "symmetric memory needs P2P (NVLink) between the GPUs of a node"
                    )
    ctas = sorted({str(s["cta"]) for s in statuses})
    if len(ctas) > 1:
        problems.append(f"ranks disagree on {CTA_POLICY_VAR}: {ctas}; set one value everywhere")
    return problems


def _probe(pg: dist.ProcessGroup, device: torch.device) -> tuple[list[str], str]:
    """Collective on ``pg``: three pool buffers, rendezvous, one all-gather and one SUM
    reduce-scatter on them, results checked on the current stream (host-synchronizing).
    Returns (problems, description). The buffers go back to the pool afterwards."""
    world, rank, n = pg.size(), pg.rank(), _PROBE_NUMEL
    with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device), device):
        ag = torch.empty(world * n, dtype=torch.float32, device=device)
        rs_in = torch.empty(world * n, dtype=torch.float32, device=device)
        rs_out = torch.empty(n, dtype=torch.float32, device=device)
    problems: list[str] = []
    handles = []
    for what, tensor in (
        ("all-gather buffer", ag),
        ("reduce-scatter input", rs_in),
        ("reduce-scatter output", rs_out),
    ):
        handle = symm_mem.rendezvous(tensor, pg.group_name)
        handles.append(handle)
        problems += _handle_problems(handle, pg, what)
    shard = ag.narrow(0, rank * n, n)
    shard.fill_(rank + 1)
    k = torch.arange(world * n, device=device, dtype=torch.float32) % 1024
    rs_in.copy_(k + rank)
    # FSDP runs its collectives on its own streams; the probe must not use the
    # legacy default stream either (see _off_legacy_stream).
    _off_legacy_stream(device, lambda: _all_gather_flat(ag, shard, group=pg))
    _off_legacy_stream(
        device, lambda: _reduce_scatter_flat(rs_out, rs_in, op=dist.ReduceOp.SUM, group=pg)
    )
    expect = torch.arange(1, world + 1, device=device, dtype=torch.float32).repeat_interleave(n)
    if not torch.equal(ag, expect):
        problems.append("all-gather on symmetric buffers returned wrong data")
    expect = k.narrow(0, rank * n, n) * world + world * (world - 1) / 2
    if not torch.equal(rs_out, expect):
        problems.append("SUM reduce-scatter on symmetric buffers returned wrong data")
    size = _attr(handles[0], "buffer_size")
    description = (
        f"probe ok: rendezvous of 3 pool buffers (handle world {_attr(handles[0], 'world_size')}"
        f", all-gather block {size} bytes), all-gather and SUM reduce-scatter exact"
    )
    return problems, description


def _exchange(obj: object, pg: dist.ProcessGroup) -> list:
    out: list = [None] * pg.size()
    dist.all_gather_object(out, obj, group=pg)
    return out


def _process_groups(groups: list[tuple[str, object]]) -> list[dist.ProcessGroup]:
    """Distinct process groups FSDP's all-gathers and reduce-scatters run on, in model order
    (the same order on every rank)."""
    out: dict[str, dist.ProcessGroup] = {}
    for _, g in groups:
        candidates = [
            getattr(g, "_all_gather_process_group", None),
            getattr(g, "_reduce_scatter_process_group", None),
        ]
        post = getattr(g, "post_forward_mesh_info", None)
        if post is not None:  # reshard_after_forward=int: backward all-gathers use it
            candidates.append(post.shard_process_group)
        for pg in candidates:
            if pg is not None and pg.size() > 1:
                out.setdefault(pg.group_name, pg)
    return list(out.values())


def _resolve_implementation(requested: str) -> str:
    native = hasattr(FSDPModule, "set_symm_mem_for_comm")
    if requested == "native" and not native:
        raise ValueError(
            f"symm_mem implementation='native' needs FSDPModule.set_symm_mem_for_comm "
            f"(torch >= 2.12); torch {torch.__version__} lacks it: use 'auto' or 'custom'"
        )
    if requested == "auto":
        return "native" if native else "custom"
    return requested


# ---------------------------------------------------------------- install / remove


@dataclass
class _Saved:
    """One FSDP module's comms and force-sum flag before apply (restored by remove)."""

    module: FSDPModule
    groups: list  # its FSDPParamGroups
    all_gather_comms: list
    reduce_scatter_comms: list
    force_sum: bool


@dataclass
class SymmMemState:
    """What :func:`apply` installed on one model (``model.__dict__["_tide_symm_mem"]``)."""

    implementation: str  # "native" | "custom"
    cta: CtaPolicy
    nccl: str
    process_groups: list[str]
    probes: list[str]
    stats: RegistrationStats
    saved: list[_Saved] = field(repr=False, default_factory=list)


def state(model: nn.Module) -> SymmMemState | None:
    """What symm_mem installed on ``model``; None if it is not applied."""
    return model.__dict__.get(_STATE_ATTR)


def _is_default_comm(comm: object) -> bool:
    return type(comm).__name__ in ("DefaultAllGather", "DefaultReduceScatter")


def _restore(saved: list[_Saved]) -> None:
    for s in saved:
        for g, ag, rs in zip(s.groups, s.all_gather_comms, s.reduce_scatter_comms):
            g._all_gather_comm = ag
            g._reduce_scatter_comm = rs
        s.module.set_force_sum_reduction_for_comms(s.force_sum)


def _expected_classes(implementation: str) -> tuple[type, type]:
    if implementation == "native":
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

        return coll.SymmMemAllGather, coll.SymmMemReduceScatter
    return SymmMemAllGather, SymmMemReduceScatter


def _save(model: nn.Module, groups: list[tuple[str, object]]) -> list[_Saved]:
    """The comms of every FSDP module that has param groups; refuses customized comms."""
    modules = {name or "<root>": m for name, m in model.named_modules()}
    by_module: dict[str, list] = {}
    for fqn, g in groups:
        by_module.setdefault(fqn, []).append(g)
    saved = []
    for fqn, module_groups in by_module.items():
        for g in module_groups:
            ag, rs = g._all_gather_comm, g._reduce_scatter_comm
            if not (_is_default_comm(ag) and _is_default_comm(rs)):
                raise ValueError(
                    f"FSDP module {fqn} already has custom comms ({type(ag).__name__}, "
                    f"{type(rs).__name__}); symm_mem replaces FSDP's default comms only: "
                    "remove the other customization first"
                )
        saved.append(
            _Saved(
                module=modules[fqn],
                groups=module_groups,
                all_gather_comms=[g._all_gather_comm for g in module_groups],
                reduce_scatter_comms=[g._reduce_scatter_comm for g in module_groups],
                force_sum=bool(getattr(module_groups[0], "force_sum_reduction_for_comms", False)),
            )
        )
    return saved


def _install(
    model: nn.Module,
    groups: list[tuple[str, object]],
    implementation: str,
    stats: RegistrationStats,
) -> list[_Saved]:
    """Force-sum reduction, then symmetric-memory comms on every FSDP module with params;
    verified on every param group. All or nothing: a failure restores what was there."""
    saved = _save(model, groups)
    try:
        for s in saved:
            # Before set_symm_mem_for_comm: FSDP installs its symmetric reduce-scatter only
            # when force-sum is already on (NCCL's symmetric reduce-scatter is SUM only).
            s.module.set_force_sum_reduction_for_comms(True)
            if implementation == "native":
                s.module.set_symm_mem_for_comm("NCCL")
            else:
                s.module.set_custom_all_gather(SymmMemAllGather(stats))
                s.module.set_custom_reduce_scatter(SymmMemReduceScatter(stats))
        ag_cls, rs_cls = _expected_classes(implementation)
        wrong = [
            f"{fqn}: {type(g._all_gather_comm).__name__}/{type(g._reduce_scatter_comm).__name__}"
            f", force-sum {getattr(g, 'force_sum_reduction_for_comms', None)}"
            for fqn, g in groups
            if not (
                isinstance(g._all_gather_comm, ag_cls)
                and isinstance(g._reduce_scatter_comm, rs_cls)
                and getattr(g, "force_sum_reduction_for_comms", True)
            )
        ]
        if wrong:
            raise RuntimeError(
                f"symm_mem ({implementation}) did not take effect on FSDP param group(s) "
                f"{wrong}; expected {ag_cls.__name__}/{rs_cls.__name__} with force-sum"
            )
    except BaseException:
        _restore(saved)
        raise
    return saved


def _describe(
    implementation: str, device: torch.device, nccl: str, cta: CtaPolicy, n_groups: int,
    probes: list[str], hosts: int, peers: int,
) -> str:  # fmt: skip
    """The per-rank log line: what is in effect and how it was checked."""
    if implementation == "native":
        how = "FSDPModule.set_symm_mem_for_comm"
    else:
        how = "custom AllGather/ReduceScatter through set_custom_all_gather/_reduce_scatter"
        if not hasattr(FSDPModule, "set_symm_mem_for_comm"):
            how += f"; torch {torch.__version__} has no set_symm_mem_for_comm"
    parts = [
        f"{implementation} implementation ({how})",
        (
            f"FSDP buffers from the NCCL symmetric-memory pool of {device}, rendezvous "
            "before each collective, force-sum reduction"
        ),
        f"NCCL {nccl}",
        f"CTA policy: {cta.describe()}",
        f"{n_groups} FSDP param groups",
        "; ".join(probes) or "no multi-rank process group (nothing to gather)",
        f"P2P checked to {peers} other visible GPU(s)",
    ]
    if hosts > 1:
        parts.append(
            f"{hosts} hosts: NCCL's symmetric paths are node-local, across nodes NCCL may use "
            "its regular algorithms on these buffers"
        )
    return "; ".join(parts)


def apply(model: nn.Module, **options: object) -> None:
    """Put the all-gather and reduce-scatter buffers of every FSDP module of ``model`` in
    NCCL symmetric memory (module docstring). Collective: call on every rank, in the same
    order, before the first forward (or between steps), after ``fully_shard``.

    Raises:
        ValueError: bad options, no FSDP module, or comms already customized.
        SymmMemUnavailable: CPU parameters, a non-NCCL process group, NCCL < 2.27, no NCCL
            symmetric-memory backend, no P2P between the GPUs of a host (same on all ranks).
        ZeroCtaPolicyError: ``zero_cta`` and the process has no zero-CTA policy.
    """
    opts = SymmMemOptions.from_kwargs(**options)
    if _STATE_ATTR in model.__dict__:
        raise ValueError("comm.apply(mode='symm_mem') was already called; call remove first")
    groups = fsdp_param_groups(model)
    if not groups:
        raise ValueError(
            "comm.apply(mode='symm_mem') found no FSDP2 module in the model: shard it with "
            "torch.distributed.fsdp.fully_shard first"
        )
    implementation = _resolve_implementation(opts.implementation)
    devices = {g.device for _, g in groups}
    if any(d.type != "cuda" for d in devices):
        raise SymmMemUnavailable(
            f"comm = 'symm_mem' needs CUDA GPUs, but the FSDP parameters are on "
            f"{sorted(str(d) for d in devices)}; symmetric memory is NCCL GPU memory. {_FIX}"
        )
    if len(devices) != 1:
        raise ValueError(f"symm_mem expects one device per rank, got {sorted(map(str, devices))}")
    device = devices.pop()
    pgs = _process_groups(groups)
    for pg in pgs:
        backend = str(dist.get_backend(pg))
        if "nccl" not in backend.lower():
            raise SymmMemUnavailable(
                f"comm = 'symm_mem' needs the NCCL backend, but process group "
                f"{pg.group_name!r} uses {backend!r}. {_FIX}"
            )
    nccl = _nccl_version()
    nccl_text = ".".join(map(str, nccl))
    if nccl < MIN_NCCL:
        raise SymmMemUnavailable(
            f"NCCL {nccl_text} has no symmetric kernels (needs >= "
            f"{'.'.join(map(str, MIN_NCCL))}). {_FIX}"
        )
    # One decision per process group, the same on all of its ranks: a check that fails on
    # one rank only must not let the others run on into a collective it never joins.
    options_zero = bool(pgs) and all(_options_zero_cta(pg, device) for pg in pgs)
    try:
        cta, cta_warning = resolve_cta_policy(os.environ, options_zero, opts.zero_cta)
        cta_error = None
    except ZeroCtaPolicyError as exc:
        cta, cta_warning, cta_error = CtaPolicy(None, f"{CTA_POLICY_VAR} not set"), None, exc
    local = _local_status(device, cta)
    local["cta_error"] = str(cta_error) if cta_error else None
    hosts: set[str] = set()
    for pg in pgs:
        statuses = _exchange(local, pg)
        hosts |= {s["host"] for s in statuses}
        if any(s["cta_error"] for s in statuses):
            raise cta_error or ZeroCtaPolicyError(
                "comm = 'symm_mem': "
                + "; ".join(
                    f"rank {s['rank']}: {s['cta_error']}" for s in statuses if s["cta_error"]
                )
            )
        problems = group_problems(statuses)
        if problems:
            raise SymmMemUnavailable(
                f"comm = 'symm_mem' cannot run on process group {pg.group_name!r}: "
                + "; ".join(problems)
                + f". {_FIX}"
            )
    if cta_error is not None:  # no multi-rank group to agree with
        raise cta_error
    if local["problem"]:
        raise SymmMemUnavailable(local["problem"])
    if cta_warning:
        logger.warning("[rank %d] symm_mem: %s", dist.get_rank(), cta_warning)
    if cta.zero and nccl < MIN_NCCL_COPY_ENGINE:
        logger.warning(
            "[rank %d] symm_mem: NCCL %s predates copy-engine collectives (%s); the zero-CTA "
            "policy cannot move the all-gather off the SMs",
            dist.get_rank(), nccl_text, ".".join(map(str, MIN_NCCL_COPY_ENGINE)),
        )  # fmt: skip

    probes = []
    for pg in pgs:
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch, deprecated no-op on newer
            try:
                enable(pg.group_name)
            except Exception as exc:  # noqa: BLE001
                logger.debug("enable_symm_mem_for_group(%s): %s", pg.group_name, exc)
        # Create the NCCL communicator before the first rendezvous (which registers buffers
        # with it); a rendezvous on a group without one hangs.
        dist.all_reduce(torch.zeros(1, device=device), group=pg)
        problems, description = _probe(pg, device)
        reports = _exchange(problems, pg)
        failed = [f"rank {r}: {'; '.join(p)}" for r, p in enumerate(reports) if p]
        if failed:
            raise SymmMemUnavailable(
                f"symmetric-memory probe failed on process group {pg.group_name!r}: "
                + " | ".join(failed)
                + f". {_FIX}"
            )
        probes.append(f"{pg.group_name} (size {pg.size()}): {description}")

    stats = RegistrationStats()
    saved = _install(model, groups, implementation, stats)
    model.__dict__[_STATE_ATTR] = SymmMemState(
        implementation=implementation,
        cta=cta,
        nccl=nccl_text,
        process_groups=[pg.group_name for pg in pgs],
        probes=probes,
        stats=stats,
        saved=saved,
    )
    logger.info(
        "[rank %d] comm symm_mem in effect: %s",
        dist.get_rank(),
        _describe(implementation, device, nccl_text, cta, len(groups), probes, len(hosts),
                  len(local["peers"])),
    )  # fmt: skip


def remove(model: nn.Module) -> None:
    """Undo :func:`apply`: FSDP's default comms and force-sum flags come back. Local (no
    collective). The symmetric pool keeps its segments for reuse by a later apply."""
    st = model.__dict__.pop(_STATE_ATTR, None)
    if st is not None:
        _restore(st.saved)
        logger.info("[symm_mem] removed: FSDP default comms restored")
