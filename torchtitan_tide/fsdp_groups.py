"""The FSDP group model: a training TOML's model as FSDP2 would shard it, built on meta.

:func:`load_config_model` resolves a config, builds its model (``[model] name/flavor``
from TorchTitan's train spec registry) on the meta device and groups its parameters as
TorchTitan's ``apply_fsdp`` would (:func:`fsdp_group_modules`: nothing distributed is
applied); :func:`world_for` takes the FSDP shard degree and node split of a GPU count
from ``[parallelism]``. The memory report (``torchtitan_tide/memory_report.py``), the
step simulator and the one-GPU layer trace (``scripts/bench/bench_trace.py``) all read
the model through here. Not to be confused with ``comm/plans/plan.py`` (TIDE's layout plan of
one FSDP group's chunks) or ``comm/plans/memory_plan.py`` (the buffer bytes of each comm mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_tide.comm.plans.memory_plan import CommDtypes, GroupShape
from torchtitan_tide.config import Tide, check_config_table, load_toml

__all__ = [
    "ConfigModel",
    "FsdpGroupsError",
    "FsdpWorld",
    "fsdp_group_modules",
    "fsdp_groups",
    "load_config_model",
    "world_for",
]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MASTER_DTYPE_BYTES = 4  # TorchTitan keeps sharded parameters and AdamW states in fp32


class FsdpGroupsError(ValueError):
    """Bad input to the group model; the message names the flag or TOML key and the fix."""


@dataclass(frozen=True)
class Grouping:
    """Top-level modules an ``apply_fsdp`` shards as their own FSDP groups besides one
    group per block of ``model.layers``; ``after_blocks`` groups are kept unsharded after
    forward under ``fsdp_reshard_after_forward = "default"``. The root holds the rest."""

    before_blocks: tuple[tuple[str, ...], ...]
    after_blocks: tuple[tuple[str, ...], ...]
    source: str


_LLAMA_STYLE = Grouping(
    (("tok_embeddings",),),
    (("norm", "output"),),
    "TorchTitan 0.2.2 llama3/llama4 apply_fsdp (qwen3 uses llama4's)",
)
_WAN22 = Grouping(
    (("text_embedding",), ("time_embedding",), ("time_projection",)),
    (("head",),),
    "models/wan22/parallelize.py apply_fsdp",
)
GROUPINGS: dict[str, Grouping] = {
    "llama3": _LLAMA_STYLE,
    "llama3_tide": _LLAMA_STYLE,
    "llama4": _LLAMA_STYLE,
    "qwen3": _LLAMA_STYLE,
    "qwen3_tide": _LLAMA_STYLE,
    "wan22": _WAN22,
}
_BLOCKS_AND_ROOT = Grouping((), (), "generic: one group per block of model.layers + root")


@dataclass(frozen=True)
class ConfigModel:
    """A training TOML's model as FSDP2 would group it (built once on the meta device)."""

    path: Path
    table: dict[str, Any]
    spec_name: str
    flavor: str
    model_args: Any
    groups: tuple[GroupShape, ...]
    grouping: str
    total_numel: int
    active_numel: int
    """Parameters one token's forward multiplies with: no embedding tables, MoE experts
    weighted by top_k / num_experts (the simulator's FLOPs fallback uses it)."""
    dtypes: CommDtypes
    tide: Tide
    """The validated ``[tide]`` section (defaults where absent)."""


@dataclass(frozen=True)
class FsdpWorld:
    """``gpus`` as FSDP sees them: shard degree ``shard_degree`` over ``nodes`` nodes of
    ``local`` ranks each (the ranks of one node inside one FSDP group)."""

    gpus: int
    shard_degree: int
    local: int
    degrees: dict[str, int]
    note: str

    @property
    def nodes(self) -> int:
        return self.shard_degree // self.local


def load_config_model(config: str) -> ConfigModel:
    """Resolve ``config`` (name in train_configs/ or path), read its TOML, build the model
    on the meta device and group its parameters. Raises :class:`FsdpGroupsError`."""
    from torchtitan_tide.launch.command_line import resolve_config
    from torchtitan_tide.launch.errors import LaunchError

    try:
        path = resolve_config(config)
    except LaunchError as exc:
        raise FsdpGroupsError(str(exc)) from None
    table = load_toml(str(path))
    tide = check_config_table(table, path.name)
    model_section = table.get("model", {})
    spec_name = model_section.get("name")
    flavor = model_section.get("flavor")
    if not spec_name or not flavor:
        raise FsdpGroupsError(f"{path.name}: [model] needs name and flavor")
    model, args = _build_meta_model(path.name, spec_name, flavor)
    policy = table.get("parallelism", {}).get("fsdp_reshard_after_forward", "default")
    groups, grouping = fsdp_groups(model, spec_name, policy, where=path.name)
    return ConfigModel(
        path=path,
        table=table,
        spec_name=spec_name,
        flavor=flavor,
        model_args=args,
        groups=groups,
        grouping=grouping,
        total_numel=sum(p.numel() for p in model.parameters()),
        active_numel=_active_numel(model, args),
        dtypes=_dtypes(table, path.name),
        tide=tide,
    )


