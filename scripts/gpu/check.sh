#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, the compute floors, the debug model per comm mode,
# the benchmark suite (step, all-gather, collectives, interference), the report, then a short
# table.
#   TIDE_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu/check.sh
#   STAGES="collectives interference step report" bash scripts/gpu/check.sh
#   STAGES="tests floor" bash scripts/gpu/check.sh      # all that runs on ONE GPU (~5 min)
#   STAGES=world1 bash scripts/gpu/check.sh             # the simulator's world-1 inputs (one GPU)
#   STAGES=interference_one_gpu bash scripts/gpu/check.sh  # the simulator's interference (one GPU)
# Stages (default: all, in this order) and their rough time on 2x H200:
#   tests         GPU-marked pytest tests (incl. every benchmark at a small size)  ~2-3 min
#                 (1 GPU: the 2-GPU tests skip; the rest ~1.5 min); not the emulation ones
#   emulation     multi-node paths on GPU 0 (docs/design/2026-12-02-emulation.md)          < 5 min
#                 1. `-m "gpu and emulation and not one_node"` on the bundled NCCL: emulated
#                    nodes (NCCL_HOSTID) parity vs FSDP2, training losses, stopped node
#                 2. `-m "gpu and emulation and one_node"` (ranks of ONE NCCL node sharing the
#                    GPU, the one-sided transport) with .nccl/'s NCCL (>= 2.30) swapped in for
#                    them (scripts/gpu/nccl_swap.sh; restored after); skipped without .nccl/
#   preflight     run_train.sh --preflight in the emulation (tests/test_preflight_gpu.py)  ~2-3 min
#                 1. `-m "gpu and preflight and not one_node"`, bundled NCCL: 2 emulated nodes over
#                    sockets; every check passes, one-sided reported unavailable with its reason
#                 2. `-m "gpu and preflight and one_node"` with .nccl/'s NCCL swapped in: 2 ranks
#                    as ONE NCCL node, the one-sided stress check on the copy-engine path
#                 the tables land in $LOGS/preflight_*.log (and in summary.md)
#   cross_node    bench_cross_node: NCCL kernels, SM-ms and wire bytes of TIDE's cross-node
#                 path (p2p, one-sided; fp32 and bf16 RS wire) vs fsdp2, two emulated nodes
#                 on GPU 0 that NCCL sees as one node (.nccl/'s NCCL swapped in)     ~1.5 min
#   nxl           not in the default list: N nodes x L ranks on GPU 0 as ONE NCCL node, TIDE
#                 on NCCL windows (docs/design/2026-12-04-windows.md), .nccl/'s NCCL swapped in:
#                 NXL_PARTS="tests" runs `-m "gpu and nxl"` (2x2, 3x2, 2x4, 4x2 parity with
#                 Llama and Qwen3 MoE, HSDP, EP; 20-step losses; a stopped rank) ~8 min;
#                 NXL_PARTS="bench" bench_cross_node --layout per NXL_LAYOUTS (2x2 2x4; each with
#                 --in-place-compare --storage-swap ctypes by default: torch 2.11 lacks the
#                 native storage swap TIDE-AG in place needs) and
#                 rs_wire_error --device cuda (each bench variant killed after NXL_VARIANT_S,
#                 default 120 s; the next one runs)                                ~4 min
#   floor         bench_floor per config in FLOOR_CONFIGS, on GPU 0 only (1 GPU is enough):
#                 the compute floor the step rows' gap_to_floor_pct refers to
#                 ~40 s llama, ~30 s qwen3, ~2 min wan22 (7.5 s per fwd+bwd)
#   trace         bench_trace per config in TRACE_CONFIGS (default FLOOR_CONFIGS), on GPU 0:
#                 per-FSDP-group fwd/bwd ms of the FLOOR_WORLD-rank step's per-GPU work on
#                 one GPU (the simulator's --trace input; compact JSON, no chrome trace)   ~40 s llama, ~30 s qwen3, ~1.5 min wan22
#   world1        not in the default list: what the one-GPU trainer runs, on GPU 0 (the
#                 simulator's world-1 rows and trainer-time input): bench_trace --precision
#                 world1 per WORLD1_TRACE_CONFIGS (llama, qwen3: ~40 s each), then a profiled
#                 world-1 fsdp2 bench_step per WORLD1_STEP_CONFIGS (wan22: ~2 min), and a
#                 profiled FSDP2-at-world-1 step per WORLD1_FSDP_STEP_CONFIGS (one rank's work)
#   train         debug model, every comm mode, 1 round (bench_step)               ~1.5 min
#   step          bench_step per config in STEP_CONFIGS, all modes                 ~2.5 min/config
#   bench         bench_ag (TIDE-AG vs stock, copy-engine batch)                   ~1 min
#   collectives   bench_collectives (3 layers x fsdp2/symm_mem/tide/tide_ag)       ~2 min
#   interference  bench_interference (2 GEMMs beside AG/RS x 3 modes)              ~1 min
#   interference_one_gpu  not in the default list: bench_interference --one-gpu on GPU 0 (the
#                 simulator's interference per engine and compute class: GEMMs, the grouped
#                 expert GEMM, attention beside a copy-engine copy, a copy kernel on NCCL's
#                 24 / 9 CTAs, FSDP2's cast, TIDE-RS's accumulate, a local HBM copy forced
#                 onto the copy engine alone and batched (local_copy_ce, local_batch_ce;
#                 need cuda-bindings); INTERF1_REPS, 5)                     ~2-3 min
#   accumulate    bench_accumulate (TIDE-RS kernel GiB/s vs CTA count, 1 GPU)       ~20 s
#   report        report.py over bench/results                                     seconds
# Knobs: FLOOR_CONFIGS (the three h200x2_* configs), TRACE_CONFIGS, TRACE_ARGS, FLOOR_WORLD (2: ranks of the step whose
# per-GPU work is measured), FLOOR_ARGS (more bench_floor arguments, e.g. "--warmup 1"), STEPS (train, 30), STEP_CONFIGS (h200x2_llama70b_4layers),
# STEP_STEPS (12), STEP_ROUNDS (1), STEP_MODES / MODES (fsdp2,symm_mem,tide), COLL_ITERS (20), INTERF_REPS (6),
# GPU_TESTS (tests: the paths the tests stage gives pytest), WORLD1_TRACE_CONFIGS, WORLD1_TRACE_ARGS (e.g. "--kernels 25"), WORLD1_STEP_CONFIGS,
# WORLD1_FSDP_STEP_CONFIGS (none: bench_step --fsdp-at-world-size-1 per config, ~1 min llama,
# ~3 min wan22), WORLD1_ITERS (3), WORLD1_STEPS (8), WORLD1_WARMUP (4),
# EMULATION_PARTS / PREFLIGHT_PARTS ("nodes one_node": the halves of those stages to run),
# NXL_TESTS / NXL_LAYOUTS / NXL_BENCH_ARGS (see nxl), NXL_WIRE_ERROR (1: rs_wire_error after
# the nxl bench; 0 skips it).
# $LOGS/clocks.csv: nvidia-smi's SM clock, power, throttle reasons, utilization and
# temperature at 1 s (summary line).
# Results (JSON/MD/PNG) land in bench/results/; $OUT gets results.tgz (this run's result
# files), the report (.md/.png), summary.md and logs.tgz (every log), i.e. few files.
# Needs the wheels from scripts/gpu/fetch_wheels.sh in .whl/ (carry ".whl"); the emulation
# stage's one-node half needs NCCL >= 2.30 in .nccl/ (carry ".nccl").
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/tide_check}"
LOGS=/tmp/tide_logs
mkdir -p "$OUT" "$LOGS" bench/results
STAGES="${STAGES:-tests emulation preflight cross_node floor trace train step bench accumulate collectives interference report}"
FLOOR_CONFIGS="${FLOOR_CONFIGS:-h200x2_llama70b_4layers h200x2_qwen3_30b_a3b_4layers h200x2_wan22_a14b_20layers}"
MODES="${MODES:-fsdp2,symm_mem,tide}"
MARK="$LOGS/.start"
touch "$MARK"

