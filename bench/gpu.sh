#!/usr/bin/env bash
# Everything a lent GPU machine is for, in one call (the device tool's `run`, timeout_s 590):
# build the CUDA extension against the machine's own torch, run the suite on CUDA, then
# `python -m bench --device cuda`, which writes its tables into bench/RESULTS.md. What comes
# back (at most 8 files under $OUT): gpu.txt, build.log, tests.log, checks.log (the wgrad GEMM
# against cuBLAS and routed layers against the fold, deepspeed's install, the seed script at
# every length, one long-context step with the block inputs on the host, and with every block
# sliced, against the inputs on the device),
# bench.log, RESULTS.md, report.md, results.json. Commit the returned RESULTS.md.
#
# On a machine with two GPUs the bench's distributed suite runs too (NCCL, 2 ranks: FSDP2, the DDP
# Trainer row and the DeepSpeed ZeRO-2 Trainer row); for the last, deepspeed is installed first
# next to the machine's own torch (pinned, so pip cannot swap it). On one GPU both are skipped.
#
#   run(command="bash bench/gpu.sh", timeout_s=590)
#
# Each step has its own time limit so that a hang in one still leaves the others' output; on one
# GPU the limits add up to 580 s (build 150, tests 170, wgrad 45, bench 110, lengths 55, host 50).
#
# The frontier suite's compiled case (torch.compile on both sides: compile's budgets against
# gradaccel's plans run by compile, issue 39) has cold inductor compiles, seven of them: it is a
# call of its own, after the one above on the same warm machine (the build is kept), or alone on
# a fresh one (it builds first; limits 150 + 420 s). Back: frontier_compiled.log, frontier.json,
# frontier_compiled.png.
#
#   run(command="bash bench/gpu.sh compiled", timeout_s=590)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/gradaccel-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ "${1:-}" = "compiled" ]; then
  if ! "$PY" -c "from gradaccel.ops import extension as e; e.load()" > /dev/null 2>&1; then
    echo "== build"
    timeout 150 make PYTHON="$PY" install > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  fi
  echo "== frontier, compiled case (inductor on both sides)"
  GRADACCEL_FRONTIER=compiled timeout 420 "$PY" -m bench --device cuda --suite frontier --quick \
    --out /tmp/gradaccel-frontier > "$OUT/frontier_compiled.log" 2>&1
  echo "frontier exit $?"
  tail -40 "$OUT/frontier_compiled.log"
  cp /tmp/gradaccel-frontier/results.json "$OUT/frontier.json" 2>/dev/null
  cp /tmp/gradaccel-frontier/frontier_compiled.png "$OUT/" 2>/dev/null
  exit 0
fi

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
timeout 170 "$PY" -m pytest -q -p no:cacheprovider tests > "$OUT/tests.log" 2>&1
echo "tests exit $?"
tail -15 "$OUT/tests.log"

echo "== wgrad GEMM (Triton, accumulate epilogue) vs cuBLAS; routed layers vs the fold"
timeout 45 "$PY" -m bench.wgrad_gpu > "$OUT/checks.log" 2>&1
echo "wgrad exit $?"
tail -20 "$OUT/checks.log"
echo "== two GPUs: deepspeed for the distributed suite's DeepSpeed ZeRO-2 row"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
if [ "${NGPU:-0}" -ge 2 ]; then
  if ! "$PY" -c "import deepspeed" > /dev/null 2>&1; then
    TORCH_PIN=$("$PY" -c "import torch; print(torch.__version__)")
    echo "torch==$TORCH_PIN" > /tmp/gradaccel-torch-pin.txt
    timeout 120 "$PY" -m pip install -q "deepspeed==0.19.8" -c /tmp/gradaccel-torch-pin.txt >> "$OUT/checks.log" 2>&1 \
      || echo "deepspeed could not be installed (offline?): the DeepSpeed row is skipped; see checks.log"
  fi
  "$PY" -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'torch', torch.__version__)" \
    >> "$OUT/checks.log" 2>&1
  tail -2 "$OUT/checks.log"
else
  echo "$NGPU GPU(s): the distributed suite (and its DeepSpeed row) needs 2 and is skipped"
fi

echo "== bench"
# Not the frontier suite: its cold inductor compiles (one per budget) would take the step's time.
timeout 110 "$PY" -m bench --device cuda --suite accumulate,checkpoint,train,finetune,distributed,fit \
  --out /tmp/gradaccel-bench --results-md bench/RESULTS.md > "$OUT/bench.log" 2>&1
echo "bench exit $?"
tail -60 "$OUT/bench.log"

echo "== the seed script at every length (QLoRA SFTTrainer, flash_attention_2 where flash-attn is installed)"
timeout 55 "$PY" bench/lengths_qlora.py --device cuda --micro 16 --accum 4 >> "$OUT/checks.log" 2>&1
echo "lengths_qlora exit $?"
tail -4 "$OUT/checks.log"
echo "== long context: block inputs on the device, on the host, and sliced blocks (Llama-3.2-1B shape, 32K tokens, one step each)"
timeout 50 "$PY" bench/host_inputs_gpu.py --seq 32768 >> "$OUT/checks.log" 2>&1
echo "host_inputs exit $?"
tail -4 "$OUT/checks.log"
cp bench/RESULTS.md "$OUT/" 2>/dev/null
cp /tmp/gradaccel-bench/report.md /tmp/gradaccel-bench/results.json "$OUT/" 2>/dev/null
exit 0
