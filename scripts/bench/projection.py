"""Scale projection: exact buffer bytes per comm mode and projected step times at 8-64 GPUs.

    python scripts/bench/projection.py [--out-dir bench/results] [--gpus 8,16,32,64]
        [--configs llama70b_fsdp2,...] [--local-world-size 8] [--nics-per-node 8]
        [--nic-gbps 400] [--nvlink-gibps 368] [--calibration FILE.json ...]

Memory (exact): per rank and mode, the memory planner's AG/RS buffer bytes
(``torchtitan_tide.comm.memory_plan``), gradients, sharded params + AdamW states and
``peak_modeled_bytes``, their sum (unsharded parameters and activations are the same in
every mode and left out).

Step time (a PROJECTION, not a measurement), per step and rank, over FSDP groups g:

- fsdp2, stock NCCL ring (symm_mem: the same comm time): an AG or RS of group g moves
  (W-1) * S_g * b bytes per rank at bus bandwidth B: NCCL's measured bus bandwidth on
  one node; across nodes min(B, L * net), since a ring crosses the network once per node
  and channel, spread over the node's NICs; net = nics_per_node * nic_gbps / 8 / L per
  GPU. AG in b_ag, RS in b_red (FSDP2 reduces in fp32 on the wire).
- tide, hierarchical: AG = cross-node (N-1) * S_g * b_ag / net (one shard from each
  same-local-index peer) THEN node-local (L-1) * N * S_g * b_ag / nvlink (copy engine;
  back to back on one stream, as TIDE-AG runs today). RS = max(node-local
  (L-1) * N * S_g * b_grad / nvlink, cross-node (N-1) * S_g * 4 / net): bf16 reads, fp32
  partials, the two phases pipelined across groups. tide_ag: TIDE-AG with the stock RS.
- per step: 2 all-gathers per group resharded after forward (forward, backward), else 1;
  one reduce-scatter per group.
- overlap: the first group's AG + RS are exposed (nothing to hide behind at the start and
  end of a step); the rest hides behind overlap * fwd_bwd, the excess is exposed. Hidden
  communication slows compute by an interference fraction per mode (docs/2026-11-29-h200-facts.md:
  GEMM 8192^3 +15% under an NCCL reduce-scatter, +9% under a copy-engine copy).
- step = fwd_bwd + optimizer + layout + exposed + interference * hidden. Optimizer ms
  scale with the shard numel; layout conversion (stock copy-in/copy-out; 0 for tide;
  only the RS copy-in, 11.0 of 18.4 ms in docs/2026-11-29-h200-facts.md, for tide_ag) with the unsharded
  numel.
- fwd_bwd of a reference config is given, or solved so that the model reproduces its
  measured fsdp2 step (measured step minus exposed communication, layout, optimizer and
  interference). Configs of the same [model] name scale it by active matmul params x
  tokens per GPU x activation checkpointing (full AC: 4/3).

Calibration (``--calibration``, repeatable, later files win; the JSON output records the
source of every value): a ``bench_step.py`` result JSON (its best step ms per mode become
the measured steps of its config at its world size) or a JSON object with any of:

    {"source": "text",
     "bandwidth_gibps": {"nvlink": 368, "nccl_all_gather_bus": 240,
                         "nccl_reduce_scatter_bus": 256},
     "interference": {"fsdp2": 0.15, "symm_mem": 0.15, "tide": 0.09},
     "optimizer_ms_per_gparam": 7.95, "layout_ms_per_gparam": 5.38, "overlap": 1.0,
     "references": {"h200x2_llama70b_4layers": {"gpus": 2,
                    "step_ms": {"fsdp2": 505.6, "tide": 493.7}, "fwd_bwd_ms": null}}}

Without one: docs/2026-11-29-h200-facts.md (bandwidths, interference, optimizer and layout costs)
and the measured 2x H200 steps in bench/results. Writes
``<date>_<machine>_<commit>_projection.{json,md,png}`` under ``--out-dir``; the
metadata's ``world_size`` is the largest projected GPU count (nothing ran on GPUs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import common

from torchtitan_tide.comm.memory_plan import (
    MODES,
    CommDtypes,
    GroupShape,
    group_shard_numel,
    plan_memory,
)

GIB = 2**30
DEFAULT_GPUS = (8, 16, 32, 64)
DEFAULT_CONFIGS = (
    "llama70b_fsdp2",
    "qwen3_30b_a3b_fsdp2",
    "wan22_a14b_fsdp2",
    "h200x2_llama70b_4layers",
    "h200x2_qwen3_30b_a3b_4layers",
    "h200x2_wan22_a14b_20layers",
)
LAYOUT_RS_SHARE = 11.0 / 18.4  # docs/2026-11-29-h200-facts.md: chunk_cat (RS copy-in) of the layout ms
AC_COMPUTE_FACTOR = {"none": 1.0, "full": 4.0 / 3.0}  # full AC recomputes the forward
LLAMA_4LAYER_PARAMS = 4 * 855_654_400  # the docs/2026-11-29-h200-facts.md step: 4 Llama-70B layers
DESIGN = "default: docs/2026-11-29-h200-facts.md"
BENCH = "bench/results/2026-11-30_nvidia-h200-x-2_{}_step_{}.json, best step ms"
STEP_MODEL = __doc__.split("Step time (a PROJECTION", 1)[1].split("Calibration (", 1)[0]


class ProjectionError(ValueError):
    """Bad projection input; the message names the flag or calibration key."""


# ----------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Reference:
    """A measured config: ``step_ms`` per mode at ``gpus``, or its ``fwd_bwd_ms``."""

    config: str
    gpus: int
    step_ms: dict[str, float] = field(default_factory=dict)
    fwd_bwd_ms: float | None = None
    source: str = ""


@dataclass(frozen=True)
class Calibration:
    """Inputs of the step-time model; ``sources`` says where each came from."""

    nvlink_gibps: float = 368.0
    nccl_all_gather_bus_gibps: float = 240.0
    nccl_reduce_scatter_bus_gibps: float = 256.0
    interference: dict[str, float] = field(
        default_factory=lambda: {"fsdp2": 0.15, "symm_mem": 0.15, "tide": 0.09, "tide_ag": 0.15}
    )
    optimizer_ms_per_gparam: float = 13.6 / (LLAMA_4LAYER_PARAMS / 2 / 1e9)
    layout_ms_per_gparam: float = 18.4 / (LLAMA_4LAYER_PARAMS / 1e9)
    overlap: float = 1.0
    references: tuple[Reference, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)

    def record(self, files: Sequence[str]) -> dict[str, Any]:
        """JSON-ready, with the calibration files read (None: defaults only)."""
        return {"from_files": list(files) or None, **asdict(self)}


def default_calibration() -> Calibration:
    """docs/2026-11-29-h200-facts.md figures and the measured 2x H200 steps of bench/results."""
    refs = (
        Reference(
            "h200x2_llama70b_4layers",
            2,
            {"fsdp2": 505.56, "tide_ag": 493.69},
            source=BENCH.format("7334fb3", "h200x2_llama70b_4layers"),
        ),
        Reference(
            "h200x2_qwen3_30b_a3b_4layers",
            2,
            {"fsdp2": 196.10, "tide_ag": 184.75},
            source=BENCH.format("c64beae", "h200x2_qwen3_30b_a3b_4layers"),
        ),
        Reference(
            "h200x2_wan22_a14b_20layers",
            2,
            {"fsdp2": 7920.39, "tide_ag": 7877.89},
            source=BENCH.format("c64beae", "h200x2_wan22_a14b_20layers"),
        ),
    )
    sources = {
        "nvlink_gibps": f"{DESIGN}, copy-engine peer copy of 1 GiB",
        "nccl_all_gather_bus_gibps": f"{DESIGN}, NCCL all-gather bf16, 256 MiB shard",
        "nccl_reduce_scatter_bus_gibps": f"{DESIGN}, NCCL reduce-scatter fp32, 512 MiB",
        "interference": f"{DESIGN}, GEMM 8192^3 under NCCL RS +15%, under CE copy +9% "
        "(tide_ag: NCCL RS still runs, +15%)",
        "optimizer_ms_per_gparam": f"{DESIGN}, fused AdamW 13.6 ms on a 1.71B shard",
        "layout_ms_per_gparam": f"{DESIGN}, layout conversion 18.4 ms for 4 70B layers",
        "overlap": "default: communication may hide behind all of fwd+bwd",
        "references": "default: measured 2x H200 steps in bench/results ('tide' there ran "
        "TIDE-AG with FSDP2's reduce-scatter: recorded as tide_ag)",
    }
    return Calibration(references=refs, sources=sources)


_FILE_KEYS = {
    "source",
    "bandwidth_gibps",
    "interference",
    "optimizer_ms_per_gparam",
    "layout_ms_per_gparam",
    "overlap",
    "references",
}
_BANDWIDTH_FIELDS = {
    "nvlink": "nvlink_gibps",
    "nccl_all_gather_bus": "nccl_all_gather_bus_gibps",
    "nccl_reduce_scatter_bus": "nccl_reduce_scatter_bus_gibps",
}
_REFERENCE_KEYS = {"gpus", "step_ms", "fwd_bwd_ms", "source"}


def apply_calibration_file(cal: Calibration, path: str | os.PathLike) -> Calibration:
    """``cal`` updated by one calibration JSON (schema in the module docstring)."""
    where = f"--calibration {path}"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProjectionError(f"{where}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ProjectionError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ProjectionError(f"{where}: expected a JSON object")
    if {"metadata", "args", "rows"} <= set(data):  # a bench_step.py result
        ref = Reference(
            config=str(data["args"]["config"]),
            gpus=int(data["metadata"]["world_size"]),
            step_ms={
                r["mode"]: float(r["best_step_ms"]) for r in data["rows"] if r.get("best_step_ms")
            },
            source=f"file: {path} (bench_step result)",
        )
        sources = {**cal.sources, "references": f"file: {path}, then earlier sources"}
        return replace(cal, references=_merge(cal.references, ref), sources=sources)
    if unknown := sorted(set(data) - _FILE_KEYS):
        raise ProjectionError(f"{where}: unknown key(s) {unknown}; known: {sorted(_FILE_KEYS)}")
    label = f"file: {path}" + (f" ({data['source']})" if data.get("source") else "")
    updates: dict[str, Any] = {}
    for key, value in data.get("bandwidth_gibps", {}).items():
        if key not in _BANDWIDTH_FIELDS:
            raise ProjectionError(
                f"{where}: bandwidth_gibps.{key} is unknown; known: {sorted(_BANDWIDTH_FIELDS)}"
            )
        updates[_BANDWIDTH_FIELDS[key]] = _number(
            value, f"{where}: bandwidth_gibps.{key}", positive=True
        )
    if "interference" in data:
        if bad := sorted(set(data["interference"]) - set(MODES)):
            raise ProjectionError(f"{where}: interference.{bad} unknown; modes are {MODES}")
        given = {
            m: _number(v, f"{where}: interference.{m}") for m, v in data["interference"].items()
        }
        updates["interference"] = {**cal.interference, **given}
    for key in ("optimizer_ms_per_gparam", "layout_ms_per_gparam"):
        if key in data:
            updates[key] = _number(data[key], f"{where}: {key}")
    if "overlap" in data:
        updates["overlap"] = _number(data["overlap"], f"{where}: overlap", upper=1.0)
    references = cal.references
    for name, entry in data.get("references", {}).items():
        if bad := sorted(set(entry) - _REFERENCE_KEYS):
            raise ProjectionError(
                f"{where}: references.{name} has unknown key(s) {bad}; "
                f"known: {sorted(_REFERENCE_KEYS)}"
            )
        if "gpus" not in entry or not (entry.get("step_ms") or entry.get("fwd_bwd_ms")):
            raise ProjectionError(
                f"{where}: references.{name} needs gpus, and step_ms (per mode) or fwd_bwd_ms"
            )
        ref = Reference(
            config=name,
            gpus=int(entry["gpus"]),
            step_ms={m: float(v) for m, v in (entry.get("step_ms") or {}).items()},
            fwd_bwd_ms=entry.get("fwd_bwd_ms"),
            source=str(entry.get("source") or label),
        )
        references = _merge(references, ref)
    sources = {**cal.sources, **dict.fromkeys(updates, label)}
    if "references" in data:
        sources["references"] = f"{label}, then earlier sources"
    return replace(cal, references=references, sources=sources, **updates)


def _merge(refs: tuple[Reference, ...], ref: Reference) -> tuple[Reference, ...]:
    """``ref`` first (it wins), without an older entry of the same config."""
    return (ref, *(r for r in refs if r.config != ref.config))


def _number(value: Any, what: str, positive: bool = False, upper: float | None = None) -> float:
    """``value`` as a float; a :class:`ProjectionError` naming ``what`` unless it is a
    number >= 0 (> 0 if ``positive``) and <= ``upper``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or value < 0 or (positive and value == 0) or (upper is not None and value > upper):
        bound = ("> 0" if positive else ">= 0") + (f" and <= {upper}" if upper is not None else "")
        raise ProjectionError(f"{what} = {value!r} must be a number {bound}")
    return float(value)


