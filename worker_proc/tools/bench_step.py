"""Worker step benchmark: prefill and decode step times of one rank, per attention backend.

    python -m worker_proc.tools.bench_step --out bench_step.json            # random SmolLM2-shaped model
    python -m worker_proc.tools.bench_step --model /path/to/hf-model --batch-sizes 1,32,128

Builds sequences of --context tokens (prefilled in chunks), then times --steps decode steps at
each batch size, for the torch reference attention and every fast path that runs here: on CUDA
with flash-attn installed the varlen kernel, on the CPU the native decode kernel, each built as a
worker started with that --attention-backend builds it. Without --model it saves a randomly
initialised model of SmolLM2-135M's shape (no download). Prints JSON; --out also writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from proto.config import EngineConfig
from worker_proc.attention import AttentionBackend, AttentionBackendError, attention_backend_for
from worker_proc.batch import synthetic_plan
from worker_proc.kv_cache import allocate_kv_cache
from worker_proc.model import Attention
from worker_proc.runner import ModelRunner

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     tie_word_embeddings=True)


def random_model(out_dir: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(**SMOLLM2_SHAPE)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(out_dir))
    return out_dir


# --attention-backend choice -> its name in the results
BACKEND_NAMES = {"torch": "torch_reference", "native": "native", "flash": "flash_varlen"}


def available_backends(device: torch.device, dtype: str, block_size: int) -> dict[str, AttentionBackend]:
    """The torch reference and every fast path that runs here, by name: native on the CPU, flash
    on CUDA, each skipped (with the reason on stderr) where the explicit choice would refuse to start."""
    backends: dict[str, AttentionBackend] = {}
    for choice in ("torch", "native" if device.type == "cpu" else "flash"):
        try:
            backend = attention_backend_for(device, getattr(torch, dtype), block_size, choice)
            backends[BACKEND_NAMES[choice]] = backend
        except AttentionBackendError as error:
            print(f"skipped: {error}", file=sys.stderr)
    return backends


def use_backend(runner: ModelRunner, backend: AttentionBackend) -> None:
    runner.attention = backend
    for module in runner.model.modules():
        if isinstance(module, Attention):
            module.backend = backend
    cache = runner.kv_cache
    if cache.layout is not backend.kv_layout:  # each backend reads the cache in its own layout
        runner.kv_cache = allocate_kv_cache(runner.model.config, cache.num_blocks,
                                            runner.config.block_size, cache.k_blocks[0].dtype,
                                            runner.config.tensor_parallel_size, runner.device,
                                            backend.kv_layout)
        runner.kv_views = runner.kv_cache.flat_views()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_batch(runner: ModelRunner, batch_size: int, context: int, steps: int,
               max_blocks: int) -> dict[str, float]:
    """Prefill batch_size prompts of `context` tokens (one step each), then time decode steps."""
    rng = np.random.default_rng(0)
    prefill_s = []
    for member in range(batch_size):  # one member per prefill step, at its own blocks
        plan = synthetic_plan(0, np.array([context]), np.array([context]),
                              rng.integers(10, 1000, context), max_blocks)
        plan = replace(plan, block_ids=plan.block_ids + member * max_blocks)
        synchronize(runner.device)
        started = time.perf_counter()
        runner.execute(plan)
        synchronize(runner.device)
        prefill_s.append(time.perf_counter() - started)
    decode_s = []
    for step in range(steps):
        contexts = np.full(batch_size, context + 1 + step)
        plan = synthetic_plan(step + 1, contexts, np.ones(batch_size, np.int64),
                              rng.integers(10, 1000, batch_size), max_blocks)
        synchronize(runner.device)
        started = time.perf_counter()
        runner.execute(plan)
        synchronize(runner.device)
        decode_s.append(time.perf_counter() - started)
    decode_ms = 1000 * float(np.median(decode_s[1:] if steps > 1 else decode_s))
    return {"batch_size": batch_size, "context": context,
            "prefill_ms_median": round(1000 * float(np.median(prefill_s)), 3),
            "decode_step_ms_median": round(decode_ms, 3),
            "decode_tokens_per_s": round(batch_size / decode_ms * 1000, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_proc.tools.bench_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory (default: random SmolLM2 shape)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=0,
                        help="torch threads (default 0: as a worker, one per core of its share)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_blocks = -(-(args.context + args.steps + 1) // args.block_size)
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as tmp:
        model = args.model or str(random_model(Path(tmp)))
        config = EngineConfig(model=model, dtype=args.dtype, block_size=args.block_size,
                              num_kv_blocks=max(batch_sizes) * max_blocks, runtime_dir=tmp,
                              num_threads=args.num_threads)
        runner = ModelRunner(config, rank=0, show_progress=False)
        backends = available_backends(runner.device, args.dtype, args.block_size)
        report = {"device": torch.cuda.get_device_name(0) if runner.device.type == "cuda" else "cpu",
                  "model": args.model or "random SmolLM2-135M shape", "dtype": args.dtype,
                  "block_size": args.block_size, "threads": torch.get_num_threads(),
                  "torch": torch.__version__, "results": {}}
        for name, backend in backends.items():
            use_backend(runner, backend)
            time_batch(runner, 1, args.context, 2, max_blocks)  # warm-up: kernels, allocator, caches
            report["results"][name] = [time_batch(runner, b, args.context, args.steps, max_blocks)
                                       for b in batch_sizes]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
