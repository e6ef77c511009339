"""Check 5, ``rates``: TIDE-AG and TIDE-RS against the backend's own all-gather and
reduce-scatter on this cluster, per tier, at the config's shard sizes; then a simulator
cluster file from the measurements and the simulator's prediction for this cluster.

Tiers (``preflight/layout.py``): node-local (the ranks of one node of an FSDP group) and
cross-node (same local index on every node), plus the whole FSDP group where it has both.
Per tier, one block with the parameter shapes of the config's largest FSDP group, dim 0
scaled so that every rank holds the shard it holds in the job (``fsdp_groups``: the TOML's
model on the meta device), is sharded twice over the tier's process group with the job's
mixed precision: one copy stock FSDP2, one with TIDE applied (the run's ``[tide]``
options; ``local_world_size`` set to the tier's shape). Timed, median of a few rounds after
warm-up, every rank of the tier starting together:

- all-gather: the backend's ``all_gather_into_tensor`` of the shard bytes; FSDP2's and
  TIDE's ``unshard()`` (TIDE-AG);
- reduce-scatter: ``reduce_scatter_tensor`` of the reduce-dtype gradient bytes; the
  block's ``backward()`` under FSDP2 and under TIDE (TIDE-RS), parameters unsharded
  before, so the backward is the gradient fill plus the reduce-scatter.

Ratios: TIDE / backend collective and TIDE / FSDP2 (< 1: TIDE faster). On CPU these are
gloo figures on CPU processes, said so in every row. The cluster file
(``train_configs/clusters`` format, ``simulator/cluster.py``) gets the ranks per node, the
loaded NCCL and, where a cross-node tier exists, the NIC rate per GPU from the backend's
cross-node all-gather (bytes each rank receives over time); rank 0 then runs the
simulator's command line on it (``python -m torchtitan_tide.simulator``, its ``--json``).
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_tide import comm
from torchtitan_tide.comm.fsdp import install
from torchtitan_tide.config import Tide
from torchtitan_tide.preflight import model as small
from torchtitan_tide.preflight.layout import JobLayout
from torchtitan_tide.preflight.paths import tide_options
from torchtitan_tide.preflight.report import Row

WARMUP = {"cuda": 3, "cpu": 1}
ITERS = {"cuda": 10, "cpu": 3}
MIB = 2**20


class RateBlock(nn.Module):
    """Parameters of the given shapes; the forward sums them (gradients: ones).

    ``forward`` takes a one-element tensor on the block's device: FSDP2's root pre-forward
    moves the inputs to the device and, on CUDA, indexes the first (torch 2.11
    ``_root_pre_forward``): a forward without arguments raises ``IndexError`` there."""

    def __init__(self, shapes: list[tuple[int, ...]], device: torch.device) -> None:
        super().__init__()
        # made on the device: a whole FSDP group of a 70B layer is GBs of host memory per rank
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(s, device=device).normal_(0.0, 0.02)) for s in shapes)

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return scale * sum(w.float().sum() for w in self.weights)


def config_shapes(config_path: str, group_size: int) -> tuple[str, list[tuple[int, ...]]]:
    """(name, shapes) of the config's largest FSDP group (``fsdp_groups``)."""
    from torchtitan_tide.fsdp_groups import load_config_model

    groups = load_config_model(config_path).groups
    biggest = max(groups, key=lambda g: g.numel)
    return biggest.name, [tuple(s) for s in biggest.param_shapes]