# ----------------------------------------------------------------- comm and step model


@dataclass(frozen=True)
class Cluster:
    """GPUs per node and the network of a node (``nics_per_node`` NICs of ``nic_gbps``)."""

    local_world_size: int = 8
    nics_per_node: int = 8
    nic_gbps: float = 400.0

    def local_for(self, gpus: int) -> int:
        """Ranks per node at ``gpus``: all of them on one node, else ``local_world_size``."""
        if gpus <= self.local_world_size:
            return gpus
        if gpus % self.local_world_size:
            raise ProjectionError(
                f"--gpus {gpus} is not a multiple of --local-world-size {self.local_world_size}"
            )
        return self.local_world_size

    @property
    def net_gibps_per_gpu(self) -> float:
        """``nics_per_node * nic_gbps`` Gbit/s shared by a node's GPUs, GiB/s per GPU."""
        return self.nics_per_node * self.nic_gbps * 1e9 / 8 / self.local_world_size / GIB


@dataclass(frozen=True)
class Links:
    """Bandwidths in GiB/s: NVLink copy engine, NCCL bus on one node, network per GPU."""

    nvlink: float
    nccl_ag_bus: float
    nccl_rs_bus: float
    net_per_gpu: float

    @classmethod
    def of(cls, cal: Calibration, cluster: Cluster) -> Links:
        return cls(
            cal.nvlink_gibps,
            cal.nccl_all_gather_bus_gibps,
            cal.nccl_reduce_scatter_bus_gibps,
            cluster.net_gibps_per_gpu,
        )


