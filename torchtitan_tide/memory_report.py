"""Memory report: AG/RS buffer bytes per comm mode for a training TOML, any GPU count.

    python -m torchtitan_tide.memory_report --config NAME.toml --gpus 64 [--local-world-size 8]
        [--rs-rows 2] [--rs-inflight 2] [--no-slot-reuse] [--formulas] [--json out.json]

Reads the TOML's model as FSDP2 groups it (``torchtitan_tide/fsdp_groups.py``: built on
the meta device, nothing distributed is applied), takes the FSDP shard degree from
``--gpus`` and ``[parallelism]`` and the dtypes from ``[training]``, and prints
:func:`torchtitan_tide.comm.plans.memory_plan.plan_memory` for every mode as a table (GiB);
the row ``tide, reduce_scatter="fsdp2"`` is the plan's ``tide_ag`` mode (TIDE-AG with
FSDP2's reduce-scatter). ``--formulas`` adds how each figure is computed; ``--json`` also
writes everything, in bytes (modes under the plan's keys).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from torchtitan_tide.comm.plans.memory_plan import FORMULAS, MODES, group_shard_numel, plan_memory
from torchtitan_tide.config import Tide
from torchtitan_tide.fsdp_groups import ConfigModel, FsdpWorld, load_config_model, world_for

__all__ = ["format_report", "main", "plan_report", "selected_mode"]

GIB = 2**30
DEFAULT_LOCAL_WORLD_SIZE = 8


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
    """The memory plan's mode name for a ``[tide]`` section (``tide_ag``: TIDE-AG with
    FSDP2's reduce-scatter)."""
    if tide.comm == "tide" and tide.reduce_scatter == "fsdp2":
        return "tide_ag"
    return tide.comm


def plan_report(
    cm: ConfigModel,
    world: FsdpWorld,
    rs_rows: int = 2,
    rs_inflight: int = 2,
    slot_reuse: bool = True,
    cross_node: str = "p2p",
    ag_in_place_groups: int | None = None,
) -> dict[str, Any]:
    """Everything the CLI prints, as JSON-ready data (bytes). ``cross_node``: the
    cross-node transport the TIDE figures assume (``plan_memory``); ``ag_in_place_groups``
    None: the config's ``[tide] ag_in_place_groups``.

    Raises:
        ValueError: options :func:`plan_memory` refuses (its message).
    """
    in_place_groups = (cm.tide.ag_in_place_groups if ag_in_place_groups is None
                       else ag_in_place_groups)  # fmt: skip
    plans = plan_memory(
        cm.groups,
        world.shard_degree,
        world.local,
        cm.dtypes,
        rs_rows=rs_rows,
        rs_inflight=rs_inflight,
        slot_reuse=slot_reuse,
        cross_node=cross_node,
        ag_in_place_groups=in_place_groups,
    )
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
        "options": {
            "rs_rows": rs_rows,
            "rs_inflight": rs_inflight,
            "slot_reuse": slot_reuse,
            "cross_node": cross_node,
            "ag_in_place_groups": in_place_groups,
        },
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
            f"slot_reuse {report['options']['slot_reuse']}, "
            f"cross-node {report['options']['cross_node']} (--cross-node)"
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
    tide, stock = report["modes"]["tide"], report["modes"]["fsdp2"]
    lines += [
        "",
        "tide parts, GiB: " + ", ".join(
            f"{k}{' (of ag_slots)' if k == 'ag_arena' else ''} {_gib(v)}"
            for k, v in tide["parts"].items()
        ),
        "fsdp2 parts, GiB: " + ", ".join(f"{k} {_gib(v)}" for k, v in stock["parts"].items()),
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
        prog="python -m torchtitan_tide.memory_report", description=__doc__.splitlines()[0]
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
        "--cross-node",
        choices=("p2p", "one_sided"),
        help="TIDE's cross-node transport the figures assume (default: 'one_sided' for "
        "[tide] cross_node_transport = 'nccl_one_sided', else 'p2p'; 'auto' takes one-sided "
        "where NCCL has host RMA between the nodes: check both)",
    )
    parser.add_argument(
        "--ag-in-place-groups", type=int,
        help="one-sided at one rank per node: groups the in-place all-gather's arena holds "
        "(default: [tide] ag_in_place_groups)",
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
    if args.ag_in_place_groups is not None and args.ag_in_place_groups < 0:
        parser.error(f"--ag-in-place-groups {args.ag_in_place_groups} must be >= 0")
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
            args.cross_node
            or ("one_sided" if cm.tide.cross_node_transport == "nccl_one_sided" else "p2p"),
            args.ag_in_place_groups,
        )
        report["world"]["local_world_size_from"] = source
    except (ValueError, FileNotFoundError) as exc:  # FsdpGroupsError, TideConfigError
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
