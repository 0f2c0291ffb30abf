"""The `conveyor` command: `serve` starts the stack; `bench` replays a trace against a server;
`simulate` shows static vs continuous batching on the real scheduler; `keygen` writes the key
pair of a multi-node deployment."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path

from deploy.model_info import ModelError, ModelInfo, read_model_info, resolve_model_facts
from deploy.model_source import resolve_model
from deploy.placement import add_placement_arguments, check_placement, placement_fields, write_keys
from deploy.cpu_isa import CAP_VARIABLE
from proto.config import (API_KEY_ENV, ATTENTION_BACKENDS, CPU_ISAS, DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES,
                          SCHEDULING_POLICIES, TOOL_CALL_PARSERS, EngineConfig)
from proto.errors import ValidationError

log = logging.getLogger("conveyor.deploy")
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5G' or a plain byte count -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (try 2GiB or 512MiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_origins(text: str) -> tuple[str, ...]:
    """'*', '' or comma-separated origins as browsers send them: scheme://host[:port], no path."""
    origins = tuple(part.strip() for part in text.split(",") if part.strip())
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]+", origin):
            raise argparse.ArgumentTypeError(f"an origin is scheme://host[:port] with no path (or '*'), "
                                             f"got {origin!r}")
    return origins


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("model", nargs="?", default=None,
                        help="local HF model directory or cached model id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--served-model-name", default=defaults.served_model_name,
                        help="the model's name in the API (default: the Hugging Face id it was given as, "
                             "else the model directory's name)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, defaults.api_key),
                        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, "
                             "which keeps the key out of the process list)")
    parser.add_argument("--allowed-origins", type=parse_origins, default=defaults.allowed_origins,
                        help="comma-separated origins whose browser pages may call the API (CORS), "
                             "e.g. https://chat.example.com; '*' (the default) = any, '' = none")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=defaults.dtype,
                        help="auto: bfloat16 where the CPU (AMX, AVX512-BF16, AVX-NE-CONVERT) or GPU "
                             "computes it natively, else float32")
    parser.add_argument("--cpu-isa", choices=CPU_ISAS, default=defaults.cpu_isa,
                        help=f"use at most this CPU instruction set (default: all the CPU has; also "
                             f"${CAP_VARIABLE}); for testing other CPUs' paths")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=defaults.attention_backend,
                        help="auto: flash-attn on CUDA when installed, the native decode kernel on the "
                             "CPU when it builds (needs a C compiler), else the torch reference")
    parser.add_argument("--scheduling", choices=SCHEDULING_POLICIES, default=defaults.scheduling)
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=defaults.tool_call_parser,
                        help="how tool calls are read from `auto` outputs; auto = by the chat template "
                             "(llama3_json for a Llama 3 template, else hermes)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len,
                        help="0 = the model's context length")
    parser.add_argument("--max-num-waiting", type=int, default=defaults.max_num_waiting,
                        help="waiting-queue limit in sequences (each of a request's n choices is one); "
                             "requests beyond it get 429")
    parser.add_argument("--max-waiting-tokens", type=int, default=defaults.max_waiting_tokens,
                        help="prompt tokens the waiting queue may hold; requests beyond it get 429 "
                             "(an empty queue takes any prompt that fits the model)")
    parser.add_argument("--max-request-body-size", type=parse_size,
                        default=defaults.max_request_body_bytes,
                        help="HTTP request bodies beyond this get 413, e.g. 16MiB (the default)")
    parser.add_argument("--client-timeout", type=float, default=defaults.client_timeout_s,
                        help="seconds a request body may take to arrive (then 408), and a response "
                             "write may wait for a client that reads less than ~48 KB in that time (then "
                             "the response ends and its request is aborted)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn off reuse of cached KV blocks across requests")
    parser.add_argument("--long-prefill-token-threshold", type=int,
                        default=defaults.long_prefill_token_threshold,
                        help="prompts longer than this get at most this many tokens per step (0 = off)")
    parser.add_argument("--max-num-partial-prefills", type=int, default=defaults.max_num_partial_prefills,
                        help="how many long prompts may be partially prefilled in one step")
    parser.add_argument("--kv-cache-memory", type=parse_size, default=defaults.kv_cache_memory_bytes,
                        help="CPU: KV cache budget per worker, e.g. 2GiB (default 1GiB)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default=defaults.kv_cache_dtype,
                        help="the KV cache's dtype; auto (the default): the model's, except bfloat16 "
                             "where --dtype auto chose float32 on a CPU without native bf16 (AVX2 and up, "
                             "with the native attention kernel). bfloat16 under a float32 model holds "
                             "twice the tokens in the same memory and halves attention's reads; attention "
                             "then reads K and V rounded to bf16 (and on AVX512-BF16 CPUs and GPUs "
                             "multiplies in bf16), so greedy output can differ from an all-fp32 run")
    parser.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization,
                        help="GPU: share of each GPU's memory for weights, activations and the KV "
                             "cache, which gets what a profiled full-size step leaves (default 0.9)")
    parser.add_argument("--num-kv-blocks", type=int, default=defaults.num_kv_blocks,
                        help="override the KV block count")
    add_placement_arguments(parser)  # --tensor-parallel-size, --devices, --nnodes, --master-addr...
    parser.add_argument("--num-threads", type=int, default=defaults.num_threads,
                        help="torch threads per worker")
    parser.add_argument("--null-model", action="store_true",
                        help="sample without running a model (measures scheduler + IPC overhead)")
    parser.add_argument("--ready-timeout", type=float, default=defaults.ready_timeout_s)
    parser.add_argument("--step-timeout", type=float, default=defaults.step_timeout_s,
                        help="seconds a worker may take for one step before it counts as hung and "
                             "its group is replaced")
    parser.add_argument("--stall-timeout", type=float, default=defaults.stall_timeout_s,
                        help="seconds a step's worker processes may use no CPU before GET /health "
                             "answers 503 'stalled' (until they compute again, the step ends, or its "
                             "group is replaced at --step-timeout); their CPU is read once a second")
    parser.add_argument("--max-restarts", type=int, default=defaults.max_restarts,
                        help="restarts allowed within --restart-window, all processes counted "
                             "together: a worker group replaced, the frontend restarted, or the "
                             "scheduler replaced (with its worker group, one restart); one more "
                             "fault stops the stack")
    parser.add_argument("--restart-window", type=float, default=defaults.restart_window_s,
                        help="seconds over which --max-restarts counts")
    parser.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout_s)
    parser.add_argument("--log-level", default=defaults.log_level,
                        choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    model_dir = resolve_model(args.model)
    info = read_model_info(model_dir)
    served_model_name = args.served_model_name
    if not served_model_name and args.model is not None and not Path(args.model).expanduser().is_dir():
        served_model_name = args.model  # a Hugging Face id: its cache snapshot is named by a commit hash
    try:
        config = _engine_config(args, model_dir, served_model_name, info)
    except ValidationError as exc:  # the config's own message, prefixed with the flag that set it
        if exc.param is None:
            raise
        raise ValidationError(f"{flag_of(exc.param)}: {exc.message}", exc.param) from None
    check_placement(config)
    return resolve_model_facts(config, info)


# EngineConfig fields whose flag is not the field's name in dashes.
_FLAG_OF_FIELD = {"kv_cache_memory_bytes": "--kv-cache-memory", "max_request_body_bytes": "--max-request-body-size",
                  "client_timeout_s": "--client-timeout", "ready_timeout_s": "--ready-timeout",
                  "step_timeout_s": "--step-timeout", "stall_timeout_s": "--stall-timeout",
                  "shutdown_timeout_s": "--shutdown-timeout", "restart_window_s": "--restart-window"}


def flag_of(field: str) -> str:
    """The `conveyor serve` flag that sets an EngineConfig field."""
    return _FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))


