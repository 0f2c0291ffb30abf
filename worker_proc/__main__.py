"""CLI: `python -m worker_proc --config '<EngineConfig json>' --rank R` starts one worker rank."""

from __future__ import annotations

import os

# Read first: the imports that follow (torch above all) take seconds, and a parent that dies
# meanwhile must still be noticed (getppid would then name the reaper instead).
PARENT_PID = os.getppid()

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from proto.config import EngineConfig  # noqa: E402
from proto.errors import ValidationError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_proc", description=__doc__)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--rank", type=int, default=0, help="tensor-parallel rank")
    args = parser.parse_args(argv)
    try:
        config = EngineConfig.from_json(args.config)
    except (ValueError, TypeError, ValidationError) as exc:
        print(f"worker: invalid --config: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.rank < config.tensor_parallel_size:
        print(f"worker: --rank must be in [0, {config.tensor_parallel_size}), got {args.rank}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s worker{args.rank} %(name)s: %(message)s")
    from worker_proc.loop import run_worker  # after arg checks: importing torch takes seconds

    return run_worker(config, args.rank, parent_pid=PARENT_PID)


if __name__ == "__main__":
    sys.exit(main())
