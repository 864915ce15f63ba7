#!/usr/bin/env bash
# Everything a lent GPU machine is for, in one call (the device tool's `run`, timeout_s 540):
# build the CUDA extension against the machine's own torch, run the suite on CUDA, then
# `python -m bench --device cuda`, which writes its tables into bench/RESULTS.md. What comes
# back (at most 8 files under $OUT): gpu.txt, build.log, tests.log, wgrad_gpu.txt, bench.log,
# RESULTS.md, report.md, results.json. Commit the returned RESULTS.md.
#
#   run(command="bash bench/gpu.sh", timeout_s=590)
#
# Each step has its own time limit so that a hang in one still leaves the others' output.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/gradaccel-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$PY" -c \
  "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

echo "== build"
if ! timeout 150 make PYTHON="$PY" install > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
"$PY" -c "import torch; from gradaccel.ops import extension as _ext
print('extension built with CUDA:', _ext.load().with_cuda, '| GPU visible:', torch.cuda.is_available())"

echo "== tests (CUDA where a test has a device parameter)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests > "$OUT/tests.log" 2>&1
echo "tests exit $?"
tail -15 "$OUT/tests.log"

echo "== wgrad GEMM (Triton, accumulate epilogue) vs cuBLAS"
timeout 45 "$PY" -m bench.wgrad_gpu > "$OUT/wgrad_gpu.txt" 2>&1
echo "wgrad exit $?"
cat "$OUT/wgrad_gpu.txt"

echo "== bench"
# Not the frontier suite: its cold inductor compiles (one per budget) would take the step's time.
timeout 150 "$PY" -m bench --device cuda --suite accumulate,checkpoint,train,finetune,distributed,fit \
  --out /tmp/gradaccel-bench --results-md bench/RESULTS.md > "$OUT/bench.log" 2>&1
echo "bench exit $?"
tail -60 "$OUT/bench.log"

echo "== the seed script at every length (QLoRA SFTTrainer, flash_attention_2 where flash-attn is installed)"
timeout 120 "$PY" bench/lengths_qlora.py --device cuda --micro 32 --accum 8 > "$OUT/lengths_qlora.log" 2>&1
echo "lengths_qlora exit $?"
tail -4 "$OUT/lengths_qlora.log"
cp bench/RESULTS.md "$OUT/" 2>/dev/null
cp /tmp/gradaccel-bench/report.md /tmp/gradaccel-bench/results.json "$OUT/" 2>/dev/null
exit 0