def _ms(nbytes: float, gibps: float) -> float:
    return 1e3 * nbytes / (gibps * GIB)


def stock_collective_ms(
    shard_numel: int, world: int, local: int, elem_bytes: int, bus_gibps: float, net: float
) -> float:
    """NCCL ring AG or RS of one group: ``(W-1) * S_g * b`` bytes per rank at the bus
    bandwidth, capped across nodes by the node's NICs (``L * net``)."""
    bus = bus_gibps if world == local else min(bus_gibps, local * net)
    return _ms((world - 1) * shard_numel * elem_bytes, bus)


def tide_ag_ms(shard_numel: int, world: int, local: int, elem_bytes: int, links: Links) -> float:
    """TIDE-AG of one group: cross-node then node-local phase, back to back."""
    nodes = world // local
    cross = _ms((nodes - 1) * shard_numel * elem_bytes, links.net_per_gpu)
    return cross + _ms((local - 1) * nodes * shard_numel * elem_bytes, links.nvlink)


def tide_rs_ms(shard_numel: int, world: int, local: int, grad_bytes: int, links: Links) -> float:
    """TIDE-RS of one group: node-local bf16 reads and cross-node fp32 partials,
    pipelined across groups (the slower phase sets the pace)."""
    nodes = world // local
    node_local = _ms((local - 1) * nodes * shard_numel * grad_bytes, links.nvlink)
    return max(node_local, _ms((nodes - 1) * shard_numel * 4, links.net_per_gpu))


