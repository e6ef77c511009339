"""``bench_interference.py --one-gpu`` (issue 35): the row arithmetic (compute at matched
burst positions, the side op's device time), the NCCL-like copy kernel (Triton's CPU
interpreter, and compiled for sm_90), the result files the simulator reads, and a small
run on one GPU (``gpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))
import interference_one_gpu as one


def test_rows_compare_compute_at_the_same_burst_positions():
    # alone: the first op of a burst runs fast (a cool, unthrottled GPU), later ones slower
    alone = [[1.0, 2.0, 2.0, 2.0], [1.0, 2.0, 2.0, 2.0]]
    # beside: ops 1 and 2 inside the side op's span, each 50% slower than at its position
    beside = [[(1, 3.0), (2, 3.0)], [(1, 3.0)]]
    pair = one.Pair(alone, beside, side_alone=[4.0, 4.0], side_beside=[5.0, 6.0],
                    covered=[True, True])  # fmt: skip
    row = one.summarize("large", "cast_foreach", pair)
    assert row["slowdown_pct"] == pytest.approx(50.0)  # not (3 / median(1, 2, 2, 2)) - 1
    assert row["samples"] == 3 and row["compute_alone_ms"] == pytest.approx(2.0)
    assert row["side_slowdown_pct"] == pytest.approx(100 * (5.5 / 4.0 - 1))
    assert row["covered"] is True and row["error"] is None
    empty = one.summarize("large", "nccl_like_24", one.Pair([[1.0]], [[]], [], [], []))
    assert empty["slowdown_pct"] is None and empty["side_slowdown_pct"] is None


def test_burst_outlasts_the_side_op():
    assert one.burst_length(4.0, 1.5) == 45  # ceil(16 x 4 / 1.5) + 2
    assert one.burst_length(4.0, 0.0) == one.MAX_BURST
    assert one.burst_length(0.01, 2.0) == 8
    assert set(one.SIDES) == {"copy_engine", "nccl_like_24", "nccl_like_9", "cast_foreach",
                              "accumulate", "local_copy_ce", "local_batch_ce"}  # fmt: skip
    classes = {"single_wave", "large", "grouped_experts", "attention"}
    assert set(one.COMPUTE) == set(one.SMALL_COMPUTE) == classes


def test_local_copy_sides_copy_what_placement_copies_and_report_their_rate():
    """local_batch_ce is one wave of placement at 8 x 8 (8 entries x the 9 shards of a
    Llama-3.1-70B layer at 64 ranks, bf16); its rows carry the rate of its device time."""
    sizes = one.placement_sizes(small=False)
    assert len(sizes) == 72 and sizes[:9] == [2 * (8192 * 8192 // 64), 2 * (1024 * 8192 // 64),
                                              2 * (1024 * 8192 // 64), 2 * (8192 * 8192 // 64),
                                              2 * (28672 * 8192 // 64), 2 * (28672 * 8192 // 64),
                                              2 * (8192 * 28672 // 64), 256, 256]  # fmt: skip
    assert one.side_bytes("local_batch_ce", False) == sum(sizes)
    assert one.side_bytes("local_copy_ce", False) == one.side_bytes("copy_engine", False) == 2**28
    assert one.side_bytes("cast_foreach", False) == 0
    pair = one.Pair([[1.0]], [[(0, 1.5)]], side_alone=[4.0], side_beside=[8.0], covered=[True])
    row = one.summarize("large", "local_batch_ce", pair, side_bytes=2**30)
    assert row["side_gib_s_alone"] == pytest.approx(250.0)
    assert row["side_gib_s_beside"] == pytest.approx(125.0)
    assert one.summarize("large", "cast_foreach", pair)["side_gib_s_alone"] is None


def test_nccl_like_kernel_copies_everything_in_the_interpreter():
    pytest.importorskip("triton")
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(BENCH)!r})
        import interference_one_gpu as one
        for ctas in (24, 9):
            src = torch.arange(100_003, dtype=torch.float32).to(torch.bfloat16)
            dst = torch.zeros_like(src)
            one._copy_kernel()[(ctas,)](src, dst, src.numel(), BLOCK=4096, GRID=ctas)
            assert torch.equal(dst, src), ctas
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


def test_nccl_like_kernel_compiles_for_hopper():
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = one._copy_kernel()
    runtime = {"src": "*bf16", "dst": "*bf16", "numel": "i32"}
    constexprs = {"BLOCK": 4096, "GRID": 24}
    signature = {name: runtime.get(name, "constexpr") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={
        (kernel.arg_names.index(k),): v for k, v in constexprs.items()})  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
    assert compiled.asm["cubin"]


def _one_gpu_result(tmp_path, machine: str, date: str, commit: str, sides) -> str:
    rows = [{"compute": "attention", "side": "none", "compute_alone_ms": 2.0, "error": None}]
    rows += [
        one.summarize("attention", side, one.Pair([[2.0, 2.0]], [[(1, 2.2)]], [4.0], [4.4],
                                                  [True]), side_bytes=2**30)
        for side in sides
    ]  # fmt: skip
    meta = {"date": f"{date}T00:00:00Z", "machine": machine, "hostname": "h", "torch": "2.11",
            "nccl": None, "cuda": "13.0", "commit": commit, "world_size": 1}  # fmt: skip
    results = {"kind": "interference_one_gpu", "metadata": meta, "status": "complete",
               "config": {"reps": 1, "side_ms": 4.0}}  # fmt: skip
    gpu = machine.split()[1].lower()
    stem = str(tmp_path / f"{date}_nvidia-{gpu}-x-1_{commit}_interference_one_gpu")
    assert one.write(results, rows, stem) == 0
    return Path(stem + ".json").name


def test_result_files_are_what_the_simulator_reads(tmp_path):
    from torchtitan_tide.simulator import interference

    name = _one_gpu_result(tmp_path, "NVIDIA H200 x 1", "2026-12-05", "abc1234", one.SIDES)
    assert name == "2026-12-05_nvidia-h200-x-1_abc1234_interference_one_gpu.json"
    assert interference.one_gpu_file(tmp_path).name.endswith("_interference_one_gpu.json")
    figures = interference.one_gpu_figures(tmp_path)
    fig = figures[("ce", "attention")]
    assert fig.kind == "measured (one H200)" and fig.compute == pytest.approx(0.10)
    assert fig.comm == pytest.approx(0.10)
    assert {e for e, _ in figures} == {"ce", "ce_local", "nccl", "nccl_symk", "sm_ag", "sm_rs"}
    rate, kind, _ = interference.local_copy_rate(tmp_path, (1e6, "a device copy"))
    assert (rate, kind) == (pytest.approx(250.0), "measured (one H200)")  # 1 GiB in 4 ms
    assert json.loads((tmp_path / name).read_text())["tables"][0]["rows"][0]["side"] == "none"


def test_simulator_keeps_the_simulated_gpu_and_takes_the_local_copy_where_measured(tmp_path):
    """An older H200 result without the local copy sides and a newer H100 one with them: the
    engines' figures stay the H200's (the GPU of every other input), the local copy's come
    from the H100 result, named as an H100 measurement."""
    from torchtitan_tide.simulator import interference

    old_sides = [s for s in one.SIDES if not s.startswith("local_")]
    h200 = _one_gpu_result(tmp_path, "NVIDIA H200 x 1", "2026-12-04", "aaa1111", old_sides)
    h100 = _one_gpu_result(tmp_path, "NVIDIA H100 80GB HBM3 x 1", "2026-12-07", "bbb2222",
                           one.SIDES)  # fmt: skip
    assert interference.one_gpu_file(tmp_path).name == h200
    assert interference.local_copy_file(tmp_path).name == h100
    figures = interference.one_gpu_figures(tmp_path)
    assert figures[("ce", "attention")].kind == "measured (one H200)"
    assert h200 in figures[("ce", "attention")].source
    local = figures[("ce_local", "attention")]
    assert local.kind == "measured (one H100)" and h100 in local.source
    rate, kind, source = interference.local_copy_rate(tmp_path, (1e6, "a device copy"))
    assert (rate, kind) == (pytest.approx(250.0), "measured (one H100)") and h100 in source
    from torchtitan_tide.simulator.results import RESULTS

    for name in (interference.INTERFERENCE_FILE, interference.COLLECTIVES_FILE):
        (tmp_path / name).write_bytes((RESULTS / name).read_bytes())
    table = interference.figure_table(tmp_path)
    assert table[("ce_local", "attention")].kind == "measured (one H100)"
    # an H200 result with the local copy, newer or not, wins over the H100's
    h200_local = _one_gpu_result(tmp_path, "NVIDIA H200 x 1", "2026-12-01", "ccc3333", one.SIDES)
    assert interference.local_copy_file(tmp_path).name == h200_local
    assert interference.one_gpu_file(tmp_path).name == h200  # still the newest H200 result


@pytest.mark.gpu
def test_gpu_interference_one_gpu_small(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", CUDA_VISIBLE_DEVICES=os.environ.get(
                   "CUDA_VISIBLE_DEVICES", "0").split(",")[0])  # fmt: skip
    cmd = [sys.executable, str(BENCH / "bench_interference.py"), "--one-gpu", "--small",
           "--reps", "2", "--out-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*_interference_one_gpu_small.json")
    rows = json.loads(js.read_text())["tables"][0]["rows"]
    measured = [r for r in rows if r["side"] != "none"]
    assert len(measured) == 4 * len(one.SIDES) and all(r["error"] is None for r in measured)
    assert all(r["side_alone_ms"] and r["side_beside_ms"] for r in measured), measured