if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 scripts/gpu/probe.py > "$LOGS/probe.json" 2>&1
# The commit the result files are named with: TIDE_COMMIT, else git's answer ("-dirty" when a
# tracked file differs: on the GPU machine's copy of the tree git may answer for a stale .git).
commit_line="results named with commit $(python3 -c 'import sys; sys.path.insert(0, "scripts/bench"); import common; print(common.git_commit())' 2>/dev/null || echo unknown)"
[[ -n "${TIDE_COMMIT:-}" ]] || commit_line+=" (TIDE_COMMIT unset: pass TIDE_COMMIT=\$(git rev-parse --short HEAD))"
# SM clock, power and throttle reasons of every GPU once a second for the whole call
# (read-only queries; the compute figures of one call are only comparable at like clocks).
clock_sampler=""
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,clocks_throttle_reasons.active,utilization.gpu,temperature.gpu \
    --format=csv,noheader -l 1 > "$LOGS/clocks.csv" 2>/dev/null &
  clock_sampler=$!
fi

status=0
declare -a table
note() { table+=("$1"); echo "$1"; }
note "$commit_line"
has() { [[ " $STAGES " == *" $1 "* ]]; }
# part STAGE_PARTS NAME: is half NAME of a two-half stage asked for (default: both halves)?
part() { [[ " ${!1:-nodes one_node} " == *" $2 "* ]]; }
# run NAME TIMEOUT_S CMD...: log to $LOGS/NAME.log, note the exit code and wall time
run() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  status=$(( status | rc ))
  note "$name: exit $rc$([[ $rc == 124 ]] && echo ' (timed out)'), $(( SECONDS - t0 )) s"
  save_so_far
}
# $OUT/partial.tgz: the result files and logs so far, so a call stopped by its time limit
# still returns what its finished stages measured (replaced by results.tgz at the end).
save_so_far() {
  find bench/results -maxdepth 1 -type f -newer "$MARK" -printf 'bench/results/%f\n' > "$LOGS/.so_far"
  tar czf "$OUT/partial.tgz" -T "$LOGS/.so_far" -C "$LOGS" --exclude=.so_far . 2>/dev/null
}

