"""The frontend process: `python -m frontend --config '<EngineConfig json>'`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import uvicorn

from frontend.app import create_app
from frontend.engine_client import ALIVE_TIMEOUT_S, HANG_AFTER_S, ZmqEngineClient
from frontend.server import (UVICORN_GRACE_S, DrainingServer, SupervisorLink, bind_listen_socket,
                             exit_with_parent)
from frontend.tokenizer import Tokenizer
from proto import sockets
from proto.config import API_KEY_ENV, EngineConfig

logger = logging.getLogger("frontend")
# The processes the supervisor replaces (deploy/launcher.py counts them under the same names).
RESTARTED_PROCESSES = ("frontend", "scheduler", "worker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m frontend", description=__doc__)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    for kind in RESTARTED_PROCESSES:  # the supervisor's restart counts before this frontend started
        parser.add_argument(f"--{kind}-restarts", type=int, default=0,
                            help=f"how often the supervisor has replaced the {kind} so far (worker: "
                                 f"under earlier schedulers; the running one reports its own)")
    args = parser.parse_args(argv)
    config = EngineConfig.from_json(args.config)
    if os.environ.get(API_KEY_ENV):  # the supervisor passes the key here, not in --config
        config = config.with_updates(api_key=os.environ[API_KEY_ENV])
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_with_parent()
    if not config.runtime_dir:
        logger.error("runtime_dir is empty: the frontend needs the scheduler's sockets")
        return 2
    link = SupervisorLink(config.runtime_dir)
    try:
        return _serve(config, link, {kind: getattr(args, f"{kind}_restarts") for kind in RESTARTED_PROCESSES})
    finally:
        link.close()


def _serve(config: EngineConfig, link: SupervisorLink, num_restarts: dict[str, int]) -> int:
    try:
        tokenizer = Tokenizer.from_dir(config.model)
        # Requests are held while a lost scheduler is replaced: failed only past the hang bound
        # plus a whole restart (the new scheduler and workers must be ready within --ready-timeout).
        dead_after_s = max(config.step_timeout_s, HANG_AFTER_S + config.ready_timeout_s) + ALIVE_TIMEOUT_S
        engine = ZmqEngineClient(config.runtime_dir, dead_after_s=dead_after_s,
                                 max_frame_bytes=sockets.max_frame_bytes(config),
                                 on_scheduler_hung=link.restart_scheduler)
        app = create_app(config, engine, tokenizer)
        app.state.conveyor.metrics.continue_restart_counts(num_restarts)
        listen_socket = bind_listen_socket(config.host, config.port, config.client_timeout_s)
    except (OSError, ValueError) as exc:
        logger.error("frontend failed to start: %s", exc)
        link.failed(str(exc))
        return 1
    url = f"http://{config.host}:{listen_socket.getsockname()[1]}"
    server = DrainingServer(
        uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=UVICORN_GRACE_S),
        app.state.conveyor, config.shutdown_timeout_s, on_started=lambda: link.ready(url))
    try:
        asyncio.run(server.serve(sockets=[listen_socket]))
    except SystemExit as exc:  # uvicorn exits this way when the app's startup fails
        if not server.started:
            link.failed(f"uvicorn could not start the app (exit {exc.code}); see the log")
        return 1
    logger.info("frontend on %s stopped", url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
