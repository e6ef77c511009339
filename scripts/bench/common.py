"""Small pure helpers shared by the benchmarks under ``scripts/bench``.

Result files of one benchmark run share one stem,
``<out_dir>/<YYYY-MM-DD>_<machine-slug>_<commit>_<name>``, with the suffixes
``.json`` (everything, machine-readable), ``.md`` (tables) and ``.png`` (chart).
A result JSON holds ``kind`` (``"ag"``, ``"collectives"``, ``"interference"``,
``"step"``, ...), ``metadata`` (:func:`metadata`), and, for ``report.py``,
``tables`` (``[{"title", "columns": [[key, header], ...], "rows": [...]}]``)
and ``headline`` (:func:`headline_row` dicts).

Also here: reading torch-profiler chrome traces (device rows, SM-weighted
kernel time, kernels attributed to the CPU op or ``bench::`` range that
launched them). Processes, timing and FSDP plumbing live in ``harness.py``.

Nothing here needs a GPU: ``metadata`` asks torch about CUDA only when it is
available, and matplotlib is imported lazily (missing -> no PNG, a warning).
"""

from __future__ import annotations

import argparse
import bisect
import datetime as _dt
import gzip
import json
import math
import os
import re
import socket
import statistics
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LAYOUT_KERNELS",
    "MODE_ORDER",
    "RESULTS_DIR",
    "BarChart",
    "add_out_dir",
    "announce_results",
    "bus_gibps",
    "classify_device_event",
    "device_events",
    "format_cell",
    "format_markdown_table",
    "git_commit",
    "grid_ctas",
    "headline_row",
    "label_by_launching_op",
    "label_by_range",
    "layout_conversion",
    "load_chrome_trace",
    "machine_name",
    "median",
    "metadata",
    "min_or_none",
    "result_stem",
    "short_error",
    "slugify",
    "sm_weighted_us",
    "step_work_parser",
    "summarize_device_events",
    "write_bar_png",
    "write_json",
    "write_markdown_table",
    "write_result",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = "bench/results"
STEP_CONFIG = "h200x2_llama70b_4layers"  # the training step the step benchmarks default to
METADATA_KEYS = (
    "date",
    "machine",
    "hostname",
    "torch",
    "nccl",
    "cuda",
    "commit",
    "world_size",
)


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (mean of the middle two for even length).
    Raises ``ValueError`` on an empty sequence."""
    if len(values) == 0:
        raise ValueError("median of an empty sequence")
    return float(statistics.median(values))


def slugify(text: str) -> str:
    """Lower-case ``text`` with every run of non-alphanumerics replaced by one
    ``-`` and no leading/trailing ``-``; ``"unknown"`` if nothing is left.
    E.g. ``"NVIDIA H200 x 2"`` -> ``"nvidia-h200-x-2"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug or "unknown"