if has tests; then
  # shellcheck disable=SC2086  # GPU_TESTS: test paths, split on spaces
  run gpu_tests 600 python3 -m pytest -q -m "gpu and not emulation" ${GPU_TESTS:-tests} -p no:cacheprovider
  note "  $(tail -1 "$LOGS/gpu_tests.log")"
fi

# NCCL's own version line and what the loaded library reports, on one line.
nccl_line() { grep -E 'NCCL version|^NCCL [0-9.]+ in use' "$1" | tail -2 | paste -sd '|' -; }
# bundled_nccl_back NAME: after a stage ran on .nccl/'s library (nccl_swap.sh), check that
# torch's bundled one is back, else stop: later stages (symm_mem under torch 2.11) must not
# run on the swapped library.
bundled_nccl_back() {
  run "$1" 60 python3 scripts/gpu/nccl_version.py
  note "  $(nccl_line "$LOGS/$1.log")"
  if [[ "$(nccl_line "$LOGS/$1.log")" != "$(nccl_line "$LOGS/nccl_bundled.log")" ]]; then
    note "$1: the bundled NCCL is NOT back (see nccl_swap.sh's log); stopping"
    printf '%s\n' "${table[@]}"
    exit 1
  fi
}

if has emulation; then
  run nccl_bundled 60 python3 scripts/gpu/nccl_version.py
  note "  $(nccl_line "$LOGS/nccl_bundled.log")"
  if part EMULATION_PARTS nodes; then
    run emulation_nodes 300 python3 -m pytest -q \
      -m "gpu and emulation and not one_node and not preflight and not nxl" tests -p no:cacheprovider
    note "  $(tail -1 "$LOGS/emulation_nodes.log")"
  fi
  if ! part EMULATION_PARTS one_node; then
    :
  elif [[ -d .nccl ]]; then
    # The newer NCCL only for this sub-stage: torch 2.11's symm_mem mode needs the bundled one.
    run emulation_one_node 240 bash scripts/gpu/nccl_swap.sh .nccl -- bash -c \
      'python3 scripts/gpu/nccl_version.py && python3 -m pytest -q -m "gpu and emulation and one_node and not preflight and not nxl" tests -p no:cacheprovider'
    note "  $(nccl_line "$LOGS/emulation_one_node.log")"
    note "  $(grep -E '(passed|failed|skipped|error)' "$LOGS/emulation_one_node.log" | tail -1)"
    bundled_nccl_back nccl_restored
  else
    note "emulation_one_node: skipped (no .nccl/ with NCCL >= 2.30: carry it, docs/design/2026-12-02-emulation.md)"
  fi
