"""`conveyor serve` flags for placement (tensor-parallel size, GPUs, nodes) and the transport between nodes."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from deploy.devices import check_devices, visible_gpus
from deploy.model_info import ModelInfo
from proto import sockets, transport
from proto.config import EngineConfig
from proto.errors import ValidationError

log = logging.getLogger("conveyor.deploy")


def parse_devices(text: str) -> tuple[int, ...]:
    """'0,1,3' -> (0, 1, 3)."""
    try:
        devices = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--devices takes GPU indices like 0,1,2,3, got {text!r}")
    if not devices:
        raise argparse.ArgumentTypeError("--devices needs at least one GPU index")
    return devices


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="worker ranks the model is split over, on all nodes together")
    parser.add_argument("--devices", type=parse_devices, default=(),
                        help="this node's GPUs, one per local worker, e.g. 0,1 (default: 0, 1, ...)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes (one supervisor each)")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this node; 0 runs the HTTP frontend and the scheduler")
    parser.add_argument("--master-addr", default="",
                        help="node 0's address, as the other nodes reach it (needed with --nnodes > 1)")
    parser.add_argument("--master-port", type=int, default=defaults.master_port,
                        help="torch.distributed port on node 0; the next 1 + TP ports carry the steps")
    parser.add_argument("--transport-keys", default="", metavar="DIR",
                        help="multi-node: the deployment's CURVE key pair (`conveyor keygen DIR`), the "
                             "same on every node; the step channels are then authenticated and encrypted")
    parser.add_argument("--insecure-transport", action="store_true",
                        help="multi-node without --transport-keys: step channels in the clear, open to "
                             "anyone who reaches the ports (a private network only)")


def placement_fields(args: argparse.Namespace, info: ModelInfo) -> dict[str, object]:
    """EngineConfig fields from the placement flags; refuses what the model cannot be split into."""
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ValidationError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if info.num_attention_heads % tp:
        raise ValidationError(f"--tensor-parallel-size {tp} does not divide "
                              f"the model's {info.num_attention_heads} attention heads")
    kv_heads = info.num_key_value_heads
    if kv_heads % tp and tp % kv_heads:
        raise ValidationError(f"--tensor-parallel-size {tp} must divide the model's {kv_heads} KV heads "
                              "or be a multiple of them (KV heads are then replicated)")
    keys_dir = str(Path(args.transport_keys).resolve()) if args.transport_keys else ""
    return dict(tensor_parallel_size=tp, devices=tuple(args.devices), nnodes=args.nnodes,
                node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                transport_keys_dir=keys_dir, insecure_transport=args.insecure_transport)


def check_placement(config: EngineConfig) -> None:
    """Refuse GPUs this machine does not have (and CPU-only machines given --devices)."""
    check_devices(config, visible_gpus())


def check_transport(config: EngineConfig) -> None:
    """Refuse unreadable keys before any process starts; warn about a transport in the clear."""
    if sockets.uses_curve(config):
        transport.load_transport_keys(config.transport_keys_dir)
    elif config.nnodes > 1:
        log.warning("--insecure-transport: the step and group channels on ports %d..%d of %s are neither "
                    "authenticated nor encrypted; anyone who reaches them can read every plan and "
                    "inject results", config.master_port + 1,
                    config.master_port + 2 + config.tensor_parallel_size, config.master_addr)


def write_keys(directory: str) -> int:
    """`conveyor keygen DIR`: a fresh key pair for --transport-keys; exit code 2 if DIR holds one."""
    try:
        secret_path = transport.write_key_pair(directory)
    except (ValidationError, OSError) as exc:
        log.error("%s", exc)
        return 2
    public_path = secret_path.with_name(transport.PUBLIC_KEY_FILE)
    print(f"wrote {secret_path} (the secret key, mode 0600) and {public_path}")
    print(f"give every node a copy of {secret_path.name} in a directory of its own and pass "
          "--transport-keys DIR; on Kubernetes:")
    print(f"  kubectl create secret generic conveyor-transport-keys --from-file={secret_path}")
    return 0