def _build_meta_model(where: str, spec_name: str, flavor: str):
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_tide import train_specs

    train_specs.register()
    try:
        spec = get_train_spec(spec_name)
    except (ValueError, ImportError) as exc:
        registered = sorted(train_specs.SPECS)
        raise FsdpGroupsError(
            f"{where}: [model] name = {spec_name!r} is not a train spec ({exc}); "
            f"this project registers {registered}"
        ) from None
    if flavor not in spec.model_args:
        raise FsdpGroupsError(
            f"{where}: [model] flavor = {flavor!r} is not a flavor of {spec_name!r}; "
            f"choose one of {sorted(spec.model_args)}"
        )
    args = spec.model_args[flavor]
    with torch.device("meta"):
        return spec.model_cls(args), args


def fsdp_group_modules(
    model, spec_name: str, reshard_policy: str = "default", where: str = "model"
) -> tuple[list[tuple[str, list, bool]], str]:
    """The separately wrapped FSDP groups of ``model`` as ``apply_fsdp`` of ``spec_name``
    makes them, in FSDP2's forward order: ``(name, modules, reshard_after_forward)`` for
    the top-level modules of :data:`GROUPINGS` and one group per block of
    ``model.layers`` (the root, which holds the rest, is not listed). Also returns the
    grouping's source. The memory report (:func:`fsdp_groups`), the simulator and the
    one-GPU layer trace (``scripts/bench/bench_trace.py``) all group through this."""
    from torch import nn

    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
        raise FsdpGroupsError(
            f"{where}: model {type(model).__name__} has no `layers` container "
            "(nn.ModuleDict/ModuleList of transformer blocks); the group model makes one FSDP "
            "group per block of model.layers"
        )
    match reshard_policy:
        case "default":
            blocks_reshard, last_reshard = True, False
        case "always":
            blocks_reshard, last_reshard = True, True
        case "never":
            blocks_reshard, last_reshard = False, False
        case _:
            raise FsdpGroupsError(
                f"{where}: [parallelism] fsdp_reshard_after_forward = {reshard_policy!r}; "
                "choose one of ['default', 'always', 'never']"
            )
    rule = GROUPINGS.get(spec_name, _BLOCKS_AND_ROOT)
    blocks = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    wrapped: list[tuple[str, list[nn.Module], bool]] = []
    for names in rule.before_blocks:
        if modules := _present(model, names):
            wrapped.append(("+".join(names), modules, blocks_reshard))
    wrapped += [(f"layers.{key}", [block], blocks_reshard) for key, block in blocks]
    for names in rule.after_blocks:
        if modules := _present(model, names):
            wrapped.append(("+".join(names), modules, last_reshard))
    separate = [
        *("+".join(n) for n in rule.before_blocks),
        "one per block of model.layers",
        *("+".join(n) for n in rule.after_blocks),
    ]
    return wrapped, f"{rule.source}: root (params no other group holds), {', '.join(separate)}"


def fsdp_groups(
    model, spec_name: str, reshard_policy: str = "default", where: str = "model"
) -> tuple[tuple[GroupShape, ...], str]:
    """Group ``model``'s parameters as ``apply_fsdp`` of ``spec_name`` does: root (what no
    other group holds; listed first, it is gathered first), the separately sharded
    top-level modules of :data:`GROUPINGS`, one group per block of ``model.layers``
    (:func:`fsdp_group_modules`). Empty groups are dropped. Returns the groups and a
    sentence saying how they were made.
    """
    wrapped, how = fsdp_group_modules(model, spec_name, reshard_policy, where)
    taken: set[int] = set()
    groups = []
    for name, modules, reshard in wrapped:
        params = [p for m in modules for p in m.parameters() if id(p) not in taken]
        taken.update(id(p) for p in params)
        groups.append(GroupShape(name, tuple(tuple(p.shape) for p in params), reshard))
    root = [p for p in model.parameters() if id(p) not in taken]
    groups.insert(0, GroupShape("root", tuple(tuple(p.shape) for p in root), False))
    groups = tuple(g for g in groups if g.param_shapes)
    sentence = f"FSDP groups as {how}; empty groups dropped; {len(groups)} groups"
    return groups, sentence