fi

if has preflight; then
  [[ -f "$LOGS/nccl_bundled.log" ]] || run nccl_bundled 60 python3 scripts/gpu/nccl_version.py
  if part PREFLIGHT_PARTS nodes; then
    run preflight_nodes "${PREFLIGHT_S:-240}" python3 -m pytest -q -rA -m "gpu and preflight and not one_node" \
      tests/test_preflight_gpu.py -p no:cacheprovider
    note "  $(tail -1 "$LOGS/preflight_nodes.log")"
  fi
  if ! part PREFLIGHT_PARTS one_node; then
    :
  elif [[ -d .nccl ]]; then
    run preflight_one_node "${PREFLIGHT_S:-240}" bash scripts/gpu/nccl_swap.sh .nccl -- bash -c \
      'python3 scripts/gpu/nccl_version.py && python3 -m pytest -q -rA -m "gpu and preflight and one_node" tests/test_preflight_gpu.py -p no:cacheprovider'
    note "  $(nccl_line "$LOGS/preflight_one_node.log")"
    note "  $(grep -E '(passed|failed|skipped|error)' "$LOGS/preflight_one_node.log" | tail -1)"
    bundled_nccl_back nccl_restored_preflight
  else
    note "preflight_one_node: skipped (no .nccl/ with NCCL >= 2.30: carry it)"
  fi
fi

if has cross_node; then
  if [[ -d .nccl ]]; then
    [[ -f "$LOGS/nccl_bundled.log" ]] || run nccl_bundled 60 python3 scripts/gpu/nccl_version.py
    run bench_cross_node 300 bash scripts/gpu/nccl_swap.sh .nccl -- \
      python3 scripts/bench/bench_cross_node.py --emulation one_node --out-dir bench/results
    note "  $(grep -o 'results: .*' "$LOGS/bench_cross_node.log" | tail -1)"
    bundled_nccl_back nccl_restored_cross
  else
    note "cross_node: skipped (no .nccl/ with NCCL >= 2.30: carry it)"
  fi
fi

if has nxl; then
  if [[ -d .nccl ]]; then
    [[ -f "$LOGS/nccl_bundled.log" ]] || run nccl_bundled 60 python3 scripts/gpu/nccl_version.py
    parts="${NXL_PARTS:-tests bench}"
    if [[ " $parts " == *" tests "* ]]; then
      # -x: the first failure ends the stage (device time is scarce); fastest checks first.
      run nxl_tests "${NXL_TESTS_S:-560}" bash scripts/gpu/nccl_swap.sh .nccl -- bash -c \
        'python3 scripts/gpu/nccl_version.py && python3 -m pytest -q -x -s -m "gpu and nxl" \
         ${NXL_TESTS:-tests/comm/test_windows_gpu.py tests/test_emulation_train.py} -p no:cacheprovider'
      note "  $(nccl_line "$LOGS/nxl_tests.log")"
      note "  $(grep -E '(passed|failed|skipped|error)' "$LOGS/nxl_tests.log" | tail -1)"
      while read -r line; do note "  $line"; done < <(grep -E \
        'match stock FSDP2|largest relative loss difference|job ended' "$LOGS/nxl_tests.log" \
        | sed 's/^\[rank [0-9]*\] //' | sort -u | head -20)
    fi
    if [[ " $parts " == *" bench "* ]]; then
      run nxl_bench "${NXL_BENCH_S:-420}" bash scripts/gpu/nccl_swap.sh .nccl -- bash -c \
        'rc=0
         for layout in ${NXL_LAYOUTS:-2x2 2x4}; do
           python3 scripts/bench/bench_cross_node.py --layout "$layout" --out-dir bench/results \
             --variant-timeout "${NXL_VARIANT_S:-120}" \
             ${NXL_BENCH_ARGS:---wires float32 --warmup 1 --steps 2 --in-place-compare --storage-swap ctypes} || rc=1
         done
         if [[ "${NXL_WIRE_ERROR:-1}" == 1 ]]; then
           python3 scripts/bench/rs_wire_error.py --device cuda --trials 1 \
             --out-dir bench/results ${NXL_WIRE_ARGS:-} || rc=1
         fi
         exit $rc'
      while read -r line; do note "  $line"; done < <(grep -o 'results: .*' "$LOGS/nxl_bench.log")
    fi
    bundled_nccl_back nccl_restored_nxl
  else
    note "nxl: skipped (no .nccl/ with NCCL >= 2.30: carry it, docs/design/2026-12-04-windows.md)"
  fi
