"""One Markdown report from the benchmark result files (issue 5, "The suite").

    python scripts/bench/report.py [--results-dir bench/results] [--out-dir DIR] [FILE.json ...]

Without files: the newest result of every (kind, name) under ``--results-dir``, where
``name`` is the part of the file name after ``<date>_<machine>_<commit>_`` (e.g.
``collectives``, ``step_h200x2_llama70b_4layers``); smoke and small test runs
(``*_smoke``, ``*_small``) are left out. A file's ``kind`` is its top-level ``"kind"``
(``ag``, ``collectives``, ``interference``, ``step``, ``projection``, ...); files
written before that key existed are recognized by name (``ag``, ``step_*``).

Writes ``<out-dir>/<date>_<machine>_<commit>_report.md`` (default out-dir: the results
dir) with the date, machine and commit of the newest step result, whose figures the
headline image shows (of the newest measured result where there is none,
:func:`naming_result`); file name, header and image title name that one machine. Inside:
metadata, one
headline table of every result's headline figures by comm mode with ratios to
``fsdp2``, each result's own tables with its PNG embedded, projections (JSONs of kind
``projection`` or ``simulation``, shown generically and labeled as model estimates, not measurements),
and the list of sources. Also ``<stem>_report.png``, the headline figure: training step
time per comm mode, one panel per step result naming its commit and date, every bar
labelled with its ms and its speed-up vs ``fsdp2`` (``1.000x`` on fsdp2's own), and the
compute floor of the config as a dashed line where one is known (:func:`step_floor`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

SKIPPED_SUFFIXES = ("_smoke", "_small")
KIND_TITLES = {
    "step": "Training step",
    "collectives": "FSDP group collectives",
    "interference": "GEMM interference beside collectives",
    "ag": "All-gather (TIDE-AG vs stock)",
    "projection": "Projection",
    "simulation": "Simulation",
}
MODEL_KINDS = ("projection", "simulation")  # computed from a model, never measured
KIND_ORDER = ("step", "collectives", "interference", "ag")
# Titles of the step configs in the headline figure.
CONFIG_TITLES = {
    "h200x2_llama70b_4layers": "Llama-3.1-70B, 4 layers",
    "h200x2_qwen3_30b_a3b_4layers": "Qwen3-30B-A3B, 4 layers",
    "h200x2_wan22_a14b_20layers": "Wan2.2-A14B, 20 layers",
}
STEP_METRIC = "step ms (best round)"
# bench_ag's variant names -> comm modes, for its legacy headline.
AG_VARIANT_MODES = {"stock": "fsdp2", "tide_auto": "tide", "tide_nccl_p2p_2x1": "tide_nccl_p2p"}


@dataclass(frozen=True)
class Result:
    """One result file: its parsed JSON and what the report needs to know of it."""

    path: Path
    data: Mapping[str, Any]
    kind: str
    name: str

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.data.get("metadata") or {}

    @property
    def date(self) -> str:
        return str(self.meta.get("date") or "")


def result_name(path: Path) -> str:
    """``name`` of ``<date>_<machine>_<commit>_<name>.json`` (the stem if it has no such form)."""
    parts = path.stem.split("_", 3)
    return parts[3] if len(parts) == 4 else path.stem


def infer_kind(name: str, data: Mapping[str, Any]) -> str:
    if kind := data.get("kind"):
        return str(kind)
    if name == "ag" or name.startswith("ag_"):
        return "ag"
    if name.startswith("step_") and "rows" in data:
        return "step"
    return name.split("_")[0]


def load_result(path: Path) -> Result | None:
    """The result in ``path``; None for files that are not benchmark results."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    name = result_name(path)
    kind = infer_kind(name, data)
    if "metadata" not in data and kind not in MODEL_KINDS:
        return None
    return Result(path, data, kind, name)


def select_latest(results: Sequence[Result]) -> list[Result]:
    """The newest result (metadata date, then file name) of every (kind, name), minus
    smoke and small test runs."""
    latest: dict[tuple[str, str], Result] = {}
    for r in results:
        if r.name.endswith(SKIPPED_SUFFIXES):
            continue
        key = (r.kind, r.name)
        if key not in latest or (r.date, r.path.name) > (latest[key].date, latest[key].path.name):
            latest[key] = r
    return list(latest.values())


