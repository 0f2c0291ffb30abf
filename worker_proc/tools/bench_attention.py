"""Time the native paged-attention kernel alone, and builds of it side by side in one run.

    python -m worker_proc.tools.bench_attention
    git worktree add /tmp/before HEAD~1
    python -m worker_proc.tools.bench_attention --sources /tmp/before/worker_proc/csrc,worker_proc/csrc

Each source directory is compiled (or reused from the build cache) and loaded into this process;
every case then runs each build in turn, repeat after repeat, and keeps each build's fastest call,
so that the builds share the machine's noise. Cases: one prefill chunk from position 0 (token t of
the chunk attends to t + 1 positions) and a decode batch (every member one query over the same
context), on the default model's attention shape unless told otherwise, block tables shuffled
over the cache. The outputs of every build are compared with the first build's. With
--cache-copies N, each build attends N copies of the caches in turn, as a step's N layers do: the
default model's 30 layers of 64 decodes x 256 positions are 380 MB of K and V in bf16 (twice that
in fp32), which a served decode reads from memory, where one layer's copy (the default here) stays
in L3 from call to call.

    python -m worker_proc.tools.bench_attention --cache-copies 30 --decode-context 256 --prefill-tokens 0

    python -m scheduler_proc.tools.block_runs --trace heavy.jsonl --num-kv-blocks 1456 --save-tables t.npz
    python -m worker_proc.tools.bench_attention --decode-tables t.npz

With --decode-tables, the decode members of a served trace's steps (as block_runs saved them) are
timed instead, one row per build, the builds alternating call by call: their tables as the
scheduler handed them out, the same tables with every block moved to a random place, and with each
member's blocks consecutive, the three alternating, over several copies of the caches in turn
(every layer has its own: a served decode finds none of its K and V in the caches).

    python -m worker_proc.tools.bench_attention --block-sizes 16,32,64 --dtypes bfloat16

With --split-positions, each build runs once per value (a decode over more positions is attended
in parts that the threads share; 0: never), the values alternating as builds do. Builds of
checkouts from before the parts take only --split-positions 0:

    python -m worker_proc.tools.bench_attention --split-positions 0,256,512 --decode-seqs 1 \
        --decode-context 4000 --prefill-tokens 0 --cache-copies 30

With --block-sizes, the first build runs each case once per KV block size (its own tables and
caches), the block sizes alternating, each call on the next of --cache-copies copies of that
size's caches: a longer block is a longer run of memory per KV head.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from proto.config import CPU_ISAS
from worker_proc.attention.native_build import SOURCE_DIR, build
from worker_proc.attention.native import SPLIT_POSITIONS
from worker_proc.attention.native_kernel import PagedAttentionKernel

# --dtypes names -> (q's dtype, the caches'): the last is an fp32 model over a bf16 cache (the mixed path)
DTYPES = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
          "float32-over-bfloat16": (torch.float32, torch.bfloat16)}
Case = tuple[torch.Tensor, ...]  # q, out, k_cache, v_cache, block_tables, token_members, context_lens
Attend = Callable[..., None]  # a build's PagedAttentionKernel with its split_positions bound


def make_case(kind: str, args: argparse.Namespace, dtypes: tuple[torch.dtype, torch.dtype]) -> Case:
    """Random q and caches, and the tables of a prefill chunk or a decode batch."""
    if kind == "prefill":
        num_seqs, longest = 1, args.prefill_tokens
        token_members = torch.zeros(longest, dtype=torch.int32)
        context_lens = torch.arange(1, longest + 1, dtype=torch.int32)
    else:
        num_seqs, longest = args.decode_seqs, args.decode_context
        token_members = torch.arange(num_seqs, dtype=torch.int32)
        context_lens = torch.full((num_seqs,), longest, dtype=torch.int32)
    blocks_per_seq = -(-longest // args.block_size)
    num_blocks = num_seqs * blocks_per_seq
    block_tables = torch.randperm(num_blocks, dtype=torch.int32).view(num_seqs, blocks_per_seq).contiguous()
    cache_shape = (args.num_kv_heads, num_blocks * args.block_size, args.head_dim)
    k_cache, v_cache = torch.randn(cache_shape).to(dtypes[1]), torch.randn(cache_shape).to(dtypes[1])
    q = torch.randn(len(token_members), args.num_heads, args.head_dim).to(dtypes[0])
    return q, torch.empty_like(q), k_cache, v_cache, block_tables, token_members, context_lens


def time_builds(kernels: list[Attend], case: Case, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Each build's fastest call in seconds (a round of args.cache_copies calls, one on each copy of
    the caches, divided by their number), and its largest difference from the first build's output."""
    q, out, k_cache, v_cache, block_tables, token_members, context_lens = case
    copies = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(args.cache_copies - 1)]
    best, outputs = [float("inf")] * len(kernels), []
    for repeat in range(args.repeats):
        for index, kernel in enumerate(kernels):
            start = time.perf_counter()
            for k_copy, v_copy in copies:
                kernel(q, out, k_copy, v_copy, block_tables, token_members, context_lens, args.block_size,
                       args.num_threads)
            best[index] = min(best[index], (time.perf_counter() - start) / len(copies))
            if repeat == 0:
                outputs.append(out.float().clone())
    return best, [float((o - outputs[0]).abs().max()) for o in outputs]


