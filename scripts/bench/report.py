"""One Markdown report from the benchmark result files (issue 5, "The suite").

    python scripts/bench/report.py [--results-dir bench/results] [--out-dir DIR] [FILE.json ...]

Without files: the newest result of every (kind, name) under ``--results-dir``, where
``name`` is the part of the file name after ``<date>_<machine>_<commit>_`` (e.g.
``collectives``, ``step_h200x2_llama70b_4layers``); smoke and small test runs
(``*_smoke``, ``*_small``) are left out. A file's ``kind`` is its top-level ``"kind"``
(``ag``, ``collectives``, ``interference``, ``step``, ``projection``, ...); files
written before that key existed are recognized by name (``ag``, ``step_*``).

Writes ``<out-dir>/<date>_<machine>_<commit>_report.md`` (default out-dir: the results
dir) with the date, machine and commit of the newest measured result: metadata, one
headline table of every result's headline figures by comm mode with ratios to
``fsdp2``, each result's own tables with its PNG embedded, projections (JSONs of kind
``projection``, shown generically and labeled as model estimates, not measurements),
and the list of sources. Also ``<stem>_report.png``: the headline ratios per mode.
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
}
KIND_ORDER = ("step", "collectives", "interference", "ag")
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
    if "metadata" not in data and kind != "projection":
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
    if r.kind == "projection":
        return []  # projections never enter the measured headline
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


def ratio_charts(rows: Sequence[Mapping[str, Any]]) -> list[common.BarChart]:
    """One chart per non-fsdp2 mode: its headline values divided by fsdp2's."""
    charts = []
    for mode in [m for m in mode_columns(rows) if m != "fsdp2"]:
        labels, values = [], []
        for row in rows:
            base, v = row["values"].get("fsdp2"), row["values"].get(mode)
            if v is not None and base:
                labels.append(f"{row['benchmark']}: {row['metric']}")
                values.append(v / base)
        if labels:
            charts.append(common.BarChart(f"{mode} / fsdp2", labels, values, "ratio"))
    return charts


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
    measured = [r for r in results if r.kind != "projection"]
    projections = [r for r in results if r.kind == "projection"]
    order = {k: i for i, k in enumerate(KIND_ORDER)}
    measured.sort(key=lambda r: (order.get(r.kind, len(order)), r.name))
    newest = max(measured or results, key=lambda r: r.date)
    meta = newest.meta
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
        f"| newest result | {meta.get('date', '-')} |",
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
            lines += [f"![headline ratios]({os.path.relpath(report_png, out_dir)})", ""]
    else:
        lines += ["No headline figures in the selected results.", ""]
    for r in measured:
        title = KIND_TITLES.get(r.kind, r.kind)
        source = (
            f"Source `{r.path.name}`: {_meta_line(r.meta)}, status {r.data.get('status', '-')}."
        )
        lines += [f"## {title}: `{r.name}`", "", source, ""]
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
                "Computed by `scripts/bench/projection.py` from a model of the system, not "
                "measured on a machine."
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
            "kind": r.kind + (" (projection)" if r.kind == "projection" else ""),
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
    measured = [r for r in results if r.kind != "projection"] or list(results)
    newest = max(measured, key=lambda r: r.date)
    meta = {"date": newest.date or "unknown", "machine": newest.meta.get("machine", "unknown"),
            "commit": newest.meta.get("commit", "unknown")}  # fmt: skip
    stem = common.result_stem(out_dir, "report", meta)
    heads = all_headline_rows(measured)
    png = Path(str(stem) + ".png")
    charts = ratio_charts(heads)
    wrote_png = bool(charts) and common.write_bar_png(
        png, charts, f"{meta['machine']}, commit {meta['commit']}: mode / fsdp2"
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