fi

if has floor; then
  first_gpu="${CUDA_VISIBLE_DEVICES:-0}"
  for config in $FLOOR_CONFIGS; do
    run "floor_$config" 480 env CUDA_VISIBLE_DEVICES="${first_gpu%%,*}" \
      python3 scripts/bench/bench_floor.py --config "$config" --world-size "${FLOOR_WORLD:-2}" \
      --out-dir bench/results ${FLOOR_ARGS:-}
    note "  $(grep -o 'floor_ms = [0-9.]* ms[^;]*' "$LOGS/floor_$config.log" | tail -1)"
  done
fi

if has trace; then
  first_gpu="${CUDA_VISIBLE_DEVICES:-0}"
  for config in ${TRACE_CONFIGS:-$FLOOR_CONFIGS}; do
    run "trace_$config" 480 env CUDA_VISIBLE_DEVICES="${first_gpu%%,*}" \
      python3 scripts/bench/bench_trace.py --config "$config" --world-size "${FLOOR_WORLD:-2}" \
      --out-dir bench/results ${TRACE_ARGS:-}
    note "  $(grep -o 'fwd+bwd [0-9.]* ms' "$LOGS/trace_$config.log" | tail -1)"
  done
fi

# What the one-GPU trainer runs (no FSDP: fp32 weights under autocast), for the simulator's
# world-1 rows and its per-step trainer-time input (docs/design/2026-12-02-simulator.md): layer
# traces at world 1, and a profiled world-1 fsdp2 step (breakdown) of each WORLD1_STEP_CONFIGS.
if has world1; then
  first_gpu="${CUDA_VISIBLE_DEVICES:-0}"
  for config in ${WORLD1_TRACE_CONFIGS:-h200x2_llama70b_4layers h200x2_qwen3_30b_a3b_4layers}; do
    run "trace_world1_$config" 300 env CUDA_VISIBLE_DEVICES="${first_gpu%%,*}" \
      python3 scripts/bench/bench_trace.py --config "$config" --world-size 1 --precision world1 \
      --iters "${WORLD1_ITERS:-3}" --out-dir bench/results ${WORLD1_TRACE_ARGS:-}
    note "  $(grep -o 'fwd+bwd [0-9.]* ms' "$LOGS/trace_world1_$config.log" | tail -1)"
  done
  for config in ${WORLD1_STEP_CONFIGS:-h200x2_wan22_a14b_20layers}; do
    run "step_world1_$config" 480 env CUDA_VISIBLE_DEVICES="${first_gpu%%,*}" \
      python3 scripts/bench/bench_step.py --config "$config" --modes fsdp2 --rounds 1 \
      --steps "${WORLD1_STEPS:-8}" --warmup "${WORLD1_WARMUP:-4}" --out-dir bench/results \
      --log-dir "$LOGS"
  done
  # One rank's work of the 2-GPU step on one GPU: FSDP2 over a one-rank mesh (bf16
  # weights, FSDP2's hooks and copies; torchtitan_tide/world1_fsdp.py), profiled.
  for config in ${WORLD1_FSDP_STEP_CONFIGS:-}; do
    run "step_world1_fsdp_$config" 480 env CUDA_VISIBLE_DEVICES="${first_gpu%%,*}" \
      python3 scripts/bench/bench_step.py --config "$config" --modes fsdp2 --rounds 1 \
      --steps "${WORLD1_STEPS:-8}" --warmup "${WORLD1_WARMUP:-4}" --out-dir bench/results \
      --log-dir "$LOGS" --fsdp-at-world-size-1
  done