def _engine_config(args: argparse.Namespace, model_dir: Path, served_model_name: str,
                   info: ModelInfo) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), served_model_name=served_model_name,
        dtype=args.dtype, cpu_isa=args.cpu_isa, attention_backend=args.attention_backend, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_num_waiting=args.max_num_waiting, max_waiting_tokens=args.max_waiting_tokens,
        max_request_body_bytes=args.max_request_body_size, client_timeout_s=args.client_timeout,
        scheduling=args.scheduling, tool_call_parser=args.tool_call_parser, null_model=args.null_model,
        enable_prefix_caching=not args.no_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        num_threads=args.num_threads,
        eos_token_ids=info.eos_token_ids, host=args.host, port=args.port,
        api_key=args.api_key, allowed_origins=args.allowed_origins,
        ready_timeout_s=args.ready_timeout, step_timeout_s=args.step_timeout,
        stall_timeout_s=args.stall_timeout,
        shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level,
        max_restarts=args.max_restarts, restart_window_s=args.restart_window,
        **placement_fields(args, info))


def serve(args: argparse.Namespace) -> int:
    from deploy.launcher import Stack, StartupError

    try:
        config = config_from_args(args)
    except (ModelError, ValidationError) as exc:
        log.error("%s", exc)
        return 2
    log.info("serving model directory %s as %r (%s scheduling)", config.model,
             config.served_model_name, config.scheduling)
    stopping = {"flag": False}
    stacks: list[Stack] = []  # the running Stack, for a second signal to hurry

    def request_stop(signum: int, _frame: object) -> None:
        if stopping["flag"] and stacks:
            log.info("received %s again; aborting in-flight requests and stopping now", signal.Signals(signum).name)
            stacks[0].hurry()
            return
        log.info("received %s; draining and stopping", signal.Signals(signum).name)
        stopping["flag"] = True

    # SIGHUP (the terminal closed) drains as SIGTERM does, rather than killing the supervisor
    # outright and leaving its children to die unanswered; unless it is ignored (nohup).
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signum != signal.SIGHUP or signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, request_stop)
    # A signal also wakes the supervisor's watch at once: the frontend starts draining (and /health
    # turns 503) within milliseconds, not at the end of a poll slice.
    wakeup, wakeup_writer = socket.socketpair()
    for end in (wakeup, wakeup_writer):
        end.setblocking(False)
    signal.set_wakeup_fd(wakeup_writer.fileno(), warn_on_full_buffer=False)
    try:
        with Stack(config, should_stop=lambda: stopping["flag"], wakeup=wakeup) as stack:
            stacks.append(stack)
            if config.node_rank == 0:
                log.info("conveyor is answering on %s (OpenAI API under /v1)", stack.url)
            else:
                log.info("node %d: workers %s joined node 0 at %s", config.node_rank,
                         list(config.local_ranks), config.master_addr)
            reason = stack.watch(lambda: stopping["flag"])
            log.log(logging.INFO if stopping["flag"] else logging.ERROR, "%s", reason)
            return 0 if stopping["flag"] else 1
    except StartupError as exc:
        if stopping["flag"]:  # SIGTERM or Ctrl-C during start-up: every process is stopped
            log.info("stopped during start-up: %s", exc)
            return 0
        log.error("start-up failed: %s", exc)
        return 1
    finally:
        signal.set_wakeup_fd(-1)
        wakeup.close()
        wakeup_writer.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:
        from deploy import simulate

        return simulate.run(argv[1:])
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="serve a model over the OpenAI API"))
    from deploy import bench

    bench.add_arguments(commands.add_parser("bench", help="replay a trace against a server "
                                                          "(`bench sweep`: vary --max-num-seqs)"))
    commands.add_parser("simulate", add_help=False, help="static vs continuous batching on the real "
                                                         "scheduler, drawn as slot timelines")
    keygen = commands.add_parser("keygen", help="write a CURVE key pair for --transport-keys (multi-node)")
    keygen.add_argument("dir", help="a new or empty directory; gets conveyor.key_secret and conveyor.key")
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    if args.command == "keygen":
        return write_keys(args.dir)
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