# ---------------------------------------------------------------- content of one result


def headline_rows(r: Result) -> list[dict[str, Any]]:
    """The result's headline figures (``common.headline_row`` dicts). Files without a
    ``headline`` key: step results from their rows, bench_ag results from their tables."""
    if r.kind in MODEL_KINDS:
        return []  # projections and simulations never enter the measured headline
    if "headline" in r.data:
        return list(r.data["headline"])
    if r.kind == "step":
        import bench_step

        config = (r.data.get("args") or {}).get("config", r.name[len("step_") :])
        return bench_step.headline(config, r.data.get("rows", []))
    if r.kind == "ag":
        return _ag_headline(r)
    return []


def all_headline_rows(results: Sequence[Result]) -> list[dict[str, Any]]:
    """Headline rows of every result; where several results share a (kind, name),
    e.g. two step runs of one config, each benchmark label gets ``@<commit>``."""
    counts: dict[tuple[str, str], int] = {}
    for r in results:
        counts[(r.kind, r.name)] = counts.get((r.kind, r.name), 0) + 1
    out = []
    for r in results:
        for row in headline_rows(r):
            if counts[(r.kind, r.name)] > 1:
                row = {**row, "benchmark": f"{row['benchmark']} @{r.meta.get('commit')}"}
            out.append(row)
    return out


def _ag_headline(r: Result) -> list[dict[str, Any]]:
    import bench_ag

    out = []
    rows = bench_ag.table_rows(dict(r.data))
    for _, _, label in bench_ag.SCENARIOS:
        values = {
            AG_VARIANT_MODES.get(row["variant"][len(label) + 1 :], row["variant"]): row["best_ms"]
            for row in rows
            if row["variant"].startswith(label + " ")
        }
        if values:
            out.append(common.headline_row(f"ag {label}", "unshard ms", values))
    return out


def detail_tables(r: Result) -> list[dict[str, Any]]:
    """``[{"title", "columns", "rows"}]`` of the result: its ``tables``, or, for older
    files, what its benchmark would have written; any list of flat records of a
    projection, with the union of their keys as columns."""
    if r.data.get("tables"):
        return list(r.data["tables"])
    if r.kind == "step":
        import bench_step

        rounds = (r.data.get("args") or {}).get("rounds", 2)
        return [{"title": "Comm modes side by side", "columns": bench_step.columns(rounds),
                 "rows": r.data.get("rows", [])}]  # fmt: skip
    if r.kind == "ag":
        import bench_ag

        rows = bench_ag.table_rows(dict(r.data))
        return [{"title": "All-gather", "columns": bench_ag.TABLE_COLUMNS, "rows": rows}]
    return generic_tables(r.data)


