"""Where the simulator's measured inputs live: the committed benchmark results under
``bench/results`` (JSON), read by file name or as the newest of a kind."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


class SimulateError(ValueError):
    """Bad simulator input; the message names the flag, file or key and the fix."""


def read_result(results_dir: Path, name: str) -> dict[str, Any]:
    """A committed benchmark result (JSON) by file name; a named error when missing."""
    path = Path(results_dir) / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SimulateError(
            f"{path}: missing (a committed benchmark result the simulator reads)"
        ) from None


def newest(found: Sequence[Path]) -> Path | None:
    """The newest of ``found`` by its metadata date, then name; None when empty."""
    dated = [
        (json.loads(p.read_text()).get("metadata", {}).get("date", ""), p.name, p) for p in found
    ]
    return max(dated)[2] if dated else None

