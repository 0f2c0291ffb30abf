"""Time the sampler's grammar mask (worker_proc/grammar_mask.py) on logits of a given vocabulary.

    python -m worker_proc.tools.grammar_mask_cost --vocab-size 49152 --rows 64 --constrained 1,32,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from worker_proc.grammar_mask import apply_token_bitmask_


def mask_cost_ms(vocab_size: int, num_rows: int, num_constrained: int, dtype: torch.dtype,
                 repeat: int) -> float:
    """Median milliseconds to mask `num_constrained` of `num_rows` logits rows (every other row)."""
    logits = torch.randn(num_rows, vocab_size).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (num_constrained, -(-vocab_size // 32)), dtype=torch.int32)
    stride = max(1, num_rows // max(num_constrained, 1))
    row_indices = (torch.arange(num_constrained) * stride) % num_rows
    samples = []
    for _ in range(repeat + 2):
        start = time.perf_counter()
        apply_token_bitmask_(logits, bitmask, row_indices)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m worker_proc.tools.grammar_mask_cost",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--rows", type=int, default=64, help="logits rows in the step")
    parser.add_argument("--constrained", default="1,32,64", help="constrained rows to time, comma-separated")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for count in (int(c) for c in args.constrained.split(",")):
        ms = mask_cost_ms(args.vocab_size, args.rows, count, getattr(torch, args.dtype), args.repeat)
        print(json.dumps({"vocab_size": args.vocab_size, "rows": args.rows, "constrained": count,
                          "dtype": args.dtype, "threads": args.threads, "median_ms": round(ms, 2)}))


if __name__ == "__main__":
    main()
