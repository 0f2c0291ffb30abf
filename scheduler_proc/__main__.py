"""Entry point: `python -m scheduler_proc --config '<EngineConfig json>'`."""

from __future__ import annotations

import os

# Read before the imports below: they take most of a second on a loaded machine, and a parent that
# dies meanwhile must still be noticed (getppid would then name the reaper instead).
PARENT_PID = os.getppid()

import argparse  # noqa: E402
import ctypes  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from proto.config import EngineConfig  # noqa: E402
from scheduler_proc.loop import SchedulerLoop  # noqa: E402

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int) -> bool:
    """Ask Linux to send SIGTERM when the parent dies (the loop also polls os.getppid());
    False if the parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            logging.getLogger(__name__).warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on getppid")
    # The parent may have died before prctl took effect; then no signal will ever come.
    return os.getppid() == parent_pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler_proc", description=__doc__)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = parser.parse_args(argv)
    config = EngineConfig.from_json(args.config)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s scheduler %(levelname)s %(name)s: %(message)s")
    if not die_with_parent(PARENT_PID):
        return 1
    loop = SchedulerLoop(config, parent_pid=PARENT_PID)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: loop.request_stop())
    signal.signal(signal.SIGINT, lambda _signum, _frame: loop.request_stop())
    return loop.run()


if __name__ == "__main__":
    sys.exit(main())
