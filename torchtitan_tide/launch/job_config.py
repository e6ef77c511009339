"""The trainer's arguments, parsed in the launcher exactly as the trainer will parse them.

The bottom of the launcher: it imports no other launcher module. ``run_train.sh`` passes
``--job.config_file X.toml [--section.key value ...]`` (:func:`trainer_args`) to
``torchtitan_tide.train``, which hands them to TorchTitan 0.2.2's ``ConfigManager`` (tyro,
with the TOML's ``[job] custom_config_module``, here ``torchtitan_tide.config`` and its
``[tide]`` section). :func:`check_job_args` runs that same parse before any process starts,
so a dry run that succeeds means the trainer's parse succeeds: an unknown key (TOML or
command line) fails naming the key, the nearest valid ones and where every option is listed;
a value TorchTitan's parser refuses fails with its message.

TorchTitan is imported by the functions that parse (:func:`option_types`,
:func:`parse_job_config`), never at module level: the launcher's ``--help`` imports this
module and must work before the install.
"""

import contextlib
import dataclasses
import difflib
import importlib
import io
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Lists every option of the merged job config (TorchTitan's and [tide]), as the fix to print.
OPTIONS_HELP = (
    "python -m torchtitan.config.manager --job.custom_config_module torchtitan_tide.config --help"
)


class JobArgsError(ValueError):
    """The job config would not parse in the trainer; the message names the key and the fix."""


def trainer_args(config_path: Path, overrides: list[str]) -> list[str]:
    """The arguments ``torchtitan_tide.train`` gets (after torchrun's own)."""
    return ["--job.config_file", str(config_path), *overrides]


def custom_config_module(table: dict[str, Any], values: dict[str, str]) -> str | None:
    """``job.custom_config_module`` from the overrides, else the TOML, as TorchTitan reads it."""
    return values.get("job.custom_config_module") or table.get("job", {}).get(
        "custom_config_module"
    )


def option_types(custom_module: str | None) -> dict[str, Any]:
    """Every option of the job config TorchTitan builds (its JobConfig, merged with
    ``custom_module``'s), as {"section.key": type hint}; nested sections give
    "section.sub.key".

    Raises:
        JobArgsError: ``custom_module`` cannot be imported or has no ``JobConfig``.
    """
    from torchtitan.config import JobConfig as TitanJobConfig

    classes = [TitanJobConfig]
    if custom_module:
        try:
            classes.append(importlib.import_module(custom_module).JobConfig)
        except (ImportError, AttributeError) as exc:
            raise JobArgsError(
                f"job.custom_config_module {custom_module!r} has no JobConfig to import "
                f"({exc}); set [job] custom_config_module = \"torchtitan_tide.config\""
            ) from None
    types: dict[str, Any] = {}
    for config_cls in classes:
        types.update(_leaf_types(config_cls, ""))
    return types


def _leaf_types(config_cls: type, prefix: str) -> dict[str, Any]:
    hints = typing.get_type_hints(config_cls)
    types: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        hint = hints.get(f.name, f.type)
        if dataclasses.is_dataclass(hint):
            types.update(_leaf_types(hint, f"{prefix}{f.name}."))
        else:
            types[f"{prefix}{f.name}"] = hint
    return types


def bool_keys(types: dict[str, Any]) -> set[str]:
    """The boolean options of :func:`option_types`."""
    return {key for key, hint in types.items() if hint is bool}


def _unknown(key: str, types: dict[str, Any]) -> bool:
    if key in types:
        return False
    prefix, _, name = key.rpartition(".")
    return not (name.startswith("no_") and types.get(f"{prefix}.{name[3:]}") is bool)


def _did_you_mean(key: str, types: dict[str, Any], spell: Callable[[str], str]) -> str:
    """Up to three valid keys close to ``key`` (else of its section), written by ``spell``."""
    near = difflib.get_close_matches(key, types, n=3, cutoff=0.6)
    if not near:
        section = key.partition(".")[0]
        near = sorted(k for k in types if k.partition(".")[0] == section)[:3]
    return f"did you mean {' or '.join(map(spell, near))}? " if near else ""


def _toml_key(key: str) -> str:
    section, _, name = key.rpartition(".")
    return f"[{section}] {name}"


def _cli_key(key: str) -> str:
    return f"--{key}"


def unknown_toml_keys(table: dict[str, Any], types: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of the TOML ``table`` that are no option of ``types`` (nor a section)."""
    unknown = []
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and any(k.startswith(f"{dotted}.") for k in types):
            unknown += unknown_toml_keys(value, types, f"{dotted}.")
        elif dotted not in types:
            unknown.append(dotted)
    return unknown


def check_known_keys(
    config_path: Path, table: dict[str, Any], overrides: list[str], types: dict[str, Any]
) -> None:
    """Every ``--section.key`` of ``overrides`` and every key of the TOML ``table`` is an option
    of ``types`` (:func:`option_types`).

    Raises:
        JobArgsError: naming the first unknown key, close valid ones and :data:`OPTIONS_HELP`.
    """
    for key in unknown_toml_keys(table, types):
        raise JobArgsError(
            f"{_toml_key(key)} in {config_path} is not a TorchTitan 0.2.2 or [tide] option; "
            f"{_did_you_mean(key, types, _toml_key)}fix or remove it "
            f"(every option: {OPTIONS_HELP})"
        )
    for arg in overrides:
        if not arg.startswith("--"):
            continue
        key = arg[2:].partition("=")[0].replace("-", "_")
        if _unknown(key, types):
            raise JobArgsError(
                f"--{key} is not a TorchTitan 0.2.2 or [tide] option; "
                f"{_did_you_mean(key, types, _cli_key)}fix or remove it "
                f"(every option: {OPTIONS_HELP})"
            )


def parse_job_config(args: list[str]) -> Any:
    """TorchTitan's ``ConfigManager().parse_args(args)``, as the trainer runs it; returns the
    job config.

    Raises:
        JobArgsError: the parser refused ``args`` (its message, without the help footer).
    """
    from torchtitan.config import ConfigManager

    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            return ConfigManager().parse_args(args)
    except SystemExit:  # tyro prints the error and exits 2
        lines = [
            line.strip() for line in captured.getvalue().splitlines()
            if line.strip() and not set(line.strip()) <= set("-─│╭╮╰╯ ")
            and "For full helptext" not in line
        ]  # fmt: skip
        if len(lines) > 1 and lines[1].lower().startswith(lines[0].lower()):
            lines.pop(0)  # tyro's title ("Invalid choice") repeats its message's start
        raise JobArgsError(
            "TorchTitan's parser refuses the job config: "
            + " ".join(lines)
            + f" (every option: {OPTIONS_HELP})"
        ) from None


def check_job_args(
    config_path: Path, table: dict[str, Any], overrides: list[str], types: dict[str, Any]
) -> Any:
    """:func:`check_known_keys`, then :func:`parse_job_config` of the trainer's arguments;
    returns the job config the trainer will get."""
    check_known_keys(config_path, table, overrides, types)
    return parse_job_config(trainer_args(config_path, overrides))