fi

if has train; then
  run train_debug_model 400 python3 scripts/bench/bench_step.py --config debug_model \
    --steps "${STEPS:-30}" --rounds 1 --modes "$MODES" --out-dir "$LOGS/debug_model" \
    --log-dir "$LOGS"
fi

if has step; then
  for config in ${STEP_CONFIGS:-h200x2_llama70b_4layers}; do
    run "step_$config" 600 python3 scripts/bench/bench_step.py --config "$config" \
      --steps "${STEP_STEPS:-12}" --rounds "${STEP_ROUNDS:-1}" --modes "${STEP_MODES:-$MODES}" \
      --out-dir bench/results --log-dir "$LOGS"
  done
fi

if has bench; then
  run bench_ag 300 python3 scripts/bench/bench_ag.py --out-dir bench/results
fi

if has accumulate; then
  run bench_accumulate 120 python3 scripts/bench/bench_accumulate.py --out-dir bench/results
fi

if has collectives; then
  run bench_collectives 300 python3 scripts/bench/bench_collectives.py --out-dir bench/results \
    --modes "${COLL_MODES:-$MODES,tide_ag}" \
    --iters "${COLL_ITERS:-20}"
fi

if has interference; then
  run bench_interference 240 python3 scripts/bench/bench_interference.py \
    --out-dir bench/results --modes "$MODES" --reps "${INTERF_REPS:-6}"
fi

if has interference_one_gpu; then
  first_gpu="${CUDA_VISIBLE_DEVICES:-0}"
  run bench_interference_one_gpu "${INTERF1_S:-300}" env CUDA_VISIBLE_DEVICES="${first_gpu%%,*}" \
    python3 scripts/bench/bench_interference.py --one-gpu --out-dir bench/results \
    --reps "${INTERF1_REPS:-5}"
  note "  $(grep -o 'results: .*' "$LOGS/bench_interference_one_gpu.log" | tail -1)"
fi

if has report; then
  run report 120 python3 scripts/bench/report.py --results-dir bench/results
fi

[[ -n "$clock_sampler" ]] && kill "$clock_sampler" 2>/dev/null
if [[ -s "$LOGS/clocks.csv" ]]; then
  note "clocks (busy samples, util >= 50%): $(python3 scripts/gpu/clocks.py "$LOGS/clocks.csv")"
fi

# This run's result files in one archive; the report and logs beside it (few files in $OUT).
find bench/results -maxdepth 1 -type f -newer "$MARK" -printf '%f\n' > "$LOGS/results.txt"
tar czf "$OUT/results.tgz" -C bench/results -T "$LOGS/results.txt" 2>/dev/null
report_md=$(find bench/results -maxdepth 1 -name '*_report.md' -newer "$MARK" | sort | tail -1)
if [[ -n "$report_md" ]]; then
  cp "$report_md" "${report_md%.md}.png" "$OUT/" 2>/dev/null
fi

{
  for md in $(find bench/results "$LOGS/debug_model" -maxdepth 1 -name '*.md' \
      ! -name '*_report.md' -newer "$MARK" 2>/dev/null | sort); do
    echo "### $(basename "$md")"; grep '^| ' "$md" | head -14; echo
  done
  for log in "$LOGS"/preflight_nodes.log "$LOGS"/preflight_one_node.log; do
    [[ -f "$log" ]] && sed -n '/^=== preflight/,/^=== end ===/p' "$log" | head -60
  done
  echo "## Summary"
  printf '%s\n' "${table[@]}"
  if [[ -n "$report_md" ]]; then
    echo; echo "### Headline, mode / fsdp2 ($(basename "$report_md"))"
    sed -n '/^## Headline/,/^## /p' "$report_md" | grep '^| '
  fi
} > "$LOGS/summary.md"
cp "$LOGS/summary.md" "$OUT/summary.md"
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
rm -f "$OUT/partial.tgz"
echo
cat "$LOGS/summary.md"
exit $status