@dataclass(frozen=True)
class CommTimes:
    """Communication of one step in one mode; ``edge_ms``: the first group's AG + RS."""

    ag_ms: float
    rs_ms: float
    edge_ms: float

    @property
    def total_ms(self) -> float:
        return self.ag_ms + self.rs_ms


def comm_times(
    groups: Sequence[GroupShape],
    world: int,
    local: int,
    mode: str,
    dtypes: CommDtypes,
    links: Links,
) -> CommTimes:
    """Every group's all-gathers (2 if resharded after forward, else 1) and reduce-scatter."""
    ag = rs = edge = 0.0
    for i, group in enumerate(groups):
        s = group_shard_numel(group, world)
        net = links.net_per_gpu
        if mode in ("tide", "tide_ag"):
            t_ag = tide_ag_ms(s, world, local, dtypes.param_bytes, links)
        else:
            t_ag = stock_collective_ms(s, world, local, dtypes.param_bytes, links.nccl_ag_bus, net)
        if mode == "tide":
            t_rs = tide_rs_ms(s, world, local, dtypes.grad, links)
        else:
            t_rs = stock_collective_ms(s, world, local, dtypes.reduce_bytes, links.nccl_rs_bus, net)
        ag += (2 if group.reshard_after_forward else 1) * t_ag
        rs += t_rs
        edge = edge if i else t_ag + t_rs
    return CommTimes(ag, rs, edge)


@dataclass(frozen=True)
class StepTerms:
    """Everything the step model adds up, in ms."""

    fwd_bwd_ms: float
    optimizer_ms: float
    layout_ms: float
    exposed_ms: float
    interference_ms: float

    @property
    def step_ms(self) -> float:
        return (
            self.fwd_bwd_ms
            + self.optimizer_ms
            + self.layout_ms
            + self.exposed_ms
            + self.interference_ms
        )


