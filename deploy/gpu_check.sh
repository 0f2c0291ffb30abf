#!/usr/bin/env bash
# GPU checks for a CUDA machine, in a few minutes: the CUDA tests, the varlen contract test, then
# the worker step benchmark (torch reference vs flash-attn varlen attention).
#
#   deploy/gpu_check.sh [OUT_DIR] [MODEL_DIR]
#
# OUT_DIR (default gpu-check/) receives pytest.txt and bench_step.json. MODEL_DIR is optional: an
# HF model directory to benchmark instead of a random model of SmolLM2-135M's shape. With MODEL_DIR
# it also serves the model and replays a short trace with `conveyor bench` (serve_bench.json).
# PYTHON picks the interpreter (default: python). Copy the figures into docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${1:-gpu-check}
MODEL=${2:-}
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
"$PYTHON" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null \
  | tee -a "$OUT/gpu.txt" || echo "flash-attn not installed: only the torch reference runs" | tee -a "$OUT/gpu.txt"

echo "== CUDA tests"
set +e  # a failing test must not hide the benchmark; the exit code reports it at the end
"$PYTHON" -m pytest -q -rs tests/gpu tests/worker_proc/test_worker_attention_varlen.py 2>&1 \
  | tee "$OUT/pytest.txt"
TESTS=${PIPESTATUS[0]}
set -e

echo "== worker step benchmark"
"$PYTHON" -m worker_proc.tools.bench_step --batch-sizes 1,16,64,256 --context 1024 --steps 30 \
  ${MODEL:+--model "$MODEL"} --out "$OUT/bench_step.json"

if [ -n "$MODEL" ]; then
  echo "== served benchmark"
  PORT=${PORT:-8011}
  "$PYTHON" -m deploy.cli serve "$MODEL" --port "$PORT" --log-level warning &
  SERVER=$!
  trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 1 180); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 1
  done
  "$PYTHON" -m deploy.cli bench --port "$PORT" --num-prompts 128 --request-rate 16 \
    --result-dir "$OUT" --label serve_bench
fi
echo "results in $OUT/ (tests exit code $TESTS)"
exit "$TESTS"
