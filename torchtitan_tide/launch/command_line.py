"""The launcher's command line: the config it names, the overrides and their values.

``run_train.sh --config NAME[.toml] [--dry-run] [--preflight] [--section.key value ...]``:
NAME is looked up in ``train_configs/`` first, then as a path (:func:`resolve_config`);
``--preflight`` runs the preflight checks instead of training (``torchtitan_tide/preflight``);
the overrides go to TorchTitan unchanged, booleans rewritten to the flag form its parser takes
(:func:`normalize_bool_flags`). The train entry reads its own arguments with the same
functions (``torchtitan_tide/train.py``).
"""

from __future__ import annotations

import typing
from dataclasses import fields
from pathlib import Path
from typing import NamedTuple

from torchtitan_tide.launch.errors import LaunchError

if typing.TYPE_CHECKING:
    from torchtitan_tide.config import Tide

# torchtitan_tide.config (and so torch, through torchtitan_tide.comm) is imported by the
# functions that need it, never at module level: --help must work before the install.

REPO_CONFIG_DIR = Path(__file__).resolve().parents[2] / "train_configs"
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
              "0": False, "false": False, "no": False, "off": False}


def resolve_config(name: str, config_dir: Path = REPO_CONFIG_DIR) -> Path:
    """``name`` in ``config_dir`` (``.toml`` optional), else ``name`` as a path."""
    candidates = [config_dir / name, config_dir / f"{name}.toml", Path(name)]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    available = sorted(p.name for p in config_dir.glob("*.toml"))
    raise LaunchError(
        f"--config {name!r}: no such file in {config_dir} or as a path; "
        f"available configs: {available}"
    )


class LaunchArgs(NamedTuple):
    """The launcher's own arguments and the overrides it passes on."""

    config: str
    dry_run: bool
    preflight: bool
    """Run the preflight checks (``python -m torchtitan_tide.preflight``) instead of training."""
    overrides: list[str]


def split_args(argv: list[str]) -> LaunchArgs:
    """The launcher's arguments (``--config``, ``--dry-run``, ``--preflight``) and the
    overrides passed to TorchTitan."""
    config, dry_run, preflight, overrides = None, False, False, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                config = arg.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
                config = argv[i]
            else:
                raise LaunchError("--config needs a value: --config NAME.toml")
        elif arg == "--dry-run":
            dry_run = True
        elif arg == "--preflight":
            preflight = True
        elif arg.split("=", 1)[0] in ("--job.config_file", "--job.config-file"):
            raise LaunchError("use --config NAME instead of --job.config_file with run_train.sh")
        else:
            overrides.append(arg)
        i += 1
    if not config:
        raise LaunchError(
            "missing --config; e.g. ./run_train.sh --config debug_model.toml "
            f"(configs live in {REPO_CONFIG_DIR}; ./run_train.sh --help for usage)"
        )
    return LaunchArgs(config, dry_run, preflight, overrides)


def override_values(overrides: list[str]) -> dict[str, str]:
    """``--section.key value`` / ``--section.key=value`` pairs as {"section.key": value}.
    A flag followed by another flag (or nothing) maps to "true"."""
    values: dict[str, str] = {}
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if arg.startswith("--") and "." in arg:
            key, eq, value = arg[2:].partition("=")
            key = key.replace("-", "_")
            if not eq:
                nxt = overrides[i + 1] if i + 1 < len(overrides) else None
                if nxt is not None and not nxt.startswith("--"):
                    value, i = nxt, i + 1
                else:
                    value = "true"
            values[key] = value
        i += 1
    return values


def parse_bool(key: str, value: str) -> bool:
    """A command-line boolean (``true/false``, ``1/0``, ``yes/no``, ``on/off``)."""
    try:
        return BOOL_WORDS[value.strip().lower()]
    except KeyError:
        flag = "--" + key.replace("_", "-")
        raise LaunchError(
            f"--{key} {value!r} is not a boolean; write {flag} true|false (or {flag} / "
            f"{flag.replace('.', '.no-', 1)})"
        ) from None


def tide_bool_keys() -> set[str]:
    """``tide.key`` of every boolean ``[tide]`` option (no TorchTitan import needed; every
    boolean of the job config: :func:`torchtitan_tide.launch.job_config.bool_keys`)."""
    from torchtitan_tide.config import Tide

    return {f"tide.{f.name}" for f in fields(Tide) if f.type in (bool, "bool")}


def normalize_bool_flags(args: list[str], bool_keys: set[str]) -> list[str]:
    """Rewrite boolean options in ``args`` to the flag form TorchTitan's tyro parser takes:
    ``--s.key``, ``--s.key true``, ``--s.key=1`` -> ``--s.key``; ``--s.key false``,
    ``--s.key=no``, ``--s.no-key`` -> ``--s.no_key`` (nested keys alike:
    ``--a.b.no_key``). Other arguments pass unchanged.

    Raises:
        LaunchError: a boolean option followed by a value that is not a boolean.
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        raw_key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = raw_key.replace("-", "_")
        section, _, name = key.rpartition(".")
        negated = name.startswith("no_") and f"{section}.{name[3:]}" in bool_keys
        if key not in bool_keys and not negated:
            out.append(arg)
            i += 1
            continue
        if negated:
            key, name = f"{section}.{name[3:]}", name[3:]
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, eq, i = args[i + 1], "=", i + 1
        state = parse_bool(key, value) if eq else True
        out.append(f"--{section}.{name}" if state != negated else f"--{section}.no_{name}")
        i += 1
    return out


def effective_tide(config_path: Path, config: dict, overrides: dict[str, str]) -> Tide:
    """The ``[tide]`` options of the parsed TOML ``config`` after CLI overrides, validated.

    Raises:
        LaunchError: an integer or boolean override that is none.
        TideConfigError: a ``[tide]`` key or value the section refuses.
    """
    from torchtitan_tide.config import Tide, check_config_table, validate_tide_table

    check_config_table(config, str(config_path))
    table = dict(config.get("tide", {}))
    types = {f.name: f.type for f in fields(Tide)}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if section != "tide":
            continue
        kind = types.get(name)
        if kind is None and name.startswith("no_") and types.get(name[3:]) in (bool, "bool"):
            table[name[3:]] = not parse_bool(f"tide.{name}", value)
            continue
        if kind in (int, "int"):
            try:
                table[name] = int(value)
            except ValueError:
                raise LaunchError(f"--tide.{name} {value!r} must be an integer") from None
        elif kind in (bool, "bool"):
            table[name] = parse_bool(f"tide.{name}", value)
        else:
            table[name] = value
    return validate_tide_table(table)