def step_terms(
    fwd_bwd_ms: float,
    comm: CommTimes,
    optimizer_ms: float,
    layout_ms: float,
    overlap: float,
    interference: float,
) -> StepTerms:
    """The first group's comm is exposed; the rest hides behind ``overlap * fwd_bwd_ms``
    (the excess is exposed) and slows compute by ``interference`` of what it hides."""
    hideable = comm.total_ms - comm.edge_ms
    excess = max(0.0, hideable - overlap * fwd_bwd_ms)
    return StepTerms(
        fwd_bwd_ms,
        optimizer_ms,
        layout_ms,
        comm.edge_ms + excess,
        interference * (hideable - excess),
    )


def solve_fwd_bwd_ms(
    measured_step_ms: float,
    comm: CommTimes,
    optimizer_ms: float,
    layout_ms: float,
    overlap: float,
    interference: float,
) -> float:
    """The ``fwd_bwd_ms`` for which :func:`step_terms` gives ``measured_step_ms``
    (closed form in each case: communication all hidden, or partly exposed)."""
    rest = measured_step_ms - optimizer_ms - layout_ms - comm.edge_ms
    hideable = comm.total_ms - comm.edge_ms
    all_hidden = rest - interference * hideable
    if all_hidden >= 0 and overlap * all_hidden >= hideable:
        return all_hidden
    slope = 1 - overlap + interference * overlap
    if slope > 0:
        partly_exposed = (rest - hideable) / slope
        if partly_exposed >= 0 and overlap * partly_exposed < hideable:
            return partly_exposed
    raise ProjectionError(
        f"measured step {measured_step_ms:.1f} ms is below the model's floor (optimizer "
        f"{optimizer_ms:.1f} + layout {layout_ms:.1f} + communication {comm.total_ms:.1f} ms); "
        "check the calibration's step_ms and bandwidths"
    )


# ----------------------------------------------------------------- configs


@dataclass(frozen=True)
class ConfigFacts:
    """What the projection needs of one training TOML."""

    name: str
    model_name: str
    groups: tuple[GroupShape, ...]
    dtypes: CommDtypes
    active_numel: int
    tokens_per_gpu: int
    ac_mode: str

    @property
    def compute_weight(self) -> float:
        """Relative fwd+bwd work: active params x tokens x activation checkpointing."""
        return self.active_numel * self.tokens_per_gpu * AC_COMPUTE_FACTOR[self.ac_mode]

    def fixed_costs_ms(self, gpus: int, mode: str, cal: Calibration) -> tuple[float, float]:
        """(optimizer, layout conversion) ms at ``gpus``: optimizer with the shard numel,
        layout with the unsharded numel (tide: no copy-in / copy-out; tide_ag: the RS
        copy-in only)."""
        shard = sum(group_shard_numel(g, gpus) for g in self.groups)
        share = {"tide": 0.0, "tide_ag": LAYOUT_RS_SHARE}.get(mode, 1.0)
        layout = share * cal.layout_ms_per_gparam * gpus * shard / 1e9
        return cal.optimizer_ms_per_gparam * shard / 1e9, layout


def load_config_facts(config: str) -> ConfigFacts:
    """Build ``config``'s model on the meta device (memory planner) and read its TOML."""
    from torchtitan_tide.plan import load_config_model

    cm = load_config_model(config)
    ac_mode = cm.table.get("activation_checkpoint", {}).get("mode", "selective")
    if ac_mode not in AC_COMPUTE_FACTOR:
        raise ProjectionError(
            f"{cm.path.name}: [activation_checkpoint] mode = {ac_mode!r} is not modeled; "
            f"the projection knows {sorted(AC_COMPUTE_FACTOR)}"
        )
    return ConfigFacts(
        name=cm.path.stem,
        model_name=cm.spec_name,
        groups=cm.groups,
        dtypes=cm.dtypes,
        active_numel=cm.active_numel,
        tokens_per_gpu=tokens_per_gpu(cm.table, cm.model_args),
        ac_mode=ac_mode,
    )


