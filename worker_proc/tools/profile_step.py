"""Where a worker's step goes, against what this machine can do.

    python -m worker_proc.tools.profile_step --model ~/.cache/conveyor/models/SmolLM2-135M-Instruct \
        --dtype float32 --decode-batches 32,64,256 --prefill 2048 --out profile.json

First the machine's peak: GFLOP/s of the model's own matmul shapes (fp32 and bf16, as the worker
runs them: oneDNN-prepacked where oneDNN packs that dtype, the LM head through the skinny linear
where the worker has it, and every fp32 shape where that serves all rows; oneDNN's fp32 figures
beside them) and memory GB/s (reading a large tensor; a copy's read + write rate is
reported beside it). Then steps of the real ModelRunner (a prefill chunk, decode steps at each
batch size), every call timed into one category by exclusive wall time (tools.stopwatch): linears,
LM head, attention, norms, rope, activations (silu * up), embedding, layer glue (views, splits, the
Python between layers), plan building, sampler, runner glue, with the layers run one by one; where
the worker runs a step's layers in one native call (layers.native_decoder), that step's total as
served beside them (one_call_total_ms). Each compute category is set
against its floor at the measured peak (the larger of FLOPs / peak FLOP/s and bytes read / GB/s).
The scheduler's side of a step (schedule, codec, the IPC round trip, update) comes from
scheduler_proc.tools.bench_overhead at the same batch size, run as its own process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from proto.config import CPU_ISAS, DTYPES, KV_CACHE_DTYPE_CHOICES, EngineConfig
from proto.messages import StepPlan
from worker_proc import model as model_module
from worker_proc import runner as runner_module
from worker_proc.batch import synthetic_plan
from worker_proc.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_proc.layers.linear import LinearBase, cpu_prepack_supported, packed_linear, prepack
from worker_proc.layers.norm import RMSNorm
from worker_proc.layers.skinny import SkinnyLinear
from worker_proc.model import MLP, Attention, DecoderLayer
from worker_proc.model_config import ModelConfig, torch_dtype
from worker_proc.runner import ModelRunner
from worker_proc.tools.stopwatch import Stopwatch

COMPUTE = ("linears", "lm_head", "attention")


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each per-layer matmul and the LM head."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv": (config.hidden_size, q + 2 * kv), "o": (q, config.hidden_size),
            "gate_up": (config.hidden_size, 2 * config.intermediate_size),
            "down": (config.intermediate_size, config.hidden_size),
            "lm_head": (config.hidden_size, config.vocab_size)}


def best_seconds(fn: object, repeats: int) -> float:
    fn()  # warm-up: oneDNN picks and caches its kernel
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def matmul_gflops(shapes: dict[str, tuple[int, int]], dtype: torch.dtype, rows: int,
                  skinny: SkinnyLinear | None) -> dict[str, float]:
    """GFLOP/s of rows x in @ in x out per shape, the way the worker runs that dtype at `rows` rows
    (through `skinny`, the worker's kernel, when given and of this dtype: for the LM head, and for
    every shape where it serves all rows; pass None for oneDNN's figures)."""
    packed = cpu_prepack_supported(dtype)
    result = {}
    for name, (in_features, out_features) in shapes.items():
        x = torch.randn(rows, in_features).to(dtype)
        weight = torch.randn(out_features, in_features).to(dtype)
        if skinny is not None and skinny.dtype == dtype and (name == "lm_head" or skinny.all_rows):
            run = lambda w=skinny.pack(weight): w(x, None)  # noqa: E731
        elif packed:
            run = lambda w=prepack(weight): packed_linear(x, w, None)  # noqa: E731
        else:
            run = lambda: F.linear(x, weight)  # noqa: E731
        seconds = best_seconds(run, 5)
        result[name] = round(2 * rows * in_features * out_features / seconds / 1e9, 1)
    return result


def memory_gbps(megabytes: int = 512) -> dict[str, float]:
    """GB/s reading a large tensor (a sum: what weight streaming and K/V reads do, the floors' figure)
    and copying it (read + write bytes, for reference; lower on most machines)."""
    source = torch.ones(megabytes << 18)  # float32: 4 bytes each
    target = torch.empty_like(source)
    nbytes = source.numel() * 4
    read_s = best_seconds(lambda: source.sum(), 5)
    copy_s = best_seconds(lambda: target.copy_(source), 5)
    return {"read": round(nbytes / read_s / 1e9, 1), "copy": round(2 * nbytes / copy_s / 1e9, 1)}


def instrument(runner: ModelRunner, watch: Stopwatch) -> None:
    """Every call of the step timed into its category (instance attributes, module globals)."""
    categories = ((LinearBase, "linears"), (RMSNorm, "norms"), (MLP, "activations"),
                  (Attention, "layer glue"), (DecoderLayer, "layer glue"))
    for module in runner.model.modules():
        for kind, category in categories:
            if isinstance(module, kind):
                module.forward = watch.wrap(module.forward, category)
        if isinstance(module, RMSNorm):
            module.add_forward = watch.wrap(module.add_forward, "norms")
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            module.forward = watch.wrap(module.forward, "embedding")
    runner.attention.forward = watch.wrap(runner.attention.forward, "attention")
    runner.model.forward = watch.wrap(runner.model.forward, "layer glue")
    runner.model.lm_head.compute_logits = watch.wrap(runner.model.lm_head.compute_logits, "lm_head")
    runner.model.rotary.cos_sin = watch.wrap(runner.model.rotary.cos_sin, "rope")
    model_module.apply_rotary = watch.wrap(model_module.apply_rotary, "rope")
    fused = runner.model.model.norm.fused  # the one FusedCpuOps every layer shares, if any
    if fused is not None:
        fused.rotary_ = watch.wrap(fused.rotary_, "rope")
    runner_module.build_step_batch = watch.wrap(runner_module.build_step_batch, "plan building")
    runner_module.sample = watch.wrap(runner_module.sample, "sampler")
    runner_module.sampling_batch_from_plan = watch.wrap(runner_module.sampling_batch_from_plan, "sampler")
    runner.execute = watch.wrap(runner.execute, "runner glue")


def floors(config: ModelConfig, contexts: np.ndarray, num_scheduled: np.ndarray, dtype_bytes: int,
           peak_gflops: float, gbps: float, kv_bytes: int | None = None) -> dict[str, float]:
    """Seconds each compute category needs at the machine's peak, for one step. dtype_bytes: a
    weight's size; kv_bytes: a cached K or V element's (None: dtype_bytes)."""
    shapes = linear_shapes(config)
    tokens, rows = int(num_scheduled.sum()), len(contexts)
    layer_params = sum(i * o for name, (i, o) in shapes.items() if name != "lm_head")
    head_params = config.hidden_size * config.vocab_size
    kv_row = config.num_layers * 2 * config.num_kv_heads * config.head_dim * (kv_bytes or dtype_bytes)
    # A query at position p attends to p + 1 positions: sum over each member's scheduled tokens.
    attended = sum(int(c) * n - n * (n - 1) // 2 for c, n in zip(contexts, num_scheduled))
    attention_flops = config.num_layers * 4 * config.num_heads * config.head_dim * attended

    def floor(flops: float, nbytes: float) -> float:
        return max(flops / (peak_gflops * 1e9), nbytes / (gbps * 1e9))

    return {"linears": floor(2 * tokens * layer_params * config.num_layers,
                             layer_params * config.num_layers * dtype_bytes),
            "lm_head": floor(2 * rows * head_params, head_params * dtype_bytes),
            "attention": floor(attention_flops, int(contexts.sum()) * kv_row)}


def profile(runner: ModelRunner, watch: Stopwatch, plan: StepPlan, steps: int) -> dict[str, float]:
    """Median milliseconds per category over `steps` runs of one plan."""
    runner.execute(plan)
    watch.take()
    per_step = []
    for _ in range(steps):
        started = time.perf_counter()
        runner.execute(plan)
        total = time.perf_counter() - started
        per_step.append({**watch.take(), "total": total})
    names = sorted({name for step in per_step for name in step})
    return {name: round(statistics.median(s.get(name, 0.0) for s in per_step) * 1e3, 3) for name in names}


def scheduler_side(num_seqs: int) -> dict[str, float]:
    """Median per-step scheduler + IPC milliseconds by phase, from scheduler_proc.tools.bench_overhead."""
    done = subprocess.run([sys.executable, "-m", "scheduler_proc.tools.bench_overhead", "--num-seqs", str(num_seqs),
                           "--steps", "40"], capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-300:]}
    return {phase: times["p50_ms"] for phase, times in json.loads(done.stdout)["per_step"].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_proc.tools.profile_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                        help="the KV cache's dtype, as `conveyor serve --kv-cache-dtype` (auto: --dtype)")
    parser.add_argument("--cpu-isa", default="", choices=["", *CPU_ISAS],
                        help="the ISA cap of the worker's own kernels, as `conveyor serve --cpu-isa` ('' = this "
                             "CPU); torch's matmuls follow ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY, which the "
                             "supervisor sets for a capped worker: set them too")
    parser.add_argument("--decode-batches", default="32,64,256")
    parser.add_argument("--context", type=int, default=256, help="tokens of context of each decode")
    parser.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill chunk (0 = none)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=0, help="default: the worker's own choice")
    parser.add_argument("--no-scheduler", action="store_true", help="skip scheduler_proc.tools.bench_overhead")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    block_size = 16
    decode_blocks, prefill_blocks = (-(-n // block_size) for n in (args.context + 1, args.prefill))
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          cpu_isa=args.cpu_isa, block_size=block_size, num_threads=args.num_threads,
                          num_kv_blocks=max(max([*batches, 0]) * decode_blocks, prefill_blocks, 1),
                          max_num_batched_tokens=max(args.prefill, 1))
    runner = ModelRunner(config, rank=0, show_progress=False)
    model = runner.model.config
    shapes = linear_shapes(model)
    head = runner.model.lm_head.skinny
    skinny = None if head is None else head.kernel  # the worker's LM-head kernel, if it has one
    bandwidth = memory_gbps()
    peak = {"threads": torch.get_num_threads(), "memory_gbps": bandwidth["read"],
            "memory_copy_gbps": bandwidth["copy"],
            "float32_gflops": matmul_gflops(shapes, torch.float32, 1024, skinny),
            "float32_onednn_gflops": matmul_gflops(shapes, torch.float32, 1024, None),
            "bfloat16_gflops": matmul_gflops(shapes, torch.bfloat16, 1024, skinny)}
    peak_gflops = max(peak[f"{args.dtype}_gflops"].values())
    # the bytes of a weight as the worker holds it: bf16 panels for a bf16 checkpoint in fp32
    weight_bytes = torch_dtype(args.dtype).itemsize if head is None else head.panels.element_size()
    watch = Stopwatch()
    instrument(runner, watch)
    decoder, runner.model.native_decoder = runner.model.native_decoder, None  # categories: layer by layer
    # (name, contexts, num_scheduled, blocks per member, running requests)
    scenarios = [(f"decode_{b}x{args.context}", np.full(b, args.context + 1), np.ones(b, np.int64),
                  decode_blocks, b) for b in batches]
    if args.prefill:
        scenarios.insert(0, (f"prefill_{args.prefill}", np.array([args.prefill]), np.array([args.prefill]),
                             prefill_blocks, 0))
    steps = {}
    for name, contexts, num_scheduled, max_blocks, num_seqs in scenarios:
        input_ids = np.random.default_rng(0).integers(0, model.vocab_size, int(num_scheduled.sum()))
        plan = synthetic_plan(1, contexts, num_scheduled, input_ids, max_blocks)
        measured = profile(runner, watch, plan, args.steps)
        floor = floors(model, contexts, num_scheduled, weight_bytes, peak_gflops,
                       peak["memory_gbps"], torch_dtype(config.kv_dtype).itemsize)
        steps[name] = {"ms": measured, "floor_ms": {k: round(v * 1e3, 3) for k, v in floor.items()},
                       "share_of_floor": {k: round(floor[k] * 1e3 / measured[k], 3) for k in COMPUTE
                                          if measured.get(k)}}
        if decoder is not None and decoder.serves(runner._batch(plan).attn, len(input_ids)):
            runner.model.native_decoder = decoder  # the step as served: every layer in one call
            steps[name]["one_call_total_ms"] = profile(runner, watch, plan, args.steps)["total"]
            runner.model.native_decoder = None
        if num_seqs and not args.no_scheduler:
            steps[name]["scheduler_and_ipc"] = scheduler_side(num_seqs)
        print(f"{name}: {json.dumps(steps[name]['ms'])}; in one call: {steps[name].get('one_call_total_ms')}",
              file=sys.stderr)
    report = {"model": args.model, "dtype": args.dtype, "kv_cache_dtype": config.kv_dtype,
              "weight_bytes": weight_bytes,
              "cpu_isa_cap": args.cpu_isa or None, "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "peak": peak, "steps": steps}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