def _scaled(shapes: list[tuple[int, ...]], tier: int, group_size: int) -> list[tuple[int, ...]]:
    """Shapes whose dim 0 is scaled by ``tier / group_size``: each rank's shard as in the job."""
    return [(max(1, round(s[0] * tier / group_size)), *s[1:]) for s in shapes]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, group: dist.ProcessGroup, device: torch.device, prepare=None) -> float:
    """Median ms of ``fn`` over the iterations after warm-up (``prepare`` untimed before
    each), every rank of ``group`` starting together."""
    times = []
    kind = device.type if device.type == "cuda" else "cpu"
    for i in range(WARMUP[kind] + ITERS[kind]):
        if prepare is not None:
            prepare()
        if device.type == "cuda":
            dist.barrier(group=group, device_ids=[device.index])
        else:
            dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= WARMUP[kind]:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _block(shapes, mesh, job_config, device: torch.device) -> RateBlock:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    block = RateBlock(shapes, device)
    fully_shard(block, mesh=mesh, mp_policy=small.mp_policy(job_config),
                reshard_after_forward=False)  # fmt: skip
    block.set_gradient_divide_factor(1.0)
    if device.type == "cpu" and hasattr(block, "set_force_sum_reduction_for_comms"):
        block.set_force_sum_reduction_for_comms(True)
    return block


def _module_times(block: RateBlock, group, device) -> tuple[float, float]:
    """(unshard ms, backward ms) of ``block``, after one forward and backward (FSDP's lazy
    initialization, through the public API)."""
    one = torch.ones((), device=device)
    block(one).backward()
    block.zero_grad(set_to_none=True)
    ag = _time(block.unshard, group, device, prepare=block.reshard)
    state: dict[str, torch.Tensor] = {}

    def forward() -> None:
        block.zero_grad(set_to_none=True)
        block.unshard()
        state["loss"] = block(one)

    rs = _time(lambda: state["loss"].backward(), group, device, prepare=forward)
    block.zero_grad(set_to_none=True)
    block.reshard()
    return ag, rs


def _backend_times(group, shard_numel: int, param_dtype, reduce_dtype,
                   device: torch.device) -> tuple[float, float]:  # fmt: skip
    """(all_gather_into_tensor ms, reduce_scatter_tensor ms) of the shard on ``group``."""
    size = group.size()
    shard = torch.ones(shard_numel, dtype=param_dtype, device=device)
    gathered = torch.empty(shard_numel * size, dtype=param_dtype, device=device)
    grads = torch.ones(shard_numel * size, dtype=reduce_dtype, device=device)
    reduced = torch.empty(shard_numel, dtype=reduce_dtype, device=device)
    with warnings.catch_warnings():  # torch 2.13 deprecates both names (FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        ag = _time(lambda: dist.all_gather_into_tensor(gathered, shard, group=group), group,
                   device)  # fmt: skip
        rs = _time(lambda: dist.reduce_scatter_tensor(reduced, grads, group=group), group,
                   device)  # fmt: skip
    return ag, rs


