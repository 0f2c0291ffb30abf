"""Baseline for docs/benchmarks.md: Hugging Face `generate` over a trace in static batches.

    python -m worker_proc.tools.hf_baseline --model DIR --trace trace.jsonl --batch-size 32

Each batch is left-padded and generates until its longest member's output length (EOS ignored),
as a padded static batch does; useful output tokens are the trace's output lengths, so the
tok/s figure is comparable with `conveyor bench` on the same trace.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def run_batches(model: torch.nn.Module, trace: list[dict], batch_size: int, pad_id: int) -> dict:
    useful_tokens = 0
    start_s = time.monotonic()
    for first in range(0, len(trace), batch_size):
        batch = trace[first:first + batch_size]
        width = max(len(e["prompt_token_ids"]) for e in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, entry in enumerate(batch):
            prompt = torch.tensor(entry["prompt_token_ids"], dtype=torch.long)
            ids[row, width - len(prompt):] = prompt
            mask[row, width - len(prompt):] = 1
        longest = max(e["output_len"] for e in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                           min_new_tokens=longest, pad_token_id=pad_id)
        useful_tokens += sum(e["output_len"] for e in batch)
        elapsed = time.monotonic() - start_s
        print(f"batch {first // batch_size + 1}: {useful_tokens} tokens in {elapsed:.1f} s", flush=True)
    duration_s = time.monotonic() - start_s
    return {"num_requests": len(trace), "batch_size": batch_size, "output_tokens": useful_tokens,
            "duration_s": round(duration_s, 3), "output_tok_per_s": round(useful_tokens / duration_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--trace", type=Path, required=True, help="JSONL from `conveyor bench --save-trace`")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=0)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    trace = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    pad_id = model.generation_config.pad_token_id or 0
    result = run_batches(model, trace, args.batch_size, pad_id)
    result.update({"model": str(args.model), "dtype": args.dtype, "engine": "hf-generate"})
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
