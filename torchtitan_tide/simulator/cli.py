"""The simulator's command line (``python -m torchtitan_tide.simulator``): one config at
one GPU count, or the committed report (``--report``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from torchtitan_tide.simulator.cluster import load_cluster
from torchtitan_tide.simulator.inputs import MODES, RESULTS, Workload, inputs_record
from torchtitan_tide.simulator.plans import AG_TRANSPORTS, CROSS_NODE
from torchtitan_tide.simulator.step import simulate_config

# [tide] rs_wire_dtype's spellings and the short ones
WIRE_BYTES = {"fp32": 4, "bf16": 2, "float32": 4, "bfloat16": 2}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_tide.simulator",
        description="Simulated training step per comm mode (a SIMULATION, not a measurement)",
    )
    p.add_argument("--config", help="training TOML: a name in train_configs/ or a path")
    p.add_argument("--gpus", type=int, help="total GPUs of the run")
    p.add_argument("--trace", help="bench_trace.py JSON (default: the newest of the same model)")
    p.add_argument("--cluster", help="cluster TOML (train_configs/clusters/*.toml)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rs-wire", choices=sorted(WIRE_BYTES), default=None,
                   help="TIDE-RS cross-node partials: fp32 or bf16 (modeled); default: the "
                        "config's [tide] rs_wire_dtype")  # fmt: skip
    p.add_argument("--cross-node", choices=CROSS_NODE, default=None,
                   help="[tide] cross_node_transport (default: the config's): 'auto' takes NCCL's "
                        "one-sided puts on NCCL >= 2.29 (the cluster's nccl_version; host RMA "
                        "assumed), else send/recv")  # fmt: skip
    p.add_argument("--transport", choices=AG_TRANSPORTS, default=None,
                   help="[tide] ag_transport (default: the config's); what 'auto' takes on the "
                        "cluster's NCCL is in each row (tide_transport)")  # fmt: skip
    p.add_argument("--tokens-per-gpu", type=int, default=None,
                   help="simulate this many tokens per GPU as one sequence (default: the "
                        "config's batch x sequence)")  # fmt: skip
    p.add_argument("--mfu", type=float, default=0.4, help="MFU of the FLOPs fallback (no trace)")
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--report", action="store_true",
                   help="write the validation, reference-config table, sensitivity and picture")  # fmt: skip
    p.add_argument("--out-dir", default=str(RESULTS))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        cluster = load_cluster(args.cluster)
        if args.report:
            from torchtitan_tide.simulator import report

            for kind, path in report.write_report(
                Path(args.results_dir), Path(args.out_dir), cluster
            ).items():
                print(f"wrote {kind}: {path}")
            return 0
        if not args.config or not args.gpus:
            parser.error("--config and --gpus are required (or --report)")
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if bad := [m for m in modes if m not in MODES]:
            parser.error(f"--modes {bad}: choose from {list(MODES)}")
        if args.tokens_per_gpu is not None and args.tokens_per_gpu <= 0:
            parser.error(f"--tokens-per-gpu {args.tokens_per_gpu}: must be > 0")
        tokens = args.tokens_per_gpu
        result = simulate_config(
            args.config, args.gpus, modes, cluster, Path(args.results_dir), args.trace, args.mfu,
            rs_wire_bytes=WIRE_BYTES[args.rs_wire] if args.rs_wire else None,
            cross_node=args.cross_node,
            transport=args.transport,
            workload=Workload(tokens, tokens) if tokens else None,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as exc:  # SimulateError, ClusterError, FsdpGroupsError
        parser.error(str(exc))
    rows = result["rows"]
    print(f"Simulated step (a SIMULATION, not a measurement): {args.config} at {args.gpus} GPUs "
          f"({rows[0]['nodes']} node(s)), cluster: {cluster.name} (NCCL "
          f"{cluster.nccl_version}); TIDE-RS wire "
          f"{'bf16' if result['rs_wire_bytes'] == 2 else 'fp32'}")  # fmt: skip
    print("| mode | TIDE runs | step ms | speed-up vs fsdp2 | compute ms | SM-ms taken from "
          "compute | layout ms | exposed ms (fwd/bwd/tail) | accumulate ms | comm slowed ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        runs = "-" if r["tide_transport"] == "-" else (
            f"{r['tide_transport']}, phase 2 {r['rs_phase2']}"
            + (f", in place (every local rank simulated; local rank "
               f"{r['sim_slowest_local_rank']} sets the step)" if r["in_place"] else ""))  # fmt: skip
        cells = [r["mode"], runs, f"{r['sim_step_ms']:.1f}",
                 f"{r.get('sim_speedup_vs_fsdp2', float('nan')):.3f}",
                 *(f"{r[f'sim_bd_{k}_ms']:.1f}" for k in ("compute", "sm_taken", "layout")),
                 f"{r['sim_exposed_ms']:.1f} (" + "/".join(
                     f"{r[f'sim_bd_exposed_{k}_ms']:.1f}" for k in ("fwd", "bwd", "tail")) + ")",
                 f"{r['sim_accumulate_ms']:.1f}", f"{r['sim_comm_slowed_ms']:.1f}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        if r["mode_note"]:
            print(f"  {r['mode']}: {r['mode_note']}")
    if any(r["rs_phase2"] == "one_sided" for r in rows) or result["rs_wire_bytes"] != 4:
        print("  the one-sided transport and bf16 wire are modeled, not measured at scale")
    from torchtitan_tide.simulator.network import SOURCES

    for key, text in SOURCES.items():
        print(f"  {key} (modeled): {text}")
    print("Inputs:")
    for key, text in result["sources"].items():
        print(f"  {key}: {text}")
    print(f"  cluster: {cluster.source} (NCCL {cluster.nccl_version})")
    if args.json:
        out = {"rows": rows, "inputs": inputs_record(result["inputs"]), "cluster": asdict(cluster)}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