def git_commit(repo_dir: str | os.PathLike | None = None) -> str:
    """``$TIDE_COMMIT`` when set (the GPU machine runs a copy of the tree whose
    ``git`` may answer for another checkout); else the short commit of ``repo_dir``
    (default: this repository) from ``git rev-parse --short HEAD``, with ``-dirty`` when a
    tracked file differs from it (the results were not made by that commit's code, or the
    copy's ``.git`` is stale); else ``"unknown"``."""
    if os.environ.get("TIDE_COMMIT"):
        return os.environ["TIDE_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=str(repo_dir or REPO_ROOT),
                              capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()  # fmt: skip

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not commit:
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def machine_name() -> str:
    """``"<GPU name> x <count>"`` of the visible CUDA devices, ``"cpu"`` without CUDA."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "cpu"
    return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"


def _nccl_version() -> str | None:
    """The NCCL this process loaded (``ncclGetVersion``: torch reports the version it was
    built with, also after the library was replaced), else torch's report, else None."""
    import torch

    try:
        from torchtitan_tide.comm.transports.windows import nccl_rma

        if (code := nccl_rma.nccl_version()) is not None:
            return nccl_rma.version_text(code)
    except ImportError:
        pass
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def metadata(
    world_size: int,
    repo_dir: str | os.PathLike | None = None,
    machine: str | None = None,
    now: _dt.datetime | None = None,
) -> dict[str, Any]:
    """Run metadata with exactly the keys ``METADATA_KEYS``:
    ``date`` (UTC, ISO 8601 seconds), ``machine`` (``machine_name()`` unless
    given), ``hostname``, ``torch``/``nccl``/``cuda`` versions (``None`` when
    absent), ``commit`` (``git_commit(repo_dir)``) and ``world_size``."""
    import torch

    now = now or _dt.datetime.now(_dt.timezone.utc)
    return {
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine if machine is not None else machine_name(),
        "hostname": socket.gethostname(),
        "torch": torch.__version__,
        "nccl": _nccl_version(),
        "cuda": torch.version.cuda,
        "commit": git_commit(repo_dir),
        "world_size": int(world_size),
    }


def result_stem(out_dir: str | os.PathLike, name: str, meta: Mapping[str, Any]) -> Path:
    """``out_dir/<YYYY-MM-DD>_<slugify(machine)>_<commit>_<name>`` (no suffix).
    ``meta`` needs ``date`` (ISO, date first), ``machine`` and ``commit``."""
    day = str(meta["date"])[:10]
    commit = slugify(str(meta.get("commit") or "unknown"))
    return Path(out_dir) / f"{day}_{slugify(str(meta['machine']))}_{commit}_{name}"


def add_out_dir(parser: argparse.ArgumentParser) -> None:
    """``--out-dir`` (default :data:`RESULTS_DIR`): where a run's ``<stem>.*`` go."""
    parser.add_argument("--out-dir", default=RESULTS_DIR,
                        help=f"folder of the result files (default {RESULTS_DIR})")  # fmt: skip


def step_work_parser(description: str, measured: str) -> argparse.ArgumentParser:
    """The options of a benchmark of one rank's work of a training step (``bench_floor``,
    ``bench_trace``): ``--config`` (a name in train_configs/ or a path), ``--world-size``
    (ranks of the step whose per-GPU work is ``measured``), ``--device``, ``--warmup``,
    ``--out-dir``. The script adds its own; ``parse_known_args`` leaves TorchTitan's
    ``--section.key value`` overrides for the job config."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=STEP_CONFIG)
    parser.add_argument("--world-size", type=int, default=2,
                        help=f"ranks of the step whose per-GPU work is {measured}")  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    parser.add_argument("--warmup", type=int, default=2)
    add_out_dir(parser)
    return parser


def announce_results(stem: str | os.PathLike, markdown: str) -> None:
    """Print where a run's files are, then its Markdown (:func:`write_result`'s return):
    the tables are the last lines of every benchmark's output."""
    print(f"results: {stem}.json / .md / .png", flush=True)
    print(markdown, flush=True)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # 0-d tensors / numpy scalars
        return obj.item()
    return str(obj)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (non-JSON values as ``str``), creating
    parent directories; NaN/inf floats are written as ``null``. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(obj), indent=2, default=_json_default) + "\n")
    return path


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def format_cell(value: Any, digits: int = 3) -> str:
    """One Markdown cell: ``None`` -> ``-``; bool -> ``yes``/``no``; float ->
    ``digits`` decimals (``-`` if NaN); anything else ``str``; ``|`` escaped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def format_markdown_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str | tuple[str, str]],
    digits: int = 3,
) -> str:
    """A GitHub Markdown table. ``columns`` are row keys, or ``(key, header)``
    pairs; a key missing from a row shows as ``-``. Ends with a newline."""
    cols = [(c, c) if isinstance(c, str) else (c[0], c[1]) for c in columns]
    lines = [
        "| " + " | ".join(h for _, h in cols) + " |",
        "|" + "|".join(" --- " for _ in cols) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(format_cell(row.get(k), digits) for k, _ in cols) + " |")
    return "\n".join(lines) + "\n"


def write_markdown_table(
    path: str | os.PathLike,
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str | tuple[str, str]],
    title: str | None = None,
    extra: str = "",
) -> str:
    """Write ``# title`` (if given), the table and ``extra`` Markdown to
    ``path`` (parents created); returns the text written."""
    parts = [f"# {title}\n"] if title else []
    parts.append(format_markdown_table(rows, columns))
    if extra:
        parts.append(extra if extra.endswith("\n") else extra + "\n")
    text = "\n".join(parts)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


@dataclass(frozen=True)
class BarChart:
    """One panel of ``write_bar_png``: a bar per label (``None`` = no bar)."""

    title: str
    labels: Sequence[str]
    values: Sequence[float | None]
    ylabel: str


def write_bar_png(path: str | os.PathLike, charts: Sequence[BarChart], title: str = "") -> bool:
    """Draw one bar-chart panel per ``BarChart`` side by side into a PNG at
    ``path`` (matplotlib, Agg backend). Returns False, printing a warning,
    when matplotlib is missing; True once written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"WARNING: matplotlib not available ({e}); skipping {path}", flush=True)
        return False
    if not charts:
        raise ValueError("write_bar_png needs at least one chart")
    fig, axes = plt.subplots(1, len(charts), figsize=(6 * len(charts), 4.5), squeeze=False)
    for ax, chart in zip(axes[0], charts):
        xs = list(range(len(chart.labels)))
        vals = [v if v is not None and math.isfinite(v) else 0.0 for v in chart.values]
        bars = ax.bar(xs, vals, color="tab:blue")
        for bar, v in zip(bars, chart.values):
            if v is not None and math.isfinite(v):
                ax.annotate(
                    f"{v:.3g}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(xs)
        ax.set_xticklabels(list(chart.labels), rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(chart.ylabel)
        ax.set_title(chart.title, fontsize=10)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- numbers and result files

MODE_ORDER = ("fsdp2", "symm_mem", "tide", "tide_ag")  # table/column order of comm modes


def min_or_none(values: Iterable[float | None]) -> float | None:
    """Smallest of the values that are not None; None if there is none."""
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


def short_error(err: str | None, n: int = 90) -> str | None:
    """First line of ``err``, cut to ``n`` characters; None stays None. A text that holds a
    traceback (a spawned process's error: its first line is empty or names the process)
    gives its last non-empty line instead, the error itself, after ``err``'s first word."""
    if err is None:
        return None
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    if "Traceback (most recent call last)" in err and lines:
        err = f"{err.split(':')[0]}: {lines[-1]}"
    else:
        err = err.splitlines()[0] if err else err
    return err if len(err) <= n else err[: n - 3] + "..."


def bus_gibps(nbytes: int, world: int, ms: float | None) -> float | None:
    """Bus bandwidth ``nbytes * (world - 1) / world / time`` in GiB/s (``nbytes``:
    unsharded bytes of the collective); None without a positive time."""
    if ms is None or ms <= 0:
        return None
    return nbytes * (world - 1) / world / (ms / 1e3) / 2**30


def headline_row(
    benchmark: str, metric: str, values: Mapping[str, float | None], better: str = "lower"
) -> dict[str, Any]:
    """One headline figure of a result: ``values`` maps comm mode -> value;
    ``better`` ("lower" | "higher") says which way is an improvement."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better={better!r} must be 'lower' or 'higher'")
    return {"benchmark": benchmark, "metric": metric, "better": better, "values": dict(values)}


def write_result(
    stem: str | os.PathLike,
    results: Mapping[str, Any],
    title: str,
    notes: str = "",
    charts: Sequence[BarChart] = (),
) -> str:
    """Write ``<stem>.json`` (``results``), ``<stem>.md`` (``# title``, then every
    table of ``results["tables"]`` under ``## <its title>``, then ``notes``) and,
    when ``charts`` are given, ``<stem>.png``. Returns the Markdown."""
    stem = str(stem)
    write_json(stem + ".json", results)
    parts = [f"# {title}\n"]
    for table in results.get("tables", []):
        parts.append(f"## {table['title']}\n")
        parts.append(format_markdown_table(table["rows"], [tuple(c) for c in table["columns"]]))
    if notes:
        parts.append(notes if notes.endswith("\n") else notes + "\n")
    text = "\n".join(parts)
    Path(stem + ".md").write_text(text)
    if charts:
        meta = results.get("metadata", {})
        write_bar_png(
            stem + ".png",
            charts,
            f"{meta.get('machine')}, commit {meta.get('commit')}, {meta.get('date')}",
        )
    return text


# ---------------------------------------------------------------- profiler traces

LAYOUT_KERNELS = ("chunk_cat", "split_with_sizes_copy", "all_gather_copy_in")
_DEVICE_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def classify_device_event(name: str) -> str:
    """Kind of a profiler device row by its name: ``memcpy`` (Memcpy PtoP/DtoD/...),
    ``memset``, ``nccl_kernel`` or ``other_kernel``."""
    n = name.lower()
    if n.startswith("memcpy"):
        return "memcpy"
    if n.startswith("memset"):
        return "memset"
    if "nccl" in n:
        return "nccl_kernel"
    return "other_kernel"


def load_chrome_trace(path: str | os.PathLike) -> list[dict]:
    """The ``traceEvents`` of a chrome trace written by torch.profiler
    (``.json``, or gzip-compressed ``.json.gz``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return list(data.get("traceEvents", [])) if isinstance(data, Mapping) else list(data)


def device_events(events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The complete (``"ph": "X"``) device rows of a trace, by start time: kernels
    (``cat`` ``kernel``), copies (``gpu_memcpy``) and memsets (``gpu_memset``)."""
    rows = [e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATEGORIES]
    return sorted(rows, key=lambda e: float(e.get("ts", 0.0)))


def grid_ctas(event: Mapping[str, Any]) -> int | None:
    """Thread blocks (CTAs) of a kernel row: the product of ``args["grid"]``;
    None when the row has no grid (memcpy, memset, older traces)."""
    grid = (event.get("args") or {}).get("grid")
    if not grid:
        return None
    return int(math.prod(int(g) for g in grid))


def sm_weighted_us(dur_us: float, ctas: int | None, sm_count: int) -> float:
    """``dur_us * min(1, ctas / sm_count)``: a kernel with fewer CTAs than the GPU has
    SMs occupies only that share of the SMs for its duration. Unknown CTAs count
    as the whole GPU."""
    if ctas is None or sm_count <= 0:
        return float(dur_us)
    return float(dur_us) * min(1.0, ctas / sm_count)


def summarize_device_events(
    rows: Iterable[Mapping[str, Any]], sm_count: int, steps: int = 1, top: int = 12
) -> dict[str, Any]:
    """Per-step device time (ms) of trace device rows over ``steps`` steps:
    ``kernel_ms`` (plain sum of kernel durations), ``kernel_sm_weighted_ms``
    (:func:`sm_weighted_us`), the same two for NCCL kernels alone, ``memcpy_ms``
    (copy-engine time), ``memset_ms``, and the ``top`` kernels by time
    (``name``, ``ms``, ``sm_weighted_ms``, ``ctas``, ``count``)."""
    out = dict.fromkeys(
        (
            "kernel_ms",
            "kernel_sm_weighted_ms",
            "nccl_kernel_ms",
            "nccl_kernel_sm_weighted_ms",
            "memcpy_ms",
            "memset_ms",
        ),
        0.0,
    )
    kernels: dict[str, dict[str, Any]] = {}
    for row in rows:
        ms = float(row.get("dur", 0.0)) / 1e3 / steps
        kind = _DEVICE_CATEGORIES.get(row.get("cat", ""), "kernel")
        if kind != "kernel":
            out[f"{kind}_ms"] += ms
            continue
        name = str(row.get("name", "?"))
        ctas = grid_ctas(row)
        weighted = sm_weighted_us(ms, ctas, sm_count)
        out["kernel_ms"] += ms
        out["kernel_sm_weighted_ms"] += weighted
        if classify_device_event(name) == "nccl_kernel":
            out["nccl_kernel_ms"] += ms
            out["nccl_kernel_sm_weighted_ms"] += weighted
        k = kernels.setdefault(name, {"name": name, "ms": 0.0, "sm_weighted_ms": 0.0, "count": 0})
        k["ms"] += ms
        k["sm_weighted_ms"] += weighted
        k["count"] += 1
        k["ctas"] = ctas
    out["kernels"] = sorted(kernels.values(), key=lambda k: -k["ms"])[:top]
    return out


def _enclosing_labels(
    events: Sequence[Mapping[str, Any]],
    label_of: Callable[[str], str | None],
    categories: Sequence[str],
) -> dict[int, str]:
    """Correlation id -> ``label_of(name)`` of the CPU event (``cat`` in
    ``categories``) that encloses, on the same thread, the CUDA runtime or driver
    call that launched the work with that correlation id."""
    spans: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in categories:
            continue
        label = label_of(str(e.get("name", "")))
        if label is not None:
            ts = float(e["ts"])
            spans.setdefault((e.get("pid"), e.get("tid")), []).append(
                (ts, ts + float(e.get("dur", 0.0)), label)
            )
    found: dict[int, str] = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") not in _LAUNCH_CATEGORIES or corr is None:
            continue
        ts = float(e.get("ts", 0.0))
        for start, end, label in spans.get((e.get("pid"), e.get("tid")), ()):
            if start <= ts <= end:
                found[int(corr)] = label
                break
    return found


def _correlation(row: Mapping[str, Any]) -> int | None:
    corr = (row.get("args") or {}).get("correlation")
    return int(corr) if corr is not None else None


def label_by_range(
    events: Iterable[Mapping[str, Any]], prefix: str = "bench::"
) -> list[tuple[str, Mapping[str, Any]]]:
    """``(label, row)`` for every device row, where the label is the name (without
    ``prefix``) of the CPU ``record_function`` range starting with ``prefix`` that
    launched the row (found through the launch call's correlation id); a row
    whose launch is not in the trace gets the range that began last before the
    row started (exact when the device is synchronized at every range boundary,
    as the benchmarks do), ``""`` before any range."""
    events = list(events)

    def label_of(name: str) -> str | None:
        return name[len(prefix) :] if name.startswith(prefix) else None

    by_launch = _enclosing_labels(events, label_of, ("user_annotation", "cpu_op"))
    ranges = sorted(
        (float(e["ts"]), label)
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("user_annotation", "cpu_op")
        and (label := label_of(str(e.get("name", "")))) is not None
    )
    starts = [ts for ts, _ in ranges]
    out = []
    for row in device_events(events):
        label = by_launch.get(_correlation(row) or -1)
        if label is None:
            i = bisect.bisect_right(starts, float(row.get("ts", 0.0))) - 1
            label = ranges[i][1] if i >= 0 else ""
        out.append((label, row))
    return out


def label_by_launching_op(
    events: Iterable[Mapping[str, Any]], labels: Sequence[str]
) -> dict[int, str]:
    """Correlation id -> the first of ``labels`` that is part of the name of a CPU
    op (``cat`` ``cpu_op``) enclosing the launch of the work with that id."""

    def label_of(name: str) -> str | None:
        return next((lab for lab in labels if lab in name), None)

    return _enclosing_labels(list(events), label_of, ("cpu_op",))


REDUCE_RANGE = "FSDP::post_backward_reduce"  # FSDP2's range around one group's reduce


def reduce_kernels(
    events: Iterable[Mapping[str, Any]], sm_count: int, steps: int = 1
) -> dict[str, Any]:
    """Per-step SM time of the gradient reduce: every kernel launched inside FSDP2's
    ``FSDP::post_backward_reduce`` range (stock: ``chunk_cat`` + the NCCL
    reduce-scatter + any division; symm_mem the same with NCCL's symmetric kernel;
    TIDE: the accumulate and barrier kernels). Copies are not kernels: the copy
    engine's time is ``memcpy_ms``. Keys: ``kernel_ms`` (sum of durations),
    ``kernel_sm_weighted_ms`` (None when ``sm_count`` is 0), ``memcpy_ms``, ``rows``."""
    events = list(events)
    by_launch = _enclosing_labels(
        events,
        lambda name: "reduce" if name.startswith(REDUCE_RANGE) else None,
        ("user_annotation",),
    )
    out: dict[str, Any] = {"kernel_ms": 0.0, "kernel_sm_weighted_ms": 0.0, "memcpy_ms": 0.0}
    count = 0
    for row in device_events(events):
        if by_launch.get(_correlation(row) or -1) != "reduce":
            continue
        ms = float(row.get("dur", 0.0)) / 1e3 / steps
        count += 1
        if row.get("cat") == "gpu_memcpy":
            out["memcpy_ms"] += ms
        elif row.get("cat") == "kernel":
            out["kernel_ms"] += ms
            out["kernel_sm_weighted_ms"] += sm_weighted_us(ms, grid_ctas(row), sm_count)
    if sm_count <= 0:
        out["kernel_sm_weighted_ms"] = None
    out["rows"] = count
    return out


def layout_conversion(events: Iterable[Mapping[str, Any]], steps: int = 1) -> dict[str, Any]:
    """Per-step device ms of FSDP2's layout-conversion work in a trace: every
    device row named after one of :data:`LAYOUT_KERNELS` (``chunk_cat``: RS
    copy-in, ``split_with_sizes_copy``: AG copy-out, ``all_gather_copy_in``) or
    launched inside the CPU op of that name (``all_gather_copy_in`` runs as a
    generic ``_foreach_copy_`` kernel). Keys: each name's ms, ``total_ms``,
    ``rows`` (device rows counted)."""
    events = list(events)
    by_launch = label_by_launching_op(events, LAYOUT_KERNELS)
    out: dict[str, Any] = {f"{name}_ms": 0.0 for name in LAYOUT_KERNELS}
    count = 0
    for row in device_events(events):
        name = str(row.get("name", ""))
        label = next((lab for lab in LAYOUT_KERNELS if lab in name), None)
        if label is None:
            label = by_launch.get(_correlation(row) or -1)
        if label is not None:
            out[f"{label}_ms"] += float(row.get("dur", 0.0)) / 1e3 / steps
            count += 1
    out["total_ms"] = sum(out[f"{name}_ms"] for name in LAYOUT_KERNELS)
    out["rows"] = count
    return out


def floor_files(results_dir: str | Path, config: str) -> list[Path]:
    """The ``*_floor_<config>.json`` (``bench_floor.py``) results under ``results_dir``,
    newest first (metadata date, then file name); unreadable files left out."""
    found = []
    for path in Path(results_dir).glob(f"*_floor_{config}.json"):
        try:
            date = str(json.loads(path.read_text()).get("metadata", {}).get("date", ""))
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        found.append((date, path.name, path))
    return [path for _, _, path in sorted(found, reverse=True)]


def find_floor(results_dir: str | Path, config: str) -> Path | None:
    """The newest ``*_floor_<config>.json`` under ``results_dir``; None when there is none."""
    files = floor_files(results_dir, config)
    return files[0] if files else None


def load_floor(path: str | Path) -> dict[str, Any]:
    """``floor_ms`` and provenance of a ``bench_floor.py`` result. Raises ``ValueError``
    naming the file when it has no ``floor_ms``."""
    data = json.loads(Path(path).read_text())
    floor_ms = data.get("floor_ms")
    if isinstance(floor_ms, bool) or not isinstance(floor_ms, (int, float)) or floor_ms <= 0:
        raise ValueError(f"{path}: no top-level floor_ms (not a bench_floor.py result?)")
    meta = data.get("metadata") or {}
    return {
        "floor_ms": float(floor_ms),
        "file": Path(path).name,
        "config": data.get("config"),
        "machine": meta.get("machine"),
        "commit": meta.get("commit"),
        "date": meta.get("date"),
        "world_size": data.get("world_size", meta.get("world_size")),
    }
