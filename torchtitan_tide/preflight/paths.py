"""Check 2, ``paths``: which path each tier gets, exactly as the run's ``[tide]`` would choose.

Nothing here re-implements TIDE's choice: :func:`apply_tide` applies TIDE for real
(``comm.apply(model, "tide", **options)`` with the options of the run's ``[tide]`` section)
to the preflight's small model sharded over the job's FSDP mesh, and :func:`local_paths`
reads what install decided: the lines it logs (``install.context(model).decisions``, one per
group and tier, with the reason) and the transport objects it marked on each FSDP param
group (TIDE-AG's, TIDE-RS's node-local and cross-node ones), by their ``name`` (or class
name): the set of transports may grow without a change here. Under ``comm = "fsdp2"`` or
``"symm_mem"`` the rows show what ``comm = "tide"`` would take with the section's options.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import fields
from typing import Any

from torch import nn

from torchtitan_tide import comm
from torchtitan_tide.comm.fsdp import install
from torchtitan_tide.comm.fsdp.internals import fsdp_param_groups
from torchtitan_tide.config import Tide
from torchtitan_tide.preflight.report import Row, ranks_text


def tide_options(tide: Tide) -> dict[str, Any]:
    """``comm.apply`` keywords of the section's TIDE options, whatever its ``comm``."""
    options = tide.tide_options()
    return {f.name: getattr(options, f.name) for f in fields(options)}


def apply_tide(model: nn.Module, tide: Tide) -> str | None:
    """``comm.apply(model, "tide", ...)`` with the section's options; None, or the error
    install raised (on every rank of the groups alike: it agrees on failures)."""
    try:
        comm.apply(model, "tide", **tide_options(tide))
    except (install.TideInstallError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _name(transport: object | None) -> str | None:
    if transport is None:
        return None
    return str(getattr(transport, "name", None) or type(transport).__name__)


def local_paths(model: nn.Module, error: str | None) -> dict[str, Any]:
    """What install decided on this rank (module docstring), as plain data to gather."""
    ctx = install.context(model)
    groups = []
    for fqn, pg in fsdp_param_groups(model):
        ag = getattr(pg, "_tide_ag_state", None)
        rs = getattr(pg, "_tide_rs_state", None)
        layout = getattr(getattr(ag, "plan", None), "layout", None)
        groups.append({
            "fqn": fqn or "<root>",
            "ag": _name(getattr(ag, "transport", None)),
            "rs": _name(getattr(rs, "transport", None)),
            "cross_node": _name(getattr(rs, "cross_node", None)),
            "layout": getattr(layout, "shape", None),
            "nodes": getattr(layout, "num_nodes", None),
        })  # fmt: skip
    return {
        "error": error,
        "decisions": list(getattr(ctx, "decisions", None) or []),
        "groups": groups,
        "symmetric_slots": len(getattr(ctx, "slots", None) or []),
        "one_sided_comms": len(getattr(ctx, "rma_comms", None) or []),
    }


def _names(items: list[str]) -> str:
    return ", ".join(items) if len(items) <= 3 else f"{items[0]}, ... {items[-1]} ({len(items)})"


def _decision_rows(decisions: list[str]) -> list[Row]:
    """Install's lines of rank 0, one row per distinct text (its groups named)."""
    by_text: dict[str, list[str]] = {}
    for line in decisions:
        head, sep, text = line.partition(": ")
        key = text if sep else line
        by_text.setdefault(key, []).append(head if sep else "")
    return [Row("paths", _names([h for h in heads if h]) or "install", "info", text)
            for text, heads in by_text.items()]  # fmt: skip


def _tier_row(what: str, values: list[tuple[str | None, str | None]], none_text: str) -> Row:
    counts = Counter(values)
    parts = [
        f"{name or none_text} on {n} group(s)" + (f" ({layout})" if layout else "")
        for (name, layout), n in counts.most_common()
    ]
    return Row("paths", what, "info", "; ".join(parts))


def rows(gathered: list[dict[str, Any]], tide: Tide, device_type: str,
         one_sided_missing: str | None) -> list[Row]:  # fmt: skip
    """Rank 0's rows from every rank's :func:`local_paths`; ``one_sided_missing``: why this
    process cannot use NCCL's one-sided API (``nccl_rma.one_sided_missing_reason``)."""
    out = [Row("paths", "[tide] comm", "info", f"comm = {tide.comm!r}" + (
        "" if tide.comm == "tide"
        else "; the rows show what comm = 'tide' would take with this section's options"))]
    first = gathered[0]
    errors = {r: g["error"] for r, g in enumerate(gathered) if g["error"]}
    if errors:
        asked = tide.cross_node_transport == "nccl_one_sided"
        blocking = asked or (tide.comm == "tide" and tide.fallback != "fsdp2")
        status = "FAIL" if blocking else "warn"
        consequence = (
            "the run would stop at comm.apply" if blocking
            else "the run would fall back to fsdp2" if tide.comm == "tide"
            else f"this config runs comm = {tide.comm!r}"
        )
        text = next(iter(errors.values()))
        out.append(Row("paths", "comm.apply(tide)", status, f"{consequence}: {text}",
                       sorted(errors), "the message names the option or rank; [tide] fallback = "
                       "'fsdp2' trains with stock FSDP2 when TIDE cannot be set up"))  # fmt: skip
        return out
    out += _decision_rows(first["decisions"])
    for r, g in enumerate(gathered[1:], start=1):
        other = [d for d in g["decisions"] if d not in first["decisions"]]
        if other:
            out.append(Row("paths", f"rank {r} differs", "info", other[0]))
    groups = first["groups"]
    out.append(_tier_row("TIDE-AG", [(g["ag"], g["layout"]) for g in groups], "FSDP2's path"))
    out.append(_tier_row("TIDE-RS node-local", [(g["rs"], g["layout"]) for g in groups],
                         "FSDP2's reduce-scatter"))  # fmt: skip
    out.append(_tier_row("TIDE-RS cross-node", [
        (g["cross_node"] or ("none: one node" if g["nodes"] == 1 else None), g["layout"])
        for g in groups], "FSDP2's reduce-scatter"))  # fmt: skip
    differ = [r for r, g in enumerate(gathered)
              if [(x["ag"], x["rs"], x["cross_node"]) for x in g["groups"]]
              != [(x["ag"], x["rs"], x["cross_node"]) for x in groups]]  # fmt: skip
    if differ:
        out.append(Row("paths", "same path on every rank", "warn",
                       f"{ranks_text(differ)} took other transports than rank 0 (another FSDP "
                       "group or a rank that could not take rank 0's path)", differ))  # fmt: skip
    slots = first["symmetric_slots"]
    out.append(Row("paths", "symmetric memory", "info",
                   f"{slots} copy-engine slot buffer(s) (torch symmetric memory)" if slots
                   else "not used" + (" (CPU)" if device_type == "cpu" else
                                      " (no group took the copy engine)")))  # fmt: skip
    comms = first["one_sided_comms"]
    if device_type == "cpu":
        sided = "not used (CPU: gloo send/recv; check one_sided runs the protocol on a stand-in)"
    elif comms:
        sided = f"{comms} one-sided NCCL communicator(s) with registered windows"
    else:
        sided = "not used" + (f": {one_sided_missing}" if one_sided_missing else
                              " (see the cross-node decision above)")  # fmt: skip
    out.append(Row("paths", "one-sided (NCCL RMA)", "info", sided))
    return out