def tokens_per_gpu(table: dict[str, Any], model_args: Any) -> int:
    """``local_batch_size`` x tokens per sample: ``seq_len``, or for Wan2.2 the patchified
    latent (``[wan22] latent_frames x latent_height x latent_width / patch_size``)."""
    training = table.get("training", {})
    batch = int(training.get("local_batch_size", 8))
    if hasattr(model_args, "patch_size"):
        from models.wan22.job_config import Wan22DataConfig

        data = {**vars(Wan22DataConfig()), **table.get("wan22", {})}
        latent = (data["latent_frames"], data["latent_height"], data["latent_width"])
        return batch * math.prod(n // p for n, p in zip(latent, model_args.patch_size))
    return batch * int(training.get("seq_len", 2048))


def model_name_in_toml(config: str) -> str | None:
    """``[model] name`` of a config, None when it cannot be read."""
    from torchtitan_tide.config import load_toml
    from torchtitan_tide.launch import resolve_config

    try:
        return load_toml(str(resolve_config(config))).get("model", {}).get("name")
    except (FileNotFoundError, ValueError):
        return None


def pick_reference(
    facts: ConfigFacts, cal: Calibration, model_name_of: Callable[[str], str | None]
) -> Reference:
    """The calibration reference of ``facts``: the same config, else the first one with
    the same ``[model] name``."""
    for ref in cal.references:
        if ref.config == facts.name:
            return ref
    for ref in cal.references:
        if model_name_of(ref.config) == facts.model_name:
            return ref
    raise ProjectionError(
        f"no calibration reference for {facts.name} ([model] name = {facts.model_name!r}); "
        "add one under references in a --calibration file"
    )


@dataclass(frozen=True)
class Anchor:
    """A reference config with its fwd+bwd ms (solved or given) and how it was found."""

    facts: ConfigFacts
    reference: Reference
    fwd_bwd_ms: float
    how: str


def anchor_reference(
    ref: Reference, facts: ConfigFacts, cal: Calibration, cluster: Cluster
) -> Anchor:
    """Take the reference's fwd+bwd ms, or solve it from its measured fsdp2 step."""
    if ref.fwd_bwd_ms is not None:
        return Anchor(facts, ref, float(ref.fwd_bwd_ms), f"given ({ref.source})")
    if "fsdp2" not in ref.step_ms:
        raise ProjectionError(
            f"calibration reference {ref.config!r} has neither an fsdp2 step_ms nor fwd_bwd_ms"
        )
    local = cluster.local_for(ref.gpus)
    comm = comm_times(facts.groups, ref.gpus, local, "fsdp2", facts.dtypes, Links.of(cal, cluster))
    optimizer, layout = facts.fixed_costs_ms(ref.gpus, "fsdp2", cal)
    measured = ref.step_ms["fsdp2"]
    fwd_bwd = solve_fwd_bwd_ms(
        measured, comm, optimizer, layout, cal.overlap, cal.interference["fsdp2"]
    )
    how = f"solved from the measured fsdp2 step {measured:.1f} ms at {ref.gpus} GPUs ({ref.source})"
    return Anchor(facts, ref, fwd_bwd, how)


def project_rows(
    facts: ConfigFacts,
    anchor: Anchor,
    gpus_list: Sequence[int],
    cal: Calibration,
    cluster: Cluster,
) -> tuple[list[dict], list[dict]]:
    """Memory rows (exact planner bytes) and step-time projection rows of one config."""
    fwd_bwd = anchor.fwd_bwd_ms * facts.compute_weight / anchor.facts.compute_weight
    links = Links.of(cal, cluster)
    memory, projection = [], []
    for gpus in gpus_list:
        local = cluster.local_for(gpus)
        plans = plan_memory(facts.groups, gpus, local, facts.dtypes)
        fsdp2_step = None
        for mode in MODES:
            plan = plans[mode]
            memory.append(
                {
                    "config": facts.name,
                    "gpus": gpus,
                    "nodes": gpus // local,
                    "mode": mode,
                    "ag_bytes": plan.ag_bytes,
                    "rs_bytes": plan.rs_bytes,
                    "comm_buffer_bytes": plan.comm_buffer_bytes,
                    "gradient_bytes": plan.gradient_bytes,
                    "params_optimizer_bytes": plan.params_optimizer_bytes,
                    "peak_modeled_bytes": plan.total_bytes,
                    "ag_gib": plan.ag_bytes / GIB,
                    "rs_gib": plan.rs_bytes / GIB,
                    "comm_buffer_gib": plan.comm_buffer_bytes / GIB,
                    "peak_modeled_gib": plan.total_bytes / GIB,
                }
            )
            comm = comm_times(facts.groups, gpus, local, mode, facts.dtypes, links)
            optimizer, layout = facts.fixed_costs_ms(gpus, mode, cal)
            terms = step_terms(
                fwd_bwd, comm, optimizer, layout, cal.overlap, cal.interference[mode]
            )
            fsdp2_step = fsdp2_step or terms.step_ms  # MODES starts with fsdp2
            projection.append(
                {
                    "config": facts.name,
                    "gpus": gpus,
                    "mode": mode,
                    "projection_fwd_bwd_ms": terms.fwd_bwd_ms,
                    "projection_optimizer_ms": terms.optimizer_ms,
                    "projection_layout_ms": terms.layout_ms,
                    "projection_ag_ms": comm.ag_ms,
                    "projection_rs_ms": comm.rs_ms,
                    "projection_comm_ms": comm.total_ms,
                    "projection_exposed_comm_ms": terms.exposed_ms,
                    "projection_interference_ms": terms.interference_ms,
                    "projection_step_ms": terms.step_ms,
                    "projection_speedup_vs_fsdp2": fsdp2_step / terms.step_ms,
                }
            )
    return memory, projection


def run_projection(
    configs: Sequence[str],
    gpus_list: Sequence[int],
    cal: Calibration,
    cluster: Cluster,
    load: Callable[[str], ConfigFacts] = load_config_facts,
    model_name_of: Callable[[str], str | None] = model_name_in_toml,
) -> dict[str, Any]:
    """Memory and projection rows of every config (``load`` builds a config's facts)."""
    cache: dict[str, ConfigFacts] = {}

    def facts_of(name: str) -> ConfigFacts:
        if name not in cache:
            cache[name] = load(name)
        return cache[name]

    memory, projection, anchors = [], [], {}
    for config in configs:
        facts = facts_of(config)
        ref = pick_reference(facts, cal, model_name_of)
        if ref.config not in anchors:
            anchors[ref.config] = anchor_reference(ref, facts_of(ref.config), cal, cluster)
        mem, proj = project_rows(facts, anchors[ref.config], gpus_list, cal, cluster)
        memory += mem
        projection += proj
    return {
        "kind": "projection",
        "configs": [_config_record(f) for f in cache.values()],
        "anchors": {name: _anchor_record(a, cal, cluster) for name, a in anchors.items()},
        "memory": memory,
        "projection": projection,
    }


def _config_record(facts: ConfigFacts) -> dict[str, Any]:
    return {
        "name": facts.name,
        "model_name": facts.model_name,
        "params": sum(g.numel for g in facts.groups),
        "active_params": facts.active_numel,
        "tokens_per_gpu": facts.tokens_per_gpu,
        "activation_checkpoint": facts.ac_mode,
        "fsdp_groups": len(facts.groups),
    }


def _anchor_record(anchor: Anchor, cal: Calibration, cluster: Cluster) -> dict[str, Any]:
    """The reference, its fwd+bwd, and the model's step per mode at the reference's own GPU
    count next to the measured ones (fsdp2 matches by construction)."""
    ref = anchor.reference
    _, rows = project_rows(anchor.facts, anchor, [ref.gpus], cal, cluster)
    return {
        "reference": ref.config,
        "gpus": ref.gpus,
        "measured_step_ms": ref.step_ms,
        "projection_fwd_bwd_ms": anchor.fwd_bwd_ms,
        "projection_step_ms_at_reference": {r["mode"]: r["projection_step_ms"] for r in rows},
        "how": anchor.how,
        "note": "fsdp2 matches by construction; compare tide_ag with a measured TIDE-AG-only "
        "step to check the model",
    }


# ----------------------------------------------------------------- outputs

MEMORY_COLUMNS = [
    ("config", "config"),
    ("gpus", "GPUs"),
    ("mode", "mode"),
    ("ag_gib", "AG GiB"),
    ("rs_gib", "RS GiB"),
    ("comm_buffer_gib", "buffers GiB"),
    ("peak_modeled_gib", "modeled peak GiB"),
]
PROJECTION_COLUMNS = [
    ("config", "config"),
    ("gpus", "GPUs"),
    ("mode", "mode"),
    ("projection_comm_ms", "projection comm ms"),
    ("projection_exposed_comm_ms", "projection exposed ms"),
    ("projection_layout_ms", "projection layout ms"),
    ("projection_step_ms", "projection step ms"),
    ("projection_speedup_vs_fsdp2", "projection speed-up"),
]
PROJECTION_TITLE = "Step-time projection (model, not measured)"
MEMORY_TITLE = "Memory per rank (exact, memory planner; modeled peak without activations)"


def with_tables(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` plus ``tables`` in the shape scripts/bench/common.py documents."""
    tables = [
        {"title": PROJECTION_TITLE, "columns": PROJECTION_COLUMNS, "rows": result["projection"]},
        {"title": MEMORY_TITLE, "columns": MEMORY_COLUMNS, "rows": result["memory"]},
    ]
    return {**result, "tables": [{**t, "columns": [list(c) for c in t["columns"]]} for t in tables]}


def write_outputs(result: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
    """JSON, Markdown and PNG of ``result``; returns their paths (PNG only if drawn)."""
    stem = common.result_stem(out_dir, "projection", result["metadata"])
    paths = {"json": str(common.write_json(stem.with_suffix(".json"), with_tables(result)))}
    calibrated_on = result["calibration"]["sources"].get("references", "defaults")
    extra = "\n".join(
        [
            f"Step times are a projection of the model below, calibrated on {calibrated_on}.",
            "",
            f"## {MEMORY_TITLE}",
            "",
            common.format_markdown_table(result["memory"], MEMORY_COLUMNS),
            "## Step-time projection model",
            "",
            "```",
            STEP_MODEL.strip("\n"),
            "```",
        ]
    )
    md = stem.with_suffix(".md")
    title = f"Scale projection. {PROJECTION_TITLE}"
    common.write_markdown_table(md, result["projection"], PROJECTION_COLUMNS, title, extra)
    paths["markdown"] = str(md)
    png = stem.with_suffix(".png")
    title = "TIDE scale projection (model, not measured); RS buffer bytes exact"
    if common.write_bar_png(png, charts(result), title=title):
        paths["png"] = str(png)
    return paths