def generic_tables(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every top-level list of dicts in ``data`` as a table (key order of first sight;
    nested values left out)."""
    tables = []
    for key, value in data.items():
        if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            cols: dict[str, None] = {}
            for row in value:
                cols.update((k, None) for k, v in row.items() if _is_scalar(v))
            tables.append({"title": key, "columns": [(c, c) for c in cols], "rows": value})
    return tables


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


# ---------------------------------------------------------------- rendering


def mode_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Modes present in the headline rows, ``common.MODE_ORDER`` first."""
    seen = {m for row in rows for m in row.get("values", {})}
    return [m for m in common.MODE_ORDER if m in seen] + sorted(seen - set(common.MODE_ORDER))


def headline_table(rows: Sequence[Mapping[str, Any]]) -> tuple[str, list[str]]:
    """(Markdown table of headline rows with ``mode / fsdp2`` ratio columns, modes)."""
    modes = mode_columns(rows)
    others = [m for m in modes if m != "fsdp2"]
    table_rows = []
    for row in rows:
        values = row.get("values", {})
        out = {"benchmark": row["benchmark"], "metric": row["metric"], "better": row["better"]}
        base = values.get("fsdp2")
        for m in modes:
            out[m] = values.get(m)
        for m in others:
            v = values.get(m)
            out[f"{m}_ratio"] = v / base if (v is not None and base) else None
        table_rows.append(out)
    cols = [("benchmark", "benchmark"), ("metric", "metric"), ("better", "better")]
    cols += [(m, m) for m in modes] + [(f"{m}_ratio", f"{m} / fsdp2") for m in others]
    return common.format_markdown_table(table_rows, cols), others


@dataclass(frozen=True)
class Floor:
    """A config's compute floor: ``low``..``high`` ms (equal for one figure), and where
    the figure comes from."""

    low: float
    high: float
    source: str


def step_config(r: Result) -> str:
    """The train config a step result measured (``args.config``, else from its name)."""
    return str((r.data.get("args") or {}).get("config") or r.name.removeprefix("step_"))


def step_floor(r: Result) -> Floor | None:
    """The compute floor of step result ``r``'s config: ``floor_ms`` of its rows, else of
    the newest ``*_floor_<config>.json`` (``bench_floor.py``) beside it; None where none
    is known."""
    config = step_config(r)
    in_rows = [row["floor_ms"] for row in r.data.get("rows", []) if row.get("floor_ms")]
    if in_rows:
        return Floor(min(in_rows), max(in_rows), f"{r.path.name} rows")
    for path in common.floor_files(r.path.parent, config):
        try:
            floor_ms = common.load_floor(path)["floor_ms"]
        except ValueError:  # no floor_ms: try the next older one
            continue
        return Floor(floor_ms, floor_ms, path.name)
    return None


def floor_label_source(source: str) -> str:
    """A short name of a floor's source for the figure: ``bench_floor <date> @<commit>``
    for a result file named ``<date>_<machine>_<commit>_floor_<config>.json``."""
    parts = source.split("_")
    if source.endswith(".json") and "_floor_" in source and len(parts) > 3:
        return f"bench_floor {parts[0]} @{parts[2]}"
    return source


def naming_result(measured: Sequence[Result]) -> Result:
    """The result whose metadata names the report (file name, header, image title): the
    newest step result, whose figures the headline image shows, else the newest result."""
    steps = [r for r in measured if r.kind == "step"]
    return max(steps or measured, key=lambda r: r.date)


def step_panels(results: Sequence[Result], machine: str | None = None) -> list[dict[str, Any]]:
    """One panel of the headline figure per step result: ``{"title", "source", "modes",
    "ms", "floor"}``, step ms per mode from its headline (best round), ``fsdp2`` first;
    ``source`` names the result's commit and date (and its machine where it is not
    ``machine``, the report's)."""
    steps = [r for r in results if r.kind == "step"]
    panels = []
    for r in sorted(steps, key=lambda r: (step_config(r), r.date)):
        row = next((h for h in headline_rows(r) if h["metric"] == STEP_METRIC), None)
        if row is None:
            continue
        values = {m: v for m, v in row["values"].items() if v is not None}
        modes = [m for m in mode_columns([row]) if m in values]
        config = step_config(r)
        source = f"@{r.meta.get('commit', '-')}, {r.date[:10] or 'undated'}"
        if machine is not None and r.meta.get("machine") != machine:
            source += f", {r.meta.get('machine', '-')}"
        panels.append({"title": CONFIG_TITLES.get(config, config), "source": source,
                       "modes": modes, "ms": [values[m] for m in modes],
                       "floor": step_floor(r)})  # fmt: skip
    return panels


MODE_COLORS = {"fsdp2": "#7f7f7f", "symm_mem": "#1f77b4", "tide": "#d62728"}


def write_step_figure(path: Path, panels: Sequence[Mapping[str, Any]], title: str) -> bool:
    """The headline PNG: a panel per step result (own y axis: step times differ 20x between
    configs) titled with its config, commit and date, a bar per mode labelled with its ms
    and its speed-up vs fsdp2 (1.000x on fsdp2's), mode names level under the bars; the
    compute floor as a dashed line (a band for a range). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"WARNING: matplotlib not available ({e}); skipping {path}", flush=True)
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 0.6, 4.6),
                             squeeze=False)  # fmt: skip
    for ax, panel in zip(axes[0], panels):
        modes, ms = panel["modes"], panel["ms"]
        base = ms[modes.index("fsdp2")] if "fsdp2" in modes else None
        colors = [MODE_COLORS.get(m.split("+")[0], "#ff7f0e") if "+" not in m else "#f4a582"
                  for m in modes]  # fmt: skip
        bars = ax.bar(range(len(modes)), ms, color=colors, width=0.7)
        top = max(ms) * 1.28
        for bar, mode, value in zip(bars, modes, ms):
            x = bar.get_x() + bar.get_width() / 2
            ax.text(x, value + top * 0.01, f"{value:.0f} ms", ha="center", va="bottom", fontsize=8)
            if base:
                ax.text(x, value * 0.5, f"{base / value:.3f}x", ha="center", va="center",
                        fontsize=10, fontweight="bold", color="white", rotation=90)  # fmt: skip
        if floor := panel.get("floor"):
            if floor.high > floor.low:
                ax.axhspan(floor.low, floor.high, color="black", alpha=0.25, lw=0)
                label = f"compute floor {floor.low:.0f}-{floor.high:.0f} ms"
            else:
                label = f"compute floor {floor.low:.0f} ms"
            ax.axhline(floor.low, color="black", ls="--", lw=1)
            ax.text(-0.45, top * 0.995, f"- - {label}\n({floor_label_source(floor.source)})",
                    ha="left", va="top", fontsize=7, color="#222222")  # fmt: skip
        else:
            ax.text(-0.45, top * 0.995, "compute floor not measured", ha="left", va="top",
                    fontsize=7, color="#222222")  # fmt: skip
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels([m.replace("+", "\n+") for m in modes], fontsize=8)
        ax.set_ylim(0, top)
        ax.set_title(f"{panel['title']}\n{panel['source']}", fontsize=9)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].set_ylabel("step time, ms (lower is better)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _meta_line(meta: Mapping[str, Any]) -> str:
    m = {k: meta.get(k, "-") for k in common.METADATA_KEYS}
    return (
        f"{m['machine']}, {m['world_size']} GPUs/ranks, torch {m['torch']}, NCCL {m['nccl']}, "
        f"commit {m['commit']}, {m['date']}"
    )


def _image(r: Result, out_dir: Path) -> str:
    png = r.path.with_suffix(".png")
    if not png.exists():
        return ""
    return f"![{r.name}]({os.path.relpath(png, out_dir)})\n"


def render(results: Sequence[Result], out_dir: Path, report_png: Path | None) -> str:
    """The whole report as Markdown (``results``: already selected)."""
    measured = [r for r in results if r.kind not in MODEL_KINDS]
    projections = [r for r in results if r.kind in MODEL_KINDS]
    order = {k: i for i, k in enumerate(KIND_ORDER)}
    measured.sort(key=lambda r: (order.get(r.kind, len(order)), r.name))
    newest = max(measured or results, key=lambda r: r.date)
    named = naming_result(measured or results)
    meta = named.meta
    lines = [
        f"# Benchmark report: {meta.get('machine', '-')}, commit {meta.get('commit', '-')}",
        "",
        "| | |",
        "| --- | --- |",
        f"| machine | {meta.get('machine', '-')} ({meta.get('hostname', '-')}) |",
        f"| GPUs (world size) | {meta.get('world_size', '-')} |",
        f"| torch | {meta.get('torch', '-')} |",
        f"| NCCL | {meta.get('nccl', '-')} |",
        f"| CUDA | {meta.get('cuda', '-')} |",
        f"| commit | {meta.get('commit', '-')} |",
        *([f"| step results (headline) | {meta.get('date', '-')} |"]
          if named is not newest else []),
        f"| newest result | {newest.date or '-'} |",
        f"| report written | {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')} |",
        "",
    ]
    commits = sorted({str(r.meta.get("commit")) for r in measured})
    machines = sorted({str(r.meta.get("machine")) for r in measured})
    if len(commits) > 1 or len(machines) > 1:
        lines += [
            (
                f"Sources span commits {', '.join(commits)} and machines "
                f"{', '.join(machines)} (see Sources)."
            ),
            "",
        ]
    heads = all_headline_rows(measured)
    lines += ["## Headline (by comm mode, ratios vs fsdp2)", ""]
    if heads:
        table, _ = headline_table(heads)
        lines += [
            table,
            (
                "Ratio = mode value / fsdp2 value: below 1 is better where `better` is "
                "`lower` (times, memory, shares, slowdowns), above 1 where it is `higher`."
            ),
            "",
        ]
        if report_png is not None:
            lines += [
                f"![headline: step time per mode]({os.path.relpath(report_png, out_dir)})",
                "",
                (
                    "Step time per comm mode and config (best round; speed-up vs fsdp2 on the "
                    "bars; dashed: the config's compute floor where measured, with its source)."
                ),
                "",
            ]
    else:
        lines += ["No headline figures in the selected results.", ""]
    name_counts: dict[tuple[str, str], int] = {}
    for r in measured:
        name_counts[(r.kind, r.name)] = name_counts.get((r.kind, r.name), 0) + 1
    for r in measured:
        title = KIND_TITLES.get(r.kind, r.kind)
        status = f", status {r.data['status']}" if r.data.get("status") else ""
        source = f"Source `{r.path.name}`: {_meta_line(r.meta)}{status}."
        twin = f" @{r.meta.get('commit')}" if name_counts[(r.kind, r.name)] > 1 else ""
        lines += [f"## {title}: `{r.name}`{twin}", "", source, ""]
        for table in detail_tables(r):
            lines += [f"### {table['title']}", ""]
            lines += [
                common.format_markdown_table(table["rows"], [tuple(c) for c in table["columns"]])
            ]
        if img := _image(r, out_dir):
            lines += [img]
    if projections:
        lines += [
            "## Projections (model estimates, not measurements)",
            "",
            (
                "Computed from a model of the system (`python -m torchtitan_tide.simulator "
                "--report`), not measured on a machine."
            ),
            "",
        ]
        for r in projections:
            lines += [f"### Projection: `{r.name}` (`{r.path.name}`)", ""]
            if desc := r.data.get("description") or r.data.get("title"):
                lines += [str(desc), ""]
            for table in detail_tables(r):
                lines += [f"Projection table `{table['title']}`:", ""]
                lines += [
                    common.format_markdown_table(
                        table["rows"], [tuple(c) for c in table["columns"]]
                    )
                ]
            if img := _image(r, out_dir):
                lines += [img]
    sources = [
        {
            "file": r.path.name,
            "kind": r.kind + (" (model estimate)" if r.kind in MODEL_KINDS else ""),
            "machine": r.meta.get("machine"),
            "world": r.meta.get("world_size"),
            "torch": r.meta.get("torch"),
            "nccl": r.meta.get("nccl"),
            "commit": r.meta.get("commit"),
            "date": r.meta.get("date"),
        }
        for r in [*measured, *projections]
    ]
    lines += ["## Sources", "", common.format_markdown_table(sources, list(sources[0]))]
    return "\n".join(lines)


def write_report(results: Sequence[Result], out_dir: Path) -> Path:
    """Write the report (and its ratio PNG); returns the Markdown path."""
    if not results:
        raise ValueError("no benchmark results to report")
    measured = [r for r in results if r.kind not in MODEL_KINDS] or list(results)
    named = naming_result(measured)
    machine = str(named.meta.get("machine", "unknown"))
    meta = {"date": named.date or "unknown", "machine": machine,
            "commit": named.meta.get("commit", "unknown")}  # fmt: skip
    stem = common.result_stem(out_dir, "report", meta)
    png = Path(str(stem) + ".png")
    panels = step_panels(measured, machine)
    wrote_png = bool(panels) and write_step_figure(
        png, panels, f"Training step time per comm mode, {machine} "
        "(lower is better; speed-up vs fsdp2 on the bars; compute floor on one GPU)"
    )
    text = render(results, out_dir, png if wrote_png else None)
    md = Path(str(stem) + ".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    return md


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="result JSONs (default: newest per kind and name)")
    ap.add_argument("--results-dir", default="bench/results")
    ap.add_argument("--out-dir", default=None, help="default: --results-dir")
    args = ap.parse_args(argv)
    if args.files:
        results = [r for f in args.files if (r := load_result(Path(f))) is not None]
    else:
        found = sorted(Path(args.results_dir).glob("*.json"))
        results = select_latest([r for f in found if (r := load_result(f)) is not None])
    if not results:
        print(f"no benchmark results in {args.files or args.results_dir}", file=sys.stderr)
        return 1
    md = write_report(results, Path(args.out_dir or args.results_dir))
    print(f"report: {md}", flush=True)
    print(md.read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