def _tier(name: str, group: dist.ProcessGroup, local_world_size: int, shapes, job_config,
          tide: Tide, device: torch.device) -> dict[str, Any]:  # fmt: skip
    """One tier's timings on this rank (module docstring)."""
    from torch.distributed.device_mesh import DeviceMesh

    size = group.size()
    mesh = DeviceMesh.from_group(group, device.type)
    dtypes = small.DTYPES
    param_dtype = dtypes[job_config.training.mixed_precision_param]
    reduce_dtype = dtypes[job_config.training.mixed_precision_reduce]
    shard_numel = sum(-(-s[0] // size) * (torch.Size(s[1:]).numel()) for s in shapes)
    out: dict[str, Any] = {"tier": name, "ranks": size, "shard_numel": shard_numel,
                           "backend": str(dist.get_backend(group)),
                           "param_bytes": torch.finfo(param_dtype).bits // 8,
                           "reduce_bytes": torch.finfo(reduce_dtype).bits // 8}  # fmt: skip
    out["ag_backend_ms"], out["rs_backend_ms"] = _backend_times(
        group, shard_numel, param_dtype, reduce_dtype, device)
    stock = _block(shapes, mesh, job_config, device)
    out["ag_fsdp2_ms"], out["rs_fsdp2_ms"] = _module_times(stock, group, device)
    del stock
    tided = _block(shapes, mesh, job_config, device)
    options = {**tide_options(tide), "local_world_size": local_world_size}
    try:
        comm.apply(tided, "tide", **options)
    except (install.TideInstallError, ValueError) as exc:  # agreed over the tier
        out["error"] = f"comm.apply(tide) on this tier: {type(exc).__name__}: {exc}"
        return out
    try:
        out["ag_tide_ms"], out["rs_tide_ms"] = _module_times(tided, group, device)
        paths = install.context(tided)
        out["tide_path"] = (paths.decisions or ["?"])[0] if paths is not None else "?"
    finally:
        comm.remove(tided)
    return out


def _tiers(layout: JobLayout) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, global ranks, TIDE local_world_size) of this rank's tiers, in the same order on
    every rank (sizes > 1 only)."""
    if layout.tide is None:
        return []
    tiers = []
    node, tier = layout.node_ranks(), layout.tier_ranks()
    if len(node) > 1:
        tiers.append(("node-local", node, len(node)))
    if len(tier) > 1:
        tiers.append(("cross-node", tier, 1))
    if len(node) > 1 and len(tier) > 1:
        tiers.append(("FSDP group", layout.shard_ranks, layout.tide.local_world_size))
    return tiers


def run(layout: JobLayout, job_config: Any, tide: Tide, shapes) -> list[dict[str, Any]]:
    """This rank's timings of every tier (collective over the tiers' ranks)."""
    out = []
    group_size = len(layout.shard_ranks)
    for name, ranks, lws in _tiers(layout):
        if tuple(ranks) == tuple(layout.shard_ranks):
            group = layout.shard_group
        else:
            group = dist.new_group(ranks=list(ranks), use_local_synchronization=True)
        out.append(_tier(name, group, lws, _scaled(shapes, len(ranks), group_size),
                         job_config, tide, layout.device))  # fmt: skip
        if layout.device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} ms"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def rows(gathered: list[list[dict[str, Any]]], device_type: str, skipped: str | None) -> list[Row]:
    """Rank 0's rows: per tier the slowest rank's medians (collectives end together)."""
    if skipped:
        return [Row("rates", "collectives", "skip", skipped)]
    where = "CPU figures (gloo on CPU processes; not GPU rates)" if device_type == "cpu" else (
        "GPU")  # fmt: skip
    out = []
    for tier in merged(gathered):
        shard = tier["shard_numel"] * tier["param_bytes"]
        head = f"{where}; {tier['ranks']} ranks, {shard / MIB:.3g} MiB shard per rank"
        if tier.get("error"):
            out.append(Row("rates", f"{tier['tier']}", "warn", f"{head}: {tier['error']}"))
            continue
        backend = tier.get("backend", "backend")
        for op, label, call in (("ag", "TIDE-AG", "all-gather"), ("rs", "TIDE-RS",
                                                                   "reduce-scatter")):
            b, f, t = (tier.get(f"{op}_{k}_ms") for k in ("backend", "fsdp2", "tide"))
            out.append(Row("rates", f"{tier['tier']} {label}", "info",
                           f"{head}: {backend} {call} {_ms(b)}, FSDP2 {_ms(f)}, {label} {_ms(t)}"
                           f"; {label}/{backend} {_ratio(t, b)}, {label}/FSDP2 "
                           f"{_ratio(t, f)}"))  # fmt: skip
    if not out:
        out.append(Row("rates", "collectives", "skip", "no tier of more than one rank"))
    return out


def merged(gathered: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per distinct tier name: the slowest rank's times."""
    by_name: dict[str, dict[str, Any]] = {}
    for per_rank in gathered:
        for tier in per_rank:
            seen = by_name.setdefault(tier["tier"], dict(tier))
            for key, value in tier.items():
                if key.endswith("_ms") and value is not None:
                    seen[key] = max(seen.get(key) or 0.0, value)
            if tier.get("error"):
                seen["error"] = tier["error"]
    return list(by_name.values())


def cluster_file(path: Path, tiers: list[dict[str, Any]], gpus_per_node: int,
                 nccl: str | None, device_type: str) -> dict[str, Any]:  # fmt: skip
    """Write the simulator's cluster file (``[cluster]``) from the measurements; returns its
    values."""
    from torchtitan_tide.simulator.cluster import NCCL_MEASURED, Cluster

    cross = next((t for t in tiers if t["tier"] == "cross-node" and t.get("ag_backend_ms")),
                 None)  # fmt: skip
    notes = []
    if cross is not None:
        received = (cross["ranks"] - 1) * cross["shard_numel"] * cross["param_bytes"]
        gbps = received * 8 / (cross["ag_backend_ms"] / 1e3) / 1e9
        notes.append(f"nic_gbps_per_gpu: measured, the cross-node all_gather_into_tensor "
                     f"({cross['ranks']} ranks): bytes each rank receives / time")  # fmt: skip
    else:
        gbps = Cluster.nic_gbps_per_gpu
        notes.append("nic_gbps_per_gpu: NOT measured (no cross-node tier): the simulator's "
                     "default")  # fmt: skip
    if nccl is None or not nccl[:1].isdigit():
        nccl = NCCL_MEASURED
        notes.append(f"nccl_version: no NCCL loaded ({device_type}); the simulator's default")
    if device_type == "cpu":
        notes.append("CPU run: the rate is a gloo figure between CPU processes, not a NIC's")
    values = {"name": f"preflight: {gpus_per_node} per node, {gbps:.3g} Gb/s per GPU, NCCL "
                      f"{nccl}", "gpus_per_node": gpus_per_node,
              "nic_gbps_per_gpu": round(max(gbps, 1e-6), 6), "nccl_version": nccl}  # fmt: skip
    lines = ["# Simulator cluster file written by run_train.sh --preflight from its measurements"]
    lines += [f"# {note}" for note in notes]
    lines += ["[cluster]", f'name = "{values["name"]}"', f"gpus_per_node = {gpus_per_node}",
              f"nic_gbps_per_gpu = {values['nic_gbps_per_gpu']}",
              f'nccl_version = "{nccl}"']  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return {**values, "notes": notes, "path": str(path)}


def predict(config_path: str, gpus: int, cluster: Path, json_path: Path, tide: Tide,
            one_sided: bool) -> tuple[dict[str, Any] | None, str]:  # fmt: skip
    """The simulator's command line on this cluster (``--json``): (its JSON or None, what it
    printed, or its error)."""
    from torchtitan_tide.simulator.cli import main as simulate

    args = ["--config", config_path, "--gpus", str(gpus), "--cluster", str(cluster),
            "--rs-wire", tide.rs_wire_dtype, "--cross-node",
            "nccl_one_sided" if one_sided else "p2p", "--json", str(json_path)]  # fmt: skip
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            rc = simulate(args)
    except SystemExit as exc:  # argparse's error(): the message is in the captured text
        rc = exc.code
    if rc != 0 or not json_path.is_file():
        return None, text.getvalue().strip().splitlines()[-1] if text.getvalue().strip() else (
            f"exit {rc}")  # fmt: skip
    return json.loads(json_path.read_text()), text.getvalue()


def prediction_rows(result: dict[str, Any] | None, text: str, gpus: int) -> list[Row]:
    if result is None:
        return [Row("rates", "simulator", "warn", f"no prediction: {text}")]
    parts = [f"{r['mode']} {r['sim_step_ms']:.1f} ms"
             + (f" ({r['sim_speedup_vs_fsdp2']:.3f}x)" if "sim_speedup_vs_fsdp2" in r else "")
             for r in result["rows"]]  # fmt: skip
    nodes = result["rows"][0]["nodes"] if result["rows"] else "?"
    return [Row("rates", "simulator", "info",
                f"a SIMULATION at {gpus} GPUs ({nodes} node(s)) on the measured cluster file: "
                + ", ".join(parts))]  # fmt: skip