LAYOUTS = ("as served", "shuffled", "consecutive")


def served_cases(path: Path, args: argparse.Namespace,
                 dtypes: tuple[torch.dtype, torch.dtype]) -> list[tuple[str, dict[str, Case]]]:
    """Per saved step: its decode members under each of LAYOUTS (one set of caches, blocks of the
    served pool's size)."""
    saved = np.load(path)
    num_blocks, block_size = int(saved["num_kv_blocks"]), int(saved["block_size"])
    if block_size != args.block_size:
        raise ValueError(f"{path} holds tables of {block_size}-position blocks; pass --block-size {block_size}")
    cache_shape = (args.num_kv_heads, num_blocks * block_size, args.head_dim)
    k_cache, v_cache = torch.randn(cache_shape).to(dtypes[1]), torch.randn(cache_shape).to(dtypes[1])
    steps = []
    for name in sorted((n for n in saved.files if n.endswith("_tables")), key=lambda n: int(n[4:-7])):
        tables, contexts = torch.from_numpy(saved[name]), torch.from_numpy(saved[name[:-7] + "_contexts"])
        lengths = (contexts + block_size - 1) // block_size  # int32 [members]: blocks each one reads
        used = torch.arange(tables.shape[1])[None, :] < lengths[:, None]  # bool [members, width]
        shuffled = torch.zeros_like(tables)
        shuffled[used] = torch.randperm(num_blocks, dtype=torch.int32)[:int(used.sum())]
        consecutive = torch.zeros_like(tables)
        consecutive[used] = torch.arange(int(used.sum()), dtype=torch.int32)
        q = torch.randn(len(contexts), args.num_heads, args.head_dim).to(dtypes[0])
        members = torch.arange(len(contexts), dtype=torch.int32)
        cases = {layout: (q, torch.empty_like(q), k_cache, v_cache, table.contiguous(), members, contexts)
                 for layout, table in zip(LAYOUTS, (tables, shuffled, consecutive))}
        steps.append((f"{name[:-7]}: {len(contexts)} decodes", cases))
    return steps


def time_alternating(kernels: list[Attend], cases: dict[str, tuple[Case, int]],
                     args: argparse.Namespace) -> list[dict[str, float]]:
    """Per build, each case's fastest call in ms, the cases (each with its block size) and the
    builds alternating, each call on the next of args.cache_copies copies of that case's caches (so
    no call finds the last one's K and V cached). Cases that share their caches share the copies."""
    copies: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for case, _ in cases.values():
        if id(case[2]) not in copies:
            copies[id(case[2])] = [(case[2].clone(), case[3].clone()) for _ in range(args.cache_copies)]
    best = [dict.fromkeys(cases, float("inf")) for _ in kernels]
    calls = 0
    for _ in range(args.repeats):
        for name, ((q, out, k_cache, _, tables, members, contexts), block_size) in cases.items():
            own = copies[id(k_cache)]
            for kernel, fastest in zip(kernels, best):
                k_copy, v_copy = own[calls % len(own)]
                calls += 1
                start = time.perf_counter()
                kernel(q, out, k_copy, v_copy, tables, members, contexts, block_size, args.num_threads)
                fastest[name] = min(fastest[name], time.perf_counter() - start)
    return [{name: round(seconds * 1e3, 3) for name, seconds in fastest.items()} for fastest in best]


def time_layouts(kernels: list[Attend], cases: dict[str, Case],
                 args: argparse.Namespace) -> list[dict[str, float]]:
    """Per build, each layout's fastest call in ms (time_alternating, every layout of args.block_size)."""
    return time_alternating(kernels, {layout: (case, args.block_size) for layout, case in cases.items()}, args)


