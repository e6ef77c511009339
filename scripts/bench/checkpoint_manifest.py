"""Added save time of TIDE's sha256 manifest (torchtitan_tide/checkpoint.py) on one rank.

Saves a ``--gb`` GB state dict with TorchTitan's ``CheckpointManager.dcp_save``, bare
and with TIDE's patch (interleaved, so both see the same machine), synchronously and
asynchronously, ``--repeats`` times each into fresh folders under ``--dir``, and prints
medians. Synchronous: the time until ``dcp_save`` returns (the training thread waits that
long), and ``write_manifest`` alone on the bare save's folder. Asynchronous: the time
until it returns (staging: what the training thread waits) and until its future
completes (manifest included with the patch).

    python3 scripts/bench/checkpoint_manifest.py --gb 1 --dir /tmp/ckpt_bench
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from types import SimpleNamespace

import torch


def _state(gb: float) -> dict[str, torch.Tensor]:
    n = int(gb * 1e9) // 4 // 8  # 8 float32 tensors
    return {f"w{i}": torch.randn(n) for i in range(8)}


def _time_save(save, state, folder: str, mode: str) -> tuple[float, float]:
    from torchtitan.components.checkpoint import AsyncMode

    manager = SimpleNamespace(pg=None, sd_adapter=None)
    begin = time.perf_counter()
    out = save(manager, state, folder, AsyncMode(mode))
    returned = time.perf_counter() - begin
    if mode == "async":
        out.result()
    return returned, time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    from torchtitan.components.checkpoint import CheckpointManager

    from torchtitan_tide import checkpoint

    bare = CheckpointManager.dcp_save
    checkpoint.install()
    patched = CheckpointManager.dcp_save
    state, root = _state(args.gb), tempfile.mkdtemp(dir=args.dir)
    try:
        for mode in ("disabled", "async"):
            times: dict[str, list[tuple[float, float]]] = {"bare": [], "tide": []}
            hashed: list[float] = []
            for i in range(args.repeats):
                for name, save in (("bare", bare), ("tide", patched)):
                    folder = f"{root}/{name}-{mode}-{i}"
                    times[name].append(_time_save(save, state, folder, mode))
                    if name == "bare" and mode == "disabled":
                        begin = time.perf_counter()
                        checkpoint.write_manifest(folder)
                        hashed.append(time.perf_counter() - begin)
                    shutil.rmtree(folder)
            for name, runs in times.items():
                returned = statistics.median(t[0] for t in runs)
                done = statistics.median(t[1] for t in runs)
                print(f"{mode:8s} {name}: dcp_save returned after {returned:.2f} s, "
                      f"save complete after {done:.2f} s (median of {args.repeats}, {args.gb} GB)")
            if hashed:
                print(f"write_manifest alone: {statistics.median(hashed):.2f} s "
                      f"(median; min {min(hashed):.2f}, max {max(hashed):.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
