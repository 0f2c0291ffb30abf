"""The workload generator: prompt lengths, output lengths and arrival times drawn from a seed.

The one generator behind `conveyor bench` (which replays the trace against a server) and
`conveyor simulate` (which hands it to the slot simulator as a file); the file format and its
reader are the contract in `proto.trace`.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from pathlib import Path

from proto.trace import TraceEntry, load_trace

OUTPUT_DISTS = ("heavy", "uniform")


@dataclass(frozen=True)
class TraceSpec:
    num_prompts: int = 256
    prompt_len_min: int = 64
    prompt_len_max: int = 512
    output_dist: str = "heavy"  # heavy: lognormal; uniform: every output the same length
    output_median: int = 48
    output_sigma: float = 1.0
    output_max: int = 512
    request_rate: float = math.inf  # requests/s (Poisson); inf = one burst at t=0
    seed: int = 0
    vocab_low: int = 100  # prompt ids are drawn from [vocab_low, vocab_high): ordinary tokens
    vocab_high: int = 10000
    shared_prefix_len: int = 0  # every prompt starts with the same this-many tokens (a system prompt)

    def validate(self) -> None:
        checks = [
            (self.num_prompts >= 1, f"--num-prompts must be >= 1, got {self.num_prompts}"),
            (1 <= self.prompt_len_min <= self.prompt_len_max,
             f"prompt lengths need 1 <= min <= max, got {self.prompt_len_min}..{self.prompt_len_max}"),
            (self.output_dist in OUTPUT_DISTS, f"--output-dist must be one of {OUTPUT_DISTS}"),
            (1 <= self.output_median <= self.output_max,
             f"output lengths need 1 <= median <= max, got {self.output_median}, {self.output_max}"),
            (self.output_sigma >= 0, f"--output-sigma must be >= 0, got {self.output_sigma}"),
            (self.request_rate > 0, f"--request-rate must be > 0 (or inf), got {self.request_rate}"),
            (0 <= self.vocab_low < self.vocab_high, "token id range must be non-empty"),
            (self.shared_prefix_len >= 0,
             f"--shared-prefix-len must be >= 0, got {self.shared_prefix_len}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def make_trace(spec: TraceSpec) -> list[TraceEntry]:
    spec.validate()
    rng = random.Random(spec.seed)
    shared_prefix = [rng.randrange(spec.vocab_low, spec.vocab_high) for _ in range(spec.shared_prefix_len)]
    entries: list[TraceEntry] = []
    clock_s = 0.0
    for _ in range(spec.num_prompts):
        if math.isfinite(spec.request_rate):
            clock_s += rng.expovariate(spec.request_rate)
        prompt_len = rng.randint(spec.prompt_len_min, spec.prompt_len_max)
        prompt = shared_prefix + [rng.randrange(spec.vocab_low, spec.vocab_high) for _ in range(prompt_len)]
        entries.append(TraceEntry(round(clock_s, 6), prompt, _output_len(spec, rng)))
    return entries


def _output_len(spec: TraceSpec, rng: random.Random) -> int:
    if spec.output_dist == "uniform":
        return spec.output_median
    drawn = rng.lognormvariate(math.log(spec.output_median), spec.output_sigma)
    return max(1, min(spec.output_max, round(drawn)))


def add_trace_arguments(parser: argparse.ArgumentParser, defaults: TraceSpec = TraceSpec()) -> None:
    """The flags that make (or load) a trace, defaulting to `defaults`; shared by `conveyor bench`,
    `bench sweep` and `conveyor simulate`."""
    rate = defaults.request_rate
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--request-rate", type=float, default=rate,
                        help=f"requests/s, Poisson arrivals (inf: one burst; default {rate})")
    parser.add_argument("--prompt-len-min", type=int, default=defaults.prompt_len_min)
    parser.add_argument("--prompt-len-max", type=int, default=defaults.prompt_len_max)
    parser.add_argument("--output-dist", choices=OUTPUT_DISTS, default=defaults.output_dist,
                        help="heavy: lognormal output lengths; uniform: all the same length")
    parser.add_argument("--output-median", type=int, default=defaults.output_median)
    parser.add_argument("--output-sigma", type=float, default=defaults.output_sigma)
    parser.add_argument("--output-max", type=int, default=defaults.output_max)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--shared-prefix-len", type=int, default=defaults.shared_prefix_len,
                        help="tokens of a prefix every prompt shares (e.g. a system prompt), "
                             "before its own --prompt-len-min..max tokens")
    parser.add_argument("--trace", type=Path, default=None, help="replay this JSONL trace instead")
    parser.add_argument("--save-trace", type=Path, default=None, help="write the trace as JSONL")


def trace_from_args(args: argparse.Namespace, vocab_high: int = TraceSpec.vocab_high) -> list[TraceEntry]:
    """The trace the flags describe: loaded from --trace, or made (ids below `vocab_high`).
    Raises ValueError (or OSError for an unreadable file) with the flag and the value."""
    if args.trace:
        return load_trace(args.trace)
    return make_trace(TraceSpec(
        num_prompts=args.num_prompts, prompt_len_min=args.prompt_len_min,
        prompt_len_max=args.prompt_len_max, output_dist=args.output_dist,
        output_median=args.output_median, output_sigma=args.output_sigma,
        output_max=args.output_max, request_rate=args.request_rate, seed=args.seed,
        shared_prefix_len=args.shared_prefix_len, vocab_high=min(vocab_high, TraceSpec.vocab_high)))
