#!/usr/bin/env bash
# GPU checks for a CUDA machine, in a few minutes: the CUDA tests and the integration tests whose
# stacks then run their workers on the GPU, the worker step benchmark (torch reference vs flash-attn
# varlen attention), and with a model a served benchmark.
#
#   deploy/gpu_check.sh [OUT_DIR] [MODEL_DIR]
#
# OUT_DIR (default gpu-check/) receives pytest.txt, bench_step.json and, with MODEL_DIR, the served
# runs (server.log and one JSON per run). MODEL_DIR is optional: an HF model directory to benchmark
# instead of a random model of SmolLM2-135M's shape; it is then also served, its cold start to a
# 200 on /health timed, and the 256-request burst of docs/benchmarks.md (heavy-tailed, then uniform
# outputs) and a single stream replayed with `conveyor bench`. A MODEL_DIR holding only the config
# and tokenizer files is served from a copy with random weights: its shape's speed, noise for text.
# PYTHON picks the interpreter (default: python). Copy the figures into docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${1:-gpu-check}
MODEL=${2:-}
mkdir -p "$OUT"
SERVER="" RANDOM_MODEL=""
cleanup() {
  if [ -n "$SERVER" ]; then kill -TERM "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true; fi
  if [ -n "$RANDOM_MODEL" ]; then rm -rf "$RANDOM_MODEL"; fi
}
trap cleanup EXIT

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
"$PYTHON" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null \
  | tee -a "$OUT/gpu.txt" || echo "flash-attn not installed: only the torch reference runs" | tee -a "$OUT/gpu.txt"

echo "== CUDA tests, and integration tests with their workers on the GPU"
set +e  # a failing test must not hide the benchmark; the exit code reports it at the end
"$PYTHON" -m pytest -q -rfEs -m "not slow" tests/gpu tests/worker_proc/test_worker_attention_varlen.py \
  tests/integration/test_serving.py tests/integration/test_choices_and_logprobs.py \
  tests/integration/test_mixed_sampling.py tests/integration/test_structured_output_engine.py \
  2>&1 | tee "$OUT/pytest.txt"
TESTS=${PIPESTATUS[0]}
set -e

if [ -n "$MODEL" ] && ! ls "$MODEL"/*.safetensors "$MODEL"/*.bin >/dev/null 2>&1; then
  echo "== $MODEL has no weights: a copy with random ones stands in"
  RANDOM_MODEL=$(mktemp -d)
  cp -r "$MODEL"/. "$RANDOM_MODEL"
  "$PYTHON" -c "import sys, torch, transformers; torch.manual_seed(0); \
config = transformers.AutoConfig.from_pretrained(sys.argv[1]); \
transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(sys.argv[1])" \
    "$RANDOM_MODEL"
  MODEL=$RANDOM_MODEL
fi

echo "== worker step benchmark"
"$PYTHON" -m worker_proc.tools.bench_step --batch-sizes 1,16,64,256 --context 1024 --steps 30 \
  ${MODEL:+--model "$MODEL"} --out "$OUT/bench_step.json"

if [ -n "$MODEL" ]; then
  echo "== served benchmark"
  PORT=${PORT:-8011}
  STARTED=$("$PYTHON" -c "import time; print(time.time())")
  "$PYTHON" -m deploy.cli serve "$MODEL" --port "$PORT" > "$OUT/server.log" 2>&1 &
  SERVER=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    if ! kill -0 "$SERVER" 2>/dev/null; then
      echo "the server exited during start-up:"; tail -30 "$OUT/server.log"; exit 1
    fi
    sleep 0.2
  done
  "$PYTHON" -c "import sys, time; print(f'cold start to a 200 on /health: {time.time() - float(sys.argv[1]):.1f} s')" \
    "$STARTED" | tee -a "$OUT/gpu.txt"
  curl -s "http://127.0.0.1:$PORT/version" | tee -a "$OUT/gpu.txt"; echo
  for DIST in heavy uniform; do
    "$PYTHON" -m deploy.cli bench --port "$PORT" --num-prompts 256 --output-dist "$DIST" --seed 0 \
      --disable-tqdm --result-dir "$OUT" --save-result --result-filename "$DIST.json" --label "$DIST"
  done
  "$PYTHON" -m deploy.cli bench --port "$PORT" --num-prompts 1 --prompt-len-min 447 --prompt-len-max 447 \
    --output-dist uniform --output-median 123 --output-max 123 --seed 0 --disable-tqdm --result-dir "$OUT" \
    --save-result --result-filename single.json --label single
  nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/gpu.txt"
fi
echo "results in $OUT/ (tests exit code $TESTS)"
exit "$TESTS"
