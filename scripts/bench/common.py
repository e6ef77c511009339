"""Small pure helpers shared by the benchmarks under ``scripts/bench``.

Result files of one benchmark run share one stem,
``<out_dir>/<YYYY-MM-DD>_<machine-slug>_<commit>_<name>``, with the suffixes
``.json`` (everything, machine-readable), ``.md`` (tables) and ``.png`` (chart).

Nothing here needs a GPU: ``metadata`` asks torch about CUDA only when it is
available, and matplotlib is imported lazily (missing -> no PNG, a warning).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import socket
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BarChart",
    "format_cell",
    "format_markdown_table",
    "git_commit",
    "machine_name",
    "median",
    "metadata",
    "result_stem",
    "slugify",
    "write_bar_png",
    "write_json",
    "write_markdown_table",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
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
    """Short commit of ``repo_dir`` (default: this repository) from
    ``git rev-parse --short HEAD``; else ``$TIDE_COMMIT`` (set it where the tree is a copy
    without ``.git``, e.g. on the GPU machine); else ``"unknown"``."""
    fallback = os.environ.get("TIDE_COMMIT") or "unknown"
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=str(repo_dir or REPO_ROOT),
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return fallback
    return out.stdout.strip() or fallback


def machine_name() -> str:
    """``"<GPU name> x <count>"`` of the visible CUDA devices, ``"cpu"`` without CUDA."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "cpu"
    return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"


def _nccl_version() -> str | None:
    import torch

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