def charts(result: dict[str, Any]) -> list[common.BarChart]:
    """Per model (its largest config): the projected tide speed-up over fsdp2 per GPU count
    (symm_mem projects as fsdp2); and the exact RS buffer GiB of the first of them."""
    projected = {r["config"] for r in result["projection"]}
    largest: dict[str, dict[str, Any]] = {}
    for info in result["configs"]:
        if info["name"] not in projected:
            continue  # a calibration reference only
        if info["params"] > largest.get(info["model_name"], {"params": -1})["params"]:
            largest[info["model_name"]] = info
    names = [info["name"] for info in largest.values()]
    out = []
    for name in names:
        rows = [r for r in result["projection"] if r["config"] == name and r["mode"] == "tide"]
        out.append(
            common.BarChart(
                title=f"projection: {name}, tide speed-up vs fsdp2",
                labels=[f"{r['gpus']} GPUs" for r in rows],
                values=[r["projection_speedup_vs_fsdp2"] for r in rows],
                ylabel="fsdp2 step / tide step (projection)",
            )
        )
    rows = [r for r in result["memory"] if r["config"] == names[0] and r["mode"] != "symm_mem"]
    out.append(
        common.BarChart(
            title=f"{names[0]}: RS buffer per rank (exact)",
            labels=[f"{r['gpus']} {r['mode']}" for r in rows],
            values=[r["rs_gib"] for r in rows],
            ylabel="GiB",
        )
    )
    return out


