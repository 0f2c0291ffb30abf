"""The skinny linear against oneDNN's prepacked GEMM on the default model's linear shapes.

    python -m worker_proc.tools.bench_linears --dtype bfloat16 --rows 1,8,64,256

For each row count, each shape (qkv, o, gate_up, down: 8 weights each, so that they come from
memory as a model's 30 layers do; the LM head: one) runs through both paths in turn, repeat after
repeat, keeping each path's fastest; "step" sums one decode step of SmolLM2-135M (30 layers, one
LM head). Both paths' outputs are checked against the exact product first. Prints JSON lines.

In fp32 a third path runs beside them: the skinny linear from bf16 panels ("skinny_wide"), which it
keeps for a weight whose every value bf16 holds (a bf16 checkpoint served in fp32, as the default
model is), here the same random weights rounded to bf16.

With --sources, the skinny linear of each source directory (a checkout's worker_proc/csrc) instead,
built under --cpu-isa: one decode step's linears with every layer's weights its own (30 layers and
the LM head, about 0.27 GB of bf16 values, so that every step reads them from memory as a served
step does), the builds in turn, round after round, each build's fastest step; the first layer's
output of each is checked against the exact product, and each line says whether a build's outputs
equal the first build's bit for bit. Prints one JSON line per row count.

    python -m worker_proc.tools.bench_linears --dtype float32 --cpu-isa avx2 --rows 1,8,64 \
        --sources /tmp/before/worker_proc/csrc,worker_proc/csrc
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import time
from pathlib import Path

import torch

from worker_proc.attention.native_build import build
from worker_proc.layers.linear import packed_linear, prepack
from worker_proc.layers.skinny import SkinnyLinear, skinny_linear_for

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def fastest(call, copies: int, repeats: int) -> float:
    """Seconds of one call, the fastest mean over `copies` weights of `repeats` rounds."""
    start = time.perf_counter()
    for _ in range(repeats):
        for i in range(copies):
            call(i)
    return (time.perf_counter() - start) / (repeats * copies)


def time_sources(sources: list[Path], dtype: torch.dtype, rows: list[int], cpu_isa: str, rounds: int) -> None:
    """One decode step's linears, each layer's weights its own, through each source's build in turn."""
    kernels = [SkinnyLinear(ctypes.CDLL(str(build(cpu_isa=cpu_isa, source_dir=source))), None, dtype)
               for source in sources]
    generator = torch.Generator().manual_seed(0)
    shapes = [shape for name, shape in SHAPES.items() if name != "lm_head"] * LAYERS + [SHAPES["lm_head"]]
    # bf16 values, as the default model's checkpoint holds: an fp32 kernel reads them from bf16 panels
    first = (torch.randn(*shapes[0], generator=generator) * 0.05).bfloat16().to(dtype)  # checked below
    weights = [kernels[0].pack(first)] + [
        kernels[0].pack((torch.randn(n, k, generator=generator) * 0.05).bfloat16().to(dtype)) for n, k in shapes[1:]]
    for m in rows:
        inputs = {k: torch.randn(m, k, generator=generator).to(dtype) for _, k in shapes}
        steps = [[functools.partial(kernel, inputs[k], weight.panels, n, None) for weight, (n, k) in zip(weights, shapes)]
                 for kernel in kernels]
        outputs = [[call() for call in step] for step in steps]
        exact = inputs[shapes[0][1]].double() @ first.double().T
        for source, produced in zip(sources, outputs):
            torch.testing.assert_close(produced[0].double(), exact, rtol=2 ** -7, atol=1e-2,
                                       msg=f"{source}'s first layer at {m} rows is not x W^T")
        best = [float("inf")] * len(kernels)
        for _ in range(rounds):  # in turn, so that every build shares the machine's noise
            for i, step in enumerate(steps):
                start = time.perf_counter()
                for call in step:
                    call()
                best[i] = min(best[i], time.perf_counter() - start)
        print(json.dumps({"rows": m, "shape": "step", "sources": [str(source) for source in sources],
                          "step_ms": [round(t * 1e3, 2) for t in best],
                          "speedup_over_first": [round(best[0] / t, 3) for t in best],
                          "same_bits_as_first": [all(torch.equal(a, b) for a, b in zip(produced, outputs[0]))
                                                 for produced in outputs]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--cpu-isa", default="", help="the ISA cap the kernel is built under ('' = this CPU)")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sources", default="",
                        help="comma-separated source directories: time their skinny linears against each other")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    kernel = skinny_linear_for(dtype, args.cpu_isa)
    if kernel is None:
        raise SystemExit(f"no skinny linear for {args.dtype} here (the log line above says why)")
    if args.sources:
        sources = [Path(part) for part in args.sources.split(",") if part]
        time_sources(sources, dtype, [int(r) for r in args.rows.split(",")], args.cpu_isa, args.rounds)
        return
    generator = torch.Generator().manual_seed(0)
    wide = dtype == torch.float32
    for rows in (int(r) for r in args.rows.split(",")):
        step = {"onednn": 0.0, "skinny": 0.0, **({"skinny_wide": 0.0} if wide else {})}
        for name, (n, k) in SHAPES.items():
            copies, repeats = (1, 3) if name == "lm_head" else (8, 10)
            weights = [(torch.randn(n, k, generator=generator) * 0.05).to(dtype) for _ in range(copies)]
            onednn, own = [prepack(w) for w in weights], [kernel.pack(w) for w in weights]
            x = torch.randn(rows, k, generator=generator).to(dtype)
            exact = x.double() @ weights[0].double().T
            for got in (packed_linear(x, onednn[0], None), own[0](x, None)):
                torch.testing.assert_close(got.double(), exact, rtol=2 ** -7, atol=1e-2)
            paths = {"onednn": lambda i: packed_linear(x, onednn[i], None), "skinny": lambda i: own[i](x, None)}
            if wide:
                rounded = [w.bfloat16().float() for w in weights]
                own_wide = [kernel.pack(w) for w in rounded]
                assert own_wide[0].widened, "a weight of bf16 values must be kept as bf16"
                torch.testing.assert_close(own_wide[0](x, None).double(), x.double() @ rounded[0].double().T,
                                           rtol=2 ** -7, atol=1e-2)
                paths["skinny_wide"] = lambda i: own_wide[i](x, None)
            best = {label: float("inf") for label in paths}
            for _ in range(args.rounds):  # alternating, so that both share the machine's noise
                for label, call in paths.items():
                    best[label] = min(best[label], fastest(call, copies, repeats))
            for label in step:
                step[label] += best[label] * (1 if name == "lm_head" else LAYERS)
            print(json.dumps({"rows": rows, "shape": name,
                              **{f"{label}_us": round(best[label] * 1e6, 1) for label in paths},
                              "speedup": round(best["onednn"] / best["skinny"], 2),
                              **({"wide_speedup": round(best["skinny"] / best["skinny_wide"], 2)} if wide else {})}),
                  flush=True)
        print(json.dumps({"rows": rows, "shape": "step", **{f"{label}_ms": round(t * 1e3, 2) for label, t in step.items()},
                          "speedup": round(step["onednn"] / step["skinny"], 2),
                          **({"wide_speedup": round(step["skinny"] / step["skinny_wide"], 2)} if wide else {})}),
              flush=True)


if __name__ == "__main__":
    main()
