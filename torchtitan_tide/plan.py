"""Memory planner: AG/RS buffer bytes per comm mode for a training TOML, any GPU count.

    python -m torchtitan_tide.plan --config NAME.toml --gpus 64 [--local-world-size 8]
        [--rs-rows 2] [--rs-inflight 2] [--no-slot-reuse] [--formulas] [--json out.json]

Builds the TOML's model (``[model] name/flavor`` from TorchTitan's train spec registry)
on the meta device, groups its parameters as TorchTitan's ``apply_fsdp`` would (nothing
distributed is applied), takes the FSDP shard degree from ``--gpus`` and
``[parallelism]`` and the dtypes from ``[training]``, and prints
:func:`torchtitan_tide.comm.memory_plan.plan_memory` for every mode as a table (GiB);
the row ``tide, reduce_scatter="fsdp2"`` is the plan's ``tide_ag`` mode (TIDE-AG with
FSDP2's reduce-scatter). ``--formulas`` adds how each figure is computed; ``--json`` also
writes everything, in bytes (modes under the plan's keys).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_tide.comm.memory_plan import (
    FORMULAS,
    MODES,
    CommDtypes,
    GroupShape,
    group_shard_numel,
    plan_memory,
)
from torchtitan_tide.config import Tide, check_config_table, load_toml

__all__ = [
    "ConfigModel",
    "PlanError",
    "WorldPlan",
    "format_report",
    "fsdp_group_modules",
    "fsdp_groups",
    "load_config_model",
    "main",
    "plan_report",
    "world_for",
]

GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DEFAULT_LOCAL_WORLD_SIZE = 8
MASTER_DTYPE_BYTES = 4  # TorchTitan keeps sharded parameters and AdamW states in fp32


class PlanError(ValueError):
    """Bad planner input; the message names the flag or TOML key and the fix."""


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
    """A training TOML's model as the planner sees it (built once on the meta device)."""

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
class WorldPlan:
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
    on the meta device and group its parameters. Raises :class:`PlanError`."""
    from torchtitan_tide.launch.command_line import resolve_config
    from torchtitan_tide.launch.errors import LaunchError

    try:
        path = resolve_config(config)
    except LaunchError as exc:
        raise PlanError(str(exc)) from None
    table = load_toml(str(path))
    tide = check_config_table(table, path.name)
    model_section = table.get("model", {})
    spec_name = model_section.get("name")
    flavor = model_section.get("flavor")
    if not spec_name or not flavor:
        raise PlanError(f"{path.name}: [model] needs name and flavor")
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
        raise PlanError(
            f"{where}: [model] name = {spec_name!r} is not a train spec ({exc}); "
            f"this project registers {registered}"
        ) from None
    if flavor not in spec.model_args:
        raise PlanError(
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
    grouping's source. The memory planner (:func:`fsdp_groups`), the simulator and the
    one-GPU layer trace (``scripts/bench/bench_trace.py``) all group through this."""
    from torch import nn

    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
        raise PlanError(
            f"{where}: model {type(model).__name__} has no `layers` container "
            "(nn.ModuleDict/ModuleList of transformer blocks); the planner groups one FSDP "
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
            raise PlanError(
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
            raise PlanError(
                f"{where}: [training] {key} = {value!r}; the planner knows {list(DTYPE_BYTES)}"
            )
        sizes[key] = DTYPE_BYTES[value]
    return CommDtypes(
        param_bytes=sizes["mixed_precision_param"],
        reduce_bytes=sizes["mixed_precision_reduce"],
        master_bytes=MASTER_DTYPE_BYTES,
    )


def world_for(
    table: dict[str, Any], gpus: int, local_world_size: int, where: str = "config"
) -> WorldPlan:
    """FSDP shard degree and node split of ``gpus`` under the TOML's ``[parallelism]``.

    FSDP shards over ``dp_shard * cp`` ranks (TorchTitan's ``fsdp`` mesh), i.e.
    ``W = gpus / (dp_replicate * tp * pp)``; the planner models TP = PP = EP = 1.
    ``gpus <= local_world_size`` is one node of ``gpus`` GPUs.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"--gpus {gpus!r} must be a positive integer")
    if local_world_size < 1:
        raise PlanError(f"--local-world-size {local_world_size} must be >= 1")
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
            raise PlanError(
                f"{where}: [parallelism] {key} = {degrees[key]}: the planner models FSDP "
                "(+ HSDP replicate, CP) only; TP/PP/EP change parameter shapes and groups"
            )
    note = ""
    local = local_world_size
    if gpus <= local_world_size:
        local = gpus
        if gpus < local_world_size:
            note = f"{gpus} GPUs < {local_world_size} per node: one node of {gpus}"
    elif gpus % local_world_size:
        raise PlanError(
            f"--gpus {gpus} is not a multiple of --local-world-size {local_world_size}; "
            "use whole nodes"
        )
    replicate, cp = degrees["data_parallel_replicate_degree"], degrees["context_parallel_degree"]
    if replicate < 1 or cp < 1 or gpus % (replicate * cp):
        raise PlanError(
            f"{where}: --gpus {gpus} is not divisible by [parallelism] "
            f"data_parallel_replicate_degree ({replicate}) * context_parallel_degree ({cp})"
        )
    dp_shard = degrees["data_parallel_shard_degree"]
    if dp_shard < 0:
        dp_shard = gpus // (replicate * cp)
    elif replicate * dp_shard * cp != gpus:
        raise PlanError(
            f"{where}: [parallelism] data_parallel_shard_degree = {dp_shard} with "
            f"replicate {replicate} and cp {cp} needs {replicate * dp_shard * cp} GPUs, "
            f"not --gpus {gpus}; set it to -1 or pass matching --gpus"
        )
    shard = dp_shard * cp
    if shard < 2:
        raise PlanError(
            f"--gpus {gpus}: FSDP shard degree {shard} < 2, TorchTitan applies no FSDP; "
            "nothing to plan"
        )
    # The FSDP mesh is innermost: one FSDP group is `shard` consecutive ranks.
    group_local = min(local, shard)
    if shard % group_local or local % group_local:
        raise PlanError(
            f"FSDP shard degree {shard} and --local-world-size {local} do not tile nodes; "
            "choose a local world size that divides or is a multiple of it"
        )
    return WorldPlan(gpus, shard, group_local, degrees, note)


def local_world_size_of(tide: Tide, flag: int | None) -> tuple[int, str]:
    """GPUs per node and where the number came from: the flag, ``[tide] local_world_size``
    when > 0, else the default 8."""
    if flag is not None:
        return flag, "--local-world-size"
    if tide.local_world_size > 0:
        return tide.local_world_size, "[tide] local_world_size"
    return DEFAULT_LOCAL_WORLD_SIZE, f"default {DEFAULT_LOCAL_WORLD_SIZE}"


# How the table names the memory plan's modes: `tide_ag` is comm = "tide" with FSDP2's
# reduce-scatter, i.e. the [tide] setting that selects it.
MODE_LABELS = {"tide_ag": 'tide, reduce_scatter="fsdp2"'}


def mode_label(mode: str) -> str:
    """The printed name of memory-plan mode ``mode`` (:data:`MODE_LABELS`)."""
    return MODE_LABELS.get(mode, mode)


def selected_mode(tide: Tide) -> str:
    """The planner's mode name for a ``[tide]`` section (``tide_ag``: TIDE-AG with
    FSDP2's reduce-scatter)."""
    if tide.comm == "tide" and tide.reduce_scatter == "fsdp2":
        return "tide_ag"
    return tide.comm


def plan_report(
    cm: ConfigModel,
    world: WorldPlan,
    rs_rows: int = 2,
    rs_inflight: int = 2,
    slot_reuse: bool = True,
) -> dict[str, Any]:
    """Everything the CLI prints, as JSON-ready data (bytes)."""
    try:
        plans = plan_memory(
            cm.groups,
            world.shard_degree,
            world.local,
            cm.dtypes,
            rs_rows=rs_rows,
            rs_inflight=rs_inflight,
            slot_reuse=slot_reuse,
        )
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    return {
        "config": cm.path.name,
        "model": {
            "name": cm.spec_name,
            "flavor": cm.flavor,
            "params": cm.total_numel,
            "active_params": cm.active_numel,
        },
        "selected_comm": selected_mode(cm.tide),
        "world": {
            "gpus": world.gpus,
            "fsdp_shard_degree": world.shard_degree,
            "nodes": world.nodes,
            "local_ranks_per_node": world.local,
            "parallelism": world.degrees,
            "note": world.note,
        },
        "dtypes": {
            "ag_bytes": cm.dtypes.param_bytes,
            "grad_bytes": cm.dtypes.grad,
            "reduce_bytes": cm.dtypes.reduce_bytes,
            "master_bytes": cm.dtypes.master_bytes,
        },
        "options": {"rs_rows": rs_rows, "rs_inflight": rs_inflight, "slot_reuse": slot_reuse},
        "grouping": cm.grouping,
        "groups": [
            {
                "name": g.name,
                "numel": g.numel,
                "params": len(g.param_shapes),
                "shard_numel": group_shard_numel(g, world.shard_degree),
                "reshard_after_forward": g.reshard_after_forward,
            }
            for g in cm.groups
        ],
        "modes": {mode: plans[mode].to_dict() for mode in MODES},
        "not_counted": "unsharded parameters and activations (the same in every mode)",
    }


def format_report(report: dict[str, Any], formulas: bool = False) -> str:
    """The human-readable plan: header, groups, a GiB table per mode, parts, notes; the
    formulas behind each figure with ``formulas``."""
    model, world, dt = report["model"], report["world"], report["dtypes"]
    lines = [
        (
            f"Memory plan: {report['config']} (model {model['name']} / {model['flavor']}, "
            f"{model['params']:,} params; this config runs {mode_label(report['selected_comm'])})"
        ),
        f"World: {world['gpus']} GPUs, FSDP shard degree W = {world['fsdp_shard_degree']} "
        f"= {world['nodes']} node(s) x {world['local_ranks_per_node']} (N x L)"
        + f" (GPUs per node: {world.get('local_world_size_from', 'given')})"
        + (f"; {world['note']}" if world["note"] else ""),
        (
            f"Dtypes (bytes): all-gather {dt['ag_bytes']}, gradients {dt['grad_bytes']}, "
            f"reduce {dt['reduce_bytes']}, master params/AdamW {dt['master_bytes']}"
        ),
        (
            f"Options: rs_rows {report['options']['rs_rows']}, "
            f"rs_inflight {report['options']['rs_inflight']}, "
            f"slot_reuse {report['options']['slot_reuse']}"
        ),
        report["grouping"] + ":",
    ]
    lines += [f"  {line}" for line in _group_lines(report["groups"])]
    lines += ["", "Per rank, GiB (2^30 bytes):", ""]
    header = [
        "mode",
        "AG",
        "RS",
        "comm buffers",
        "gradients",
        "params+AdamW",
        "total",
        "buffers are",
    ]
    rows = []
    for mode, plan in report["modes"].items():
        rows.append(
            [mode_label(mode)]
            + [
                _gib(plan[k])
                for k in (
                    "ag_bytes",
                    "rs_bytes",
                    "comm_buffer_bytes",
                    "gradient_bytes",
                    "params_optimizer_bytes",
                    "total_bytes",
                )
            ]
            + [plan["residency"]]
        )
    lines += _markdown(header, rows)
    tide = report["modes"]["tide"]
    lines += [
        "",
        "tide parts, GiB: " + ", ".join(f"{k} {_gib(v)}" for k, v in tide["parts"].items()),
    ]
    if formulas:
        lines += [
            "",
            (
                "Formulas (s_p = ceil(shape[0]/W)*prod(shape[1:]), S_g = sum_p s_p, "
                "A = max_g sum_p round16(s_p*b_ag), slot(x) = round128(max(x, 16))):"
            ),
        ]
        for mode in MODES:
            for key, text in FORMULAS[mode].items():
                lines.append(f"  {mode_label(mode)} {key}: {text}")
    lines.append("Notes:")
    for mode, plan in report["modes"].items():
        lines += [f"  {mode_label(mode)}: {note}" for note in plan["notes"]]
    lines.append(f"  not counted: {report['not_counted']}")
    if not formulas:
        lines.append("How each figure is computed: add --formulas.")
    return "\n".join(lines)


def _group_lines(groups: list[dict[str, Any]]) -> list[str]:
    """One line per run of consecutive groups with the same shard numel."""
    out, i = [], 0
    while i < len(groups):
        j = i
        while j + 1 < len(groups) and (groups[j + 1]["shard_numel"], groups[j + 1]["numel"]) == (
            groups[i]["shard_numel"],
            groups[i]["numel"],
        ):
            j += 1
        g = groups[i]
        name = g["name"] if i == j else f"{g['name']} .. {groups[j]['name']} ({j - i + 1} groups)"
        out.append(
            f"{name}: {g['params']} params, {g['numel']:,} elements, "
            f"shard S_g = {g['shard_numel']:,} per rank"
        )
        i = j + 1
    return out


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:,.3f}"


def _markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return [
        line(header),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
        *(line(r) for r in rows),
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_tide.plan", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--config",
        required=True,
        help="training TOML: a name in train_configs/ (.toml optional) or a path",
    )
    parser.add_argument("--gpus", type=int, required=True, help="total GPUs of the run")
    parser.add_argument(
        "--local-world-size",
        type=int,
        default=None,
        help="GPUs per node (default: [tide] local_world_size if > 0, else 8)",
    )
    parser.add_argument(
        "--rs-rows", type=int, help="TIDE-RS source rows per staging slot (default: [tide])"
    )
    parser.add_argument(
        "--rs-inflight", type=int, help="TIDE-RS cross-node fp32 partials (default: [tide])"
    )
    parser.add_argument(
        "--slot-reuse",
        action=argparse.BooleanOptionalAction,
        help="TIDE-RS stages in the TIDE-AG slots (default: [tide] slot_reuse)",
    )
    parser.add_argument(
        "--formulas", action="store_true", help="also print how each figure is computed"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON (bytes)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for flag, value in (("--rs-rows", args.rs_rows), ("--rs-inflight", args.rs_inflight)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value} must be >= 1")
    try:
        cm = load_config_model(args.config)
        local, source = local_world_size_of(cm.tide, args.local_world_size)
        world = world_for(cm.table, args.gpus, local, where=cm.path.name)
        report = plan_report(
            cm,
            world,
            cm.tide.rs_rows if args.rs_rows is None else args.rs_rows,
            cm.tide.rs_inflight if args.rs_inflight is None else args.rs_inflight,
            cm.tide.slot_reuse if args.slot_reuse is None else args.slot_reuse,
        )
        report["world"]["local_world_size_from"] = source
    except (ValueError, FileNotFoundError) as exc:  # PlanError, TideConfigError
        parser.error(str(exc))
    print(format_report(report, formulas=args.formulas))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
