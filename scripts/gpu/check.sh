#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, the debug model per comm mode, the step and
# all-gather benchmarks, then a short table. Results (JSON/MD/PNG) land in bench/results/
# and are copied to $OUT; every log is packed into $OUT/logs.tgz.
#   TIDE_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu/check.sh
#   STAGES="tests train" bash scripts/gpu/check.sh
# Needs the wheels from scripts/gpu/fetch_wheels.sh in .whl/ (carry ".whl").
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/tide_check}"
LOGS=/tmp/tide_logs
mkdir -p "$OUT" "$LOGS" bench/results
STAGES="${STAGES:-tests train step bench}"

if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 scripts/gpu/probe.py > "$LOGS/probe.json" 2>&1

status=0
declare -a table
note() { table+=("$1"); echo "$1"; }

if [[ " $STAGES " == *" tests "* ]]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider > "$LOGS/gpu_tests.log" 2>&1
  rc=$?; status=$(( status | rc ))
  note "gpu tests: exit $rc, $(tail -1 "$LOGS/gpu_tests.log")"
fi

if [[ " $STAGES " == *" train "* ]]; then
  python3 scripts/bench/bench_step.py --config debug_model --steps "${STEPS:-30}" --rounds 1 \
    --out-dir "$LOGS/debug_model" --log-dir "$LOGS" > "$LOGS/train_debug_model.log" 2>&1
  rc=$?; status=$(( status | rc ))
  note "debug model fsdp2 vs tide: exit $rc"
  grep '^| ' "$LOGS/train_debug_model.log" | tee -a "$LOGS/summary_tables.md"
fi

if [[ " $STAGES " == *" step "* ]]; then
  python3 scripts/bench/bench_step.py --config h200x2_llama70b_4layers --steps "${STEP_STEPS:-15}" \
    --rounds 2 --out-dir bench/results --log-dir "$LOGS" > "$LOGS/bench_step.log" 2>&1
  rc=$?; status=$(( status | rc ))
  note "step benchmark (70B width, 4 layers): exit $rc"
fi

if [[ " $STAGES " == *" bench "* ]]; then
  timeout 300 python3 scripts/bench/bench_ag.py --out-dir bench/results > "$LOGS/bench_ag.log" 2>&1
  rc=$?; status=$(( status | rc ))
  note "all-gather benchmark: exit $rc"
fi

cp bench/results/*"$(date +%Y-%m-%d)"* "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
echo
echo "## Summary"
printf '%s\n' "${table[@]}"
for md in bench/results/*"$(date +%Y-%m-%d)"*.md; do
  [[ -e "$md" ]] || continue
  echo; echo "### $(basename "$md")"; grep '^| ' "$md" | head -12
done
exit $status
