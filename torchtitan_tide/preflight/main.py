"""The preflight's order: set up as the trainer does, run the five checks, print one table.

``run_train.sh --config NAME --preflight`` starts this module under torchrun in place of
the trainer, with the trainer's arguments: the job config is parsed by TorchTitan's own
parser (``[tide]`` included), the device and process group come up as the trainer's do
(CPU shim, ``torchtitan.distributed.utils.init_distributed``, TorchTitan's meshes), and
then, each under its time bound (``preflight/bounds.py``):

1. ``ranks`` (``facts.py``): what each rank has, versions that differ, nodes;
2. ``paths`` (``paths.py``): TIDE applied for real, what install chose per tier and why;
3. ``parity`` (``parity.py``): tide vs fsdp2 sharded gradients on the job's layout;
4. ``one_sided`` (``one_sided.py``): the one-sided protocol's assumptions under stress;
5. ``rates`` (``rates.py``): collectives per tier, the cluster file, the simulator.

Rank 0 prints the rows of every rank as one table, each failure again with its ranks and
fix, and writes the JSON (``<dump_folder>/preflight/preflight-<time>.json``, the cluster
file and the simulator's JSON beside it). Exit status: rank 0's is ``report.EXIT_FAILED``
when a check failed (its causes go to ``<dump_folder>/tide_failures.txt``, which
``run_train.sh`` prints), the other ranks' 0; a check past its bound ends its rank with
``report.EXIT_TIMEOUT`` (``bounds.bounded``); a check that raises ends its rank with
``report.EXIT_FAILED``, reported the same way.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_tide.comm.base import watchdog
from torchtitan_tide.preflight import facts, one_sided, parity, paths, rates
from torchtitan_tide.preflight import model as small
from torchtitan_tide.preflight.bounds import Control, bounded, check_timeout_s, end_rank
from torchtitan_tide.preflight.layout import JobLayout, job_layout
from torchtitan_tide.preflight.report import (
    EXIT_FAILED,
    RESULT,
    Row,
    failure_lines,
    failures,
    preflight_folder,
    stamp,
    table,
    write_json,
)

logger = logging.getLogger(__name__)



def _where(exc: BaseException) -> str:
    """The innermost frames of ``exc``'s traceback as ``file:line in function`` (the report
    must say where a check broke: the log of a rank may not be shown)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
                       for f in reversed(frames)) or "no traceback"  # fmt: skip