def _present(model, names: tuple[str, ...]) -> list:
    modules = [getattr(model, n, None) for n in names]
    return modules if all(m is not None for m in modules) else []


def _active_numel(model, args) -> int:
    from torch import nn

    embedding = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    moe = getattr(args, "moe_args", None)
    total = 0.0
    for name, p in model.named_parameters():
        if id(p) in embedding:
            continue
        if moe is not None and ".moe.experts." in name:
            total += p.numel() * moe.top_k / moe.num_experts
        else:
            total += p.numel()
    return int(total)


def _dtypes(table: dict[str, Any], where: str) -> CommDtypes:
    training = table.get("training", {})
    sizes = {}
    for key, default in (
        ("mixed_precision_param", "bfloat16"),
        ("mixed_precision_reduce", "float32"),
    ):
        value = training.get(key, default)
        if value not in DTYPE_BYTES:
            raise FsdpGroupsError(
                f"{where}: [training] {key} = {value!r}; the group model knows {list(DTYPE_BYTES)}"
            )
        sizes[key] = DTYPE_BYTES[value]
    return CommDtypes(
        param_bytes=sizes["mixed_precision_param"],
        reduce_bytes=sizes["mixed_precision_reduce"],
        master_bytes=MASTER_DTYPE_BYTES,
    )


def world_for(
    table: dict[str, Any], gpus: int, local_world_size: int, where: str = "config"
) -> FsdpWorld:
    """FSDP shard degree and node split of ``gpus`` under the TOML's ``[parallelism]``.

    FSDP shards over ``dp_shard * cp`` ranks (TorchTitan's ``fsdp`` mesh), i.e.
    ``W = gpus / (dp_replicate * tp * pp)``; the group model covers TP = PP = EP = 1.
    ``gpus <= local_world_size`` is one node of ``gpus`` GPUs.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise FsdpGroupsError(f"--gpus {gpus!r} must be a positive integer")
    if local_world_size < 1:
        raise FsdpGroupsError(f"--local-world-size {local_world_size} must be >= 1")
    par = table.get("parallelism", {})
    degrees = {
        key: int(par.get(key, default))
        for key, default in (
            ("data_parallel_replicate_degree", 1),
            ("data_parallel_shard_degree", -1),
            ("context_parallel_degree", 1),
            ("tensor_parallel_degree", 1),
            ("pipeline_parallel_degree", 1),
            ("expert_parallel_degree", 1),
        )
    }
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree"):
        if degrees[key] != 1:
            raise FsdpGroupsError(
                f"{where}: [parallelism] {key} = {degrees[key]}: the group model covers FSDP "
                "(+ HSDP replicate, CP) only; TP/PP/EP change parameter shapes and groups"
            )
    note = ""
    local = local_world_size
    if gpus <= local_world_size:
        local = gpus
        if gpus < local_world_size:
            note = f"{gpus} GPUs < {local_world_size} per node: one node of {gpus}"
    elif gpus % local_world_size:
        raise FsdpGroupsError(
            f"--gpus {gpus} is not a multiple of --local-world-size {local_world_size}; "
            "use whole nodes"
        )
    replicate, cp = degrees["data_parallel_replicate_degree"], degrees["context_parallel_degree"]
    if replicate < 1 or cp < 1 or gpus % (replicate * cp):
        raise FsdpGroupsError(
            f"{where}: --gpus {gpus} is not divisible by [parallelism] "
            f"data_parallel_replicate_degree ({replicate}) * context_parallel_degree ({cp})"
        )
    dp_shard = degrees["data_parallel_shard_degree"]
    if dp_shard < 0:
        dp_shard = gpus // (replicate * cp)
    elif replicate * dp_shard * cp != gpus:
        raise FsdpGroupsError(
            f"{where}: [parallelism] data_parallel_shard_degree = {dp_shard} with "
            f"replicate {replicate} and cp {cp} needs {replicate * dp_shard * cp} GPUs, "
            f"not --gpus {gpus}; set it to -1 or pass matching --gpus"
        )
    shard = dp_shard * cp
    if shard < 2:
        raise FsdpGroupsError(
            f"--gpus {gpus}: FSDP shard degree {shard} < 2, TorchTitan applies no FSDP; "
            "nothing to plan"
        )
    # The FSDP mesh is innermost: one FSDP group is `shard` consecutive ranks.
    group_local = min(local, shard)
    if shard % group_local or local % group_local:
        raise FsdpGroupsError(
            f"FSDP shard degree {shard} and --local-world-size {local} do not tile nodes; "
            "choose a local world size that divides or is a multiple of it"
        )
    return FsdpWorld(gpus, shard, group_local, degrees, note)
