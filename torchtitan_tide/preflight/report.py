"""The preflight's result: rows of one table, the JSON beside it, and the exit status.

A :class:`Row` is one finding of one check: ``status`` is ``ok``, ``FAIL`` (the run should not
start as it is: the row names the ranks and the fix), ``warn`` (worth reading, not blocking),
``skip`` (the check cannot run here, with why) or ``info`` (what was found). Rank 0 prints
the rows of every rank as one table (:func:`table`), the failures again below it with their
fixes (:func:`failure_lines`), and writes everything as JSON (:func:`write_json`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("ok", "FAIL", "warn", "skip", "info")
# The checks in the order the table shows them (the preflight's five items).
CHECK_ORDER = ("ranks", "paths", "one_sided", "parity", "rates", "preflight")
EXIT_FAILED = 1  # a check failed (rank 0's exit status; every check ran)
EXIT_TIMEOUT = 124  # a check did not finish within its bound (the rank that timed out)


@dataclass
class Row:
    """One finding: ``check`` (one of :data:`CHECK_ORDER`), ``what`` it is about, its
    ``status``, the ``detail``; for a failure the global ``ranks`` concerned and the ``fix``."""

    check: str
    what: str
    status: str
    detail: str
    ranks: list[int] = field(default_factory=list)
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"row status {self.status!r} is not one of {STATUSES}")


def ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``; ``[3]`` -> ``"rank 3"``."""
    ranks = sorted(set(ranks))
    if not ranks:
        return "no rank"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def ordered(rows: list[Row]) -> list[Row]:
    """``rows`` in :data:`CHECK_ORDER` (stable within a check)."""
    rank = {name: i for i, name in enumerate(CHECK_ORDER)}
    return sorted(rows, key=lambda row: rank.get(row.check, len(rank)))


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def table(rows: list[Row]) -> str:
    """The rows as one Markdown table (``| check | what | status | detail |``)."""
    lines = ["| check | what | status | detail |", "| --- | --- | --- | --- |"]
    for row in ordered(rows):
        lines.append(f"| {row.check} | {_cell(row.what)} | {row.status} | {_cell(row.detail)} |")
    return "\n".join(lines)


RESULT = ("preflight", "result")  # the summary row: not a failure of its own


def failures(rows: list[Row]) -> list[Row]:
    return [row for row in ordered(rows)
            if row.status == "FAIL" and (row.check, row.what) != RESULT]  # fmt: skip


def failure_lines(rows: list[Row]) -> list[str]:
    """One line per failed row: ranks, check, what, detail and the fix."""
    return [
        f"FAIL {ranks_text(row.ranks) if row.ranks else 'job'}: {row.check} / {row.what}: "
        f"{row.detail}" + (f" -- fix: {row.fix}" if row.fix else "")
        for row in failures(rows)
    ]


def stamp(now: float | None = None) -> str:
    """The file-name time of a preflight run (UTC): ``20261204-163701``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))


def preflight_folder(dump_folder: str) -> Path:
    """``<dump_folder>/preflight`` (created)."""
    folder = Path(dump_folder) / "preflight"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_json(path: Path, rows: list[Row], extra: dict[str, Any]) -> Path:
    """``rows`` and ``extra`` (facts per rank, rates, ...) as one JSON file at ``path``."""
    record = {
        "rows": [asdict(row) for row in ordered(rows)],
        "failed": [asdict(row) for row in failures(rows)],
        **extra,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path
