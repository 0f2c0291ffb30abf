"""`conveyor serve` flags that place the model: tensor-parallel size, GPUs, nodes; checked up front."""

from __future__ import annotations

import argparse

from deploy.devices import check_devices, visible_gpus
from deploy.model_info import ModelInfo
from proto.config import EngineConfig
from proto.errors import ValidationError


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
    return dict(tensor_parallel_size=tp, devices=tuple(args.devices), nnodes=args.nnodes,
                node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port)


def check_placement(config: EngineConfig) -> None:
    """Refuse GPUs this machine does not have (and CPU-only machines given --devices)."""
    check_devices(config, visible_gpus())