def time_block_sizes(kernel: Attend, kind: str, dtypes: tuple[torch.dtype, torch.dtype],
                     args: argparse.Namespace) -> dict[str, float]:
    """The case of this kind once per block size of args.block_sizes, alternating (time_alternating)."""
    cases = {}
    for block_size in args.block_sizes:
        case = make_case(kind, argparse.Namespace(**{**vars(args), "block_size": block_size}), dtypes)
        cases[f"block {block_size}"] = (case, block_size)
    return time_alternating([kernel], cases, args)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_proc.tools.bench_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", default=str(SOURCE_DIR),
                        help="comma-separated kernel source directories to compare (default: this checkout's)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help=f"comma-separated, of {', '.join(DTYPES)} (fp32 q and output over a bf16 cache)")
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="0: no prefill case")
    parser.add_argument("--decode-seqs", type=int, default=64, help="0: no decode case")
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--cpu-isa", default="", choices=["", *CPU_ISAS],
                        help="the ISA cap every build is compiled under, as `conveyor serve --cpu-isa` ('' = "
                             "all this CPU has; a level above it builds code this CPU cannot run)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--decode-tables", type=Path,
                        help="an .npz from scheduler_proc.tools.block_runs: time its steps' decodes instead")
    parser.add_argument("--cache-copies", type=int,
                        help="copies of each case's caches that the calls attend in turn, as a step's layers "
                             "do (default: 1, the same caches, comparing builds; 4 with --decode-tables or "
                             "--block-sizes)")
    parser.add_argument("--split-positions", default=str(SPLIT_POSITIONS),
                        help="comma-separated: a decode over more positions is attended in parts (0: never); "
                             "each build runs with each value (default: the served one)")
    parser.add_argument("--block-sizes", default="",
                        help="comma-separated KV block sizes: time the first build at each, alternating")
    args = parser.parse_args(argv)
    try:
        args.block_sizes = [int(part) for part in args.block_sizes.split(",") if part]
        splits = [int(part) for part in args.split_positions.split(",") if part]
    except ValueError:
        print(f"bench_attention: --block-sizes and --split-positions take integers, got "
              f"{args.block_sizes!r} and {args.split_positions!r}", file=sys.stderr)
        return 2
    if not splits or any(n < 0 or n % 16 for n in splits):
        print(f"bench_attention: --split-positions takes 0 or multiples of 16, got {args.split_positions!r}",
              file=sys.stderr)
        return 2
    unknown = [name for name in args.dtypes.split(",") if name not in DTYPES]
    if unknown:
        print(f"bench_attention: --dtypes takes {', '.join(DTYPES)}, got {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.cache_copies is None:
        args.cache_copies = 4 if args.decode_tables or args.block_sizes else 1
    if args.cache_copies < 1:
        print(f"bench_attention: --cache-copies must be >= 1, got {args.cache_copies}", file=sys.stderr)
        return 2
    if any(size < 1 for size in args.block_sizes):
        print(f"bench_attention: --block-sizes must be >= 1, got {args.block_sizes}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    torch.set_num_threads(args.num_threads)
    sources = [Path(part) for part in args.sources.split(",") if part]
    kernels = [PagedAttentionKernel(ctypes.CDLL(str(build(cpu_isa=args.cpu_isa, source_dir=s))), s, None)
               for s in sources]
    builds = [(f"{s}" if len(splits) == 1 else f"{s} split {n}", k) for s, k in zip(sources, kernels) for n in splits]
    calls = [functools.partial(k, split_positions=n) for k in kernels for n in splits]
    unsplit = [str(s) for s, k in zip(sources, kernels) if not k.takes_split_positions]
    if unsplit and any(splits):
        print(f"bench_attention: {', '.join(unsplit)} predate --split-positions; pass --split-positions 0",
              file=sys.stderr)
        return 2
    older = [str(s) for s, k in zip(sources, kernels) if not k.takes_mixed_dtypes]
    if older and any(DTYPES[name][0] != DTYPES[name][1] for name in args.dtypes.split(",")):
        print(f"bench_attention: {', '.join(older)} predate fp32 q over a bf16 cache; leave "
              f"float32-over-bfloat16 out of --dtypes for them", file=sys.stderr)
        return 2
    if args.decode_tables:
        for dtype_name in args.dtypes.split(","):
            try:
                steps = served_cases(args.decode_tables, args, DTYPES[dtype_name])
            except (ValueError, OSError, KeyError) as exc:
                print(f"bench_attention: {args.decode_tables}: {exc}", file=sys.stderr)
                return 2
            for label, cases in steps:
                for (build_label, _), ms in zip(builds, time_layouts(calls, cases, args)):
                    print(json.dumps({"dtype": dtype_name, "case": label, "build": build_label, "ms": ms}), flush=True)
        return 0
    rows = []
    for dtype_name in args.dtypes.split(","):
        for kind in ("prefill", "decode"):
            if (args.prefill_tokens if kind == "prefill" else args.decode_seqs * args.decode_context) < 1:
                continue  # --prefill-tokens 0 or --decode-seqs 0: that case is not run
            if args.block_sizes:
                print(json.dumps({"dtype": dtype_name, "case": kind,
                                  "ms": time_block_sizes(calls[0], kind, DTYPES[dtype_name], args)}), flush=True)
                continue
            best, diffs = time_builds(calls, make_case(kind, args, DTYPES[dtype_name]), args)
            group = args.num_heads // args.num_kv_heads
            rows.append({"dtype": dtype_name, "case": kind,
                         "ms": {label: round(b * 1e3, 3) for (label, _), b in zip(builds, best)},
                         "max_abs_diff_from_first": diffs,
                         "path": {label: k.code_path(DTYPES[dtype_name][0], group, args.head_dim,
                                                     DTYPES[dtype_name][1])
                                  for label, k in builds}})
            print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
