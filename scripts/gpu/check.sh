#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, debug-model training per comm mode, benchmarks,
# then a short table. Full logs go to $OUT (the device tool returns them).
#   bash scripts/gpu/check.sh                # everything
#   STAGES="tests train" bash scripts/gpu/check.sh
# Needs the wheels from scripts/gpu/fetch_wheels.sh in .whl/ (carry ".whl").
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-/tmp/tide_check}"
mkdir -p "$OUT"
STAGES="${STAGES:-tests train bench}"
STEPS="${STEPS:-30}"

if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
PY

status=0
if [[ " $STAGES " == *" tests "* ]]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
  status=$(( status | ${PIPESTATUS[0]} ))
fi

if [[ " $STAGES " == *" train "* ]]; then
  for mode in ${MODES:-fsdp2 tide}; do
    LOG_RANK=0 ./run_train.sh --config debug_model --training.steps "$STEPS" --tide.comm "$mode" \
      --job.dump_folder "/tmp/tide_train_$mode" > "$OUT/train_$mode.log" 2>&1
    rc=$?
    echo "train $mode: exit $rc"
    status=$(( status | rc ))
    cp "/tmp/tide_train_$mode/metrics.jsonl" "$OUT/train_${mode}_metrics.jsonl" 2>/dev/null
  done
fi

if [[ " $STAGES " == *" bench "* ]]; then
  for bench in scripts/bench/bench_*.py; do
    [[ -e "$bench" ]] || continue
    name=$(basename "$bench" .py)
    timeout 300 python3 "$bench" --out-dir bench/results > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc"
    status=$(( status | rc ))
  done
  cp bench/results/*"$(date +%Y-%m-%d)"* "$OUT/" 2>/dev/null
fi

python3 scripts/gpu/summarize.py "$OUT" | tee "$OUT/summary.md"
exit $status