class Preflight:
    """One rank's run: its bounds, and on rank 0 the rows of every rank."""

    def __init__(self, rank: int, budget_s: float, dump_folder: str, config_path: str) -> None:
        self.rank, self.budget_s, self.dump_folder = rank, budget_s, dump_folder
        self.config_path = config_path
        self.rows: list[Row] = []
        self.extra: dict[str, Any] = {"config": config_path, "started": time.time()}
        self.stamp = stamp()
        self._printed = threading.Lock()

    def check(self, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` as check ``name``, bounded; a raise ends this rank (module docstring)."""
        with bounded(name, self.budget_s, self.rank, self.dump_folder, self.partial):
            try:
                return fn()
            except Exception as exc:  # reported, then this rank ends
                logger.exception("preflight: check %s raised", name)
                message = (f"preflight: rank {self.rank}: check '{name}' raised "
                           f"{type(exc).__name__}: {exc} ({_where(exc)})")  # fmt: skip
                self.partial(message)
                end_rank(message, self.dump_folder, EXIT_FAILED)

    def partial(self, message: str) -> None:
        """Rank 0: print and write the rows so far, with ``message`` (a check that did not
        finish)."""
        if self.rank != 0:
            return
        self.rows.append(Row("preflight", "stopped", "FAIL", message, [self.rank]))
        self.finish(partial=True)

    def finish(self, partial: bool = False) -> int:
        """Rank 0: the table, the failures, the JSON; returns the exit status."""
        with self._printed:
            failed = failures(self.rows)
            if not partial:
                self.rows.append(Row(
                    *RESULT, "FAIL" if failed else "ok",
                    f"{len(failed)} check(s) failed" if failed else "every check passed",
                    sorted({r for row in failed for r in row.ranks}),
                ))  # fmt: skip
            folder = preflight_folder(self.dump_folder)
            path = write_json(folder / f"preflight-{self.stamp}.json", self.rows,
                              {**self.extra, "partial": partial, "finished": time.time()})  # fmt: skip
            lines = ["", "[preflight] " + ("PARTIAL: " if partial else "")
                     + f"{self.config_path}: TIDE's assumptions on this cluster", table(self.rows)]
            lines += failure_lines(self.rows)
            if self.extra.get("simulator_text"):
                lines += ["", "[preflight] the simulator on the measured cluster file (inputs: JSON)"]
                lines += [line for line in self.extra["simulator_text"].splitlines()
                          if line.startswith(("Simulated", "|")) or "modeled" in line]
            lines += [f"[preflight] JSON: {path}"]
            print("\n".join(lines), flush=True)
            if failed and not partial:
                watchdog.report(
                    f"preflight: {len(failed)} check(s) failed: " + "; ".join(
                        f"{row.check}/{row.what} ({', '.join(map(str, row.ranks)) or 'job'})"
                        for row in failed) + f" (table above; {path})", self.dump_folder)
            return EXIT_FAILED if failed else 0


def _layout_summary(layout: JobLayout) -> dict[str, Any]:
    return {"shard_ranks": list(layout.shard_ranks),
            "tide_shape": layout.tide.shape if layout.tide is not None else None,
            "tide_source": layout.tide_source}  # fmt: skip


def _setup(args: list[str]) -> tuple[Any, torch.device]:
    """As the trainer: ``[tide]`` checked, CPU shim, TorchTitan's parse, logging, the
    device, the process group."""
    from torchtitan_tide.device import use_cpu_device, wants_cpu
    from torchtitan_tide.train import check_config_and_set_comm_env

    check_config_and_set_comm_env(args)
    cpu = wants_cpu()
    if cpu:
        use_cpu_device()
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools.logging import init_logger

    import torchtitan_tide.train_specs  # noqa: F401  (specs: the config's model for rates)
    from torchtitan_tide.log_noise import install_noise_filters

    job_config = ConfigManager().parse_args(args)
    init_logger()
    install_noise_filters("cpu" if cpu else "cuda")
    device = torch.device("cpu")
    if not cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist_utils.init_distributed(job_config.comm, base_folder=job_config.job.dump_folder)
    return job_config, device


def run(args: list[str]) -> int:
    """The preflight of the job ``args`` describe (module docstring); the exit status."""
    job_config, device = _setup(args)
    tide = job_config.tide
    budget = check_timeout_s()
    rank = dist.get_rank()
    pf = Preflight(rank, budget, job_config.job.dump_folder, job_config.job.config_file)
    is_root = rank == 0

    def setup() -> JobLayout:
        control = Control(budget)
        return job_layout(job_config, device, control, tide.tide_options())

    layout = pf.check("setup", setup)
    control = layout.control

    def ranks() -> None:
        gathered = control.gather((facts.rank_facts(device, rank), _layout_summary(layout)),
                                  "ranks")  # fmt: skip
        if is_root:
            pf.extra["ranks"] = [f for f, _ in gathered]
            pf.rows += facts.rows([f for f, _ in gathered], [s for _, s in gathered])

    pf.check("ranks", ranks)
    models: dict[str, Any] = {}
    no_fsdp = (None if layout.dp_mesh is not None else
               f"no FSDP in this job ({layout.tide_source}): TIDE has nothing to take")  # fmt: skip

    def check_paths() -> None:
        error = None
        if no_fsdp is None:
            size = len(layout.shard_ranks)
            models["ref"] = small.build(layout.dp_mesh, size, job_config, device)
            models["tide"] = small.build(layout.dp_mesh, size, job_config, device)
            error = models["error"] = paths.apply_tide(models["tide"], tide)
        local = paths.local_paths(models["tide"], error) if models else None
        gathered = control.gather(local, "paths")
        if is_root:
            pf.extra["paths"] = gathered
            if no_fsdp:
                pf.rows.append(Row("paths", "TIDE", "skip", no_fsdp))
            else:
                from torchtitan_tide.comm.transports.windows import nccl_rma

                missing = nccl_rma.one_sided_missing_reason() if device.type == "cuda" else None
                pf.rows += paths.rows(gathered, tide, device.type, missing)

    pf.check("paths", check_paths)

    def check_parity() -> None:
        skipped = no_fsdp or ("comm.apply(tide) failed (paths above)" if models.get("error")
                              else None)  # fmt: skip
        outcome = None
        if skipped is None:
            outcome = parity.run(layout, models["tide"], models["ref"], job_config)
        gathered = control.gather(outcome, "parity")
        if models and not models.get("error"):
            from torchtitan_tide import comm

            comm.remove(models["tide"])
        models.clear()
        gc.collect()
        if is_root:
            pf.extra["parity"] = gathered
            pf.rows += parity.rows(gathered, skipped)

    pf.check("parity", check_parity)

    def check_one_sided() -> list[dict[str, Any]]:
        outcome = one_sided.run(layout, wait_s=min(60.0, budget / 2))
        gathered = control.gather(outcome, "one_sided")
        if is_root:
            pf.extra["one_sided"] = gathered
            pf.rows += one_sided.rows(gathered, tide)
        return gathered

    sided = pf.check("one_sided", check_one_sided)
    stuck = [r for r, g in enumerate(sided) if g["stuck"]]

    def check_rates() -> None:
        shapes, error = None, None
        if is_root and no_fsdp is None:
            try:
                shapes = rates.config_shapes(job_config.job.config_file, len(layout.shard_ranks))
            except ValueError as exc:  # FsdpGroupsError: a layout the group model does not cover
                error = f"the config's FSDP groups: {exc}"
        shapes, error = control.gather((shapes, error), "rates shapes")[0]
        skipped = no_fsdp or error or (
            f"not run: a one-sided wait of rank(s) {stuck} never ended, a device stream still "
            "waits (see one_sided)" if stuck else None)  # fmt: skip
        measured = [] if skipped else rates.run(layout, job_config, tide, shapes[1])
        gathered = control.gather(measured, "rates")
        if not is_root:
            return
        pf.extra["rates"] = rates.merged(gathered)
        pf.rows += rates.rows(gathered, device.type, skipped)
        if skipped:
            return
        folder = preflight_folder(pf.dump_folder)
        lws = layout.tide.local_world_size if layout.tide is not None else 1
        nccl = pf.extra["ranks"][0]["nccl"]
        cluster = rates.cluster_file(folder / f"cluster-{pf.stamp}.toml", pf.extra["rates"],
                                     lws, nccl, device.type)  # fmt: skip
        pf.extra["cluster"] = cluster
        pf.rows.append(Row("rates", "cluster file", "info",
                           f"{cluster['path']}: gpus_per_node {cluster['gpus_per_node']}, "
                           f"nic_gbps_per_gpu {cluster['nic_gbps_per_gpu']:.4g}, NCCL "
                           f"{cluster['nccl_version']} ({'; '.join(cluster['notes'])})"))  # fmt: skip
        one_sided_ran = not any(g["skip"] or g["error"] for g in sided)
        result, text = rates.predict(job_config.job.config_file, layout.world_size,
                                     folder / f"cluster-{pf.stamp}.toml",
                                     folder / f"simulator-{pf.stamp}.json", tide,
                                     one_sided_ran and device.type == "cuda")  # fmt: skip
        pf.extra["simulator_text"] = text if result is not None else ""
        pf.extra["simulator"] = result
        pf.rows += rates.prediction_rows(result, text, layout.world_size)

    pf.check("rates", check_rates)

    def finish() -> int:
        status = pf.finish() if is_root else 0
        control.barrier()  # the process groups end together (after rank 0's simulator run)
        return status

    status = pf.check("finish", finish)
    dist.destroy_process_group()
    return status


def main() -> None:
    from torchtitan_tide.launch.command_line import normalize_bool_flags, tide_bool_keys

    args = normalize_bool_flags(sys.argv[1:], tide_bool_keys())
    sys.exit(run(args))