def _gpu_counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ProjectionError(f"--gpus {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 2:
        raise ProjectionError(f"--gpus {text!r}: every GPU count must be >= 2")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--gpus", default=",".join(map(str, DEFAULT_GPUS)))
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    parser.add_argument("--local-world-size", type=int, default=8)
    parser.add_argument("--nics-per-node", type=int, default=8)
    parser.add_argument("--nic-gbps", type=float, default=400.0)
    parser.add_argument(
        "--nvlink-gibps",
        type=float,
        default=None,
        help="intra-node copy-engine GiB/s (default: calibration, else 368)",
    )
    parser.add_argument("--calibration", action="append", default=[], metavar="JSON")
    args = parser.parse_args(argv)
    try:
        for flag in ("local_world_size", "nics_per_node", "nic_gbps"):
            if getattr(args, flag) <= 0:
                raise ProjectionError(f"--{flag.replace('_', '-')} must be positive")
        cluster = Cluster(args.local_world_size, args.nics_per_node, args.nic_gbps)
        gpus_list = _gpu_counts(args.gpus)
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        cal = default_calibration()
        for path in args.calibration:
            cal = apply_calibration_file(cal, path)
        if args.nvlink_gibps is not None:
            nvlink = _number(args.nvlink_gibps, "--nvlink-gibps", positive=True)
            sources = {**cal.sources, "nvlink_gibps": "flag --nvlink-gibps"}
            cal = replace(cal, nvlink_gibps=nvlink, sources=sources)
        result = run_projection(configs, gpus_list, cal, cluster)
    except ValueError as exc:  # ProjectionError, PlanError, TideConfigError
        parser.error(str(exc))
    result = {
        "metadata": common.metadata(max(gpus_list)),
        **result,
        "inputs": {
            "configs": configs,
            "gpus": gpus_list,
            **asdict(cluster),
            "network_gibps_per_gpu": cluster.net_gibps_per_gpu,
        },
        "calibration": cal.record(args.calibration),
        "projection_model": STEP_MODEL.strip(),
    }
    for kind, path in write_outputs(result, args.out_dir).items():
        print(f"wrote {kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
