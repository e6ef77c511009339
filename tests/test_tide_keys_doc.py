"""docs/guide/tide-keys.md stays true: its table names every ``[tide]`` key, each with the
default of ``torchtitan_tide.config.Tide``, its ``comm.apply`` keyword where it has one, and
every key has a paragraph of its own below the table."""

import re
from dataclasses import fields
from pathlib import Path

from torchtitan_tide.comm.options import TOML_KEYS, TideOptions
from torchtitan_tide.config import Tide

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "tide-keys.md"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _table() -> dict[str, list[str]]:
    """Key -> the cells of its row in the page's table (``| `key` | `default` | ...``)."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        match = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_the_table_names_every_key_with_its_default():
    rows, defaults = _table(), Tide()
    keys = [f.name for f in fields(Tide)]
    assert sorted(rows) == sorted(keys), f"{PAGE.name} table vs Tide fields"
    for key in keys:
        assert rows[key][0] == f"`{_toml(getattr(defaults, key))}`", (key, rows[key])


def test_the_apply_keyword_column_matches_tide_options():
    rows = _table()
    keyword_of = {TOML_KEYS.get(f.name, f.name): f.name for f in fields(TideOptions)}
    for key, cells in rows.items():
        if key in keyword_of:
            assert cells[2].startswith(f"`{keyword_of[key]}`"), (key, cells)
        elif key != "comm":
            assert cells[2] == "-", (key, cells)


def test_every_key_has_a_paragraph():
    text = PAGE.read_text()
    missing = [f.name for f in fields(Tide) if f"**`{f.name}`**" not in text]
    assert not missing, f"{PAGE.name} has no paragraph for {missing}"
