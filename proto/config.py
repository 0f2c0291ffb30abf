"""The engine configuration every process receives from the supervisor (JSON on argv)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

from proto.errors import ValidationError

SCHEDULING_POLICIES = ("continuous", "static")
DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the processes must agree on. Model facts (vocab, eos, context) are filled in
    by the supervisor from the model's config.json before any child starts."""

    model: str = ""
    served_model_name: str = ""
    dtype: str = "bfloat16"
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_kv_blocks: int = 0  # 0 = derive from kv_cache_memory_bytes
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    max_num_waiting: int = 1024
    scheduling: str = "continuous"
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # 0 = off; a prompt longer than this gets at most this many tokens per step
    max_num_partial_prefills: int = 1  # how many partially-prefilled long prompts may share one step
    null_model: bool = False
    tensor_parallel_size: int = 1
    num_threads: int = 0  # torch threads per worker; 0 = cores / tensor_parallel_size
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    runtime_dir: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""
    ready_timeout_s: float = 120.0
    step_timeout_s: float = 120.0
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValidationError(
                f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}", "scheduling")
        if self.dtype not in DTYPES:
            raise ValidationError(f"dtype must be one of {DTYPES}, got {self.dtype!r}", "dtype")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_num_waiting",
                    "tensor_parallel_size", "kv_cache_memory_bytes", "max_num_partial_prefills")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValidationError(f"{name} must be >= 1, got {getattr(self, name)}", name)
        for name in ("num_kv_blocks", "max_model_len", "num_threads", "vocab_size",
                     "long_prefill_token_threshold"):
            if getattr(self, name) < 0:
                raise ValidationError(f"{name} must be >= 0, got {getattr(self, name)}", name)

    def with_updates(self, **changes: object) -> "EngineConfig":
        return replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "EngineConfig":
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValidationError(f"unknown config fields: {sorted(unknown)}")
        raw["eos_token_ids"] = tuple(raw.get("eos_token_ids", ()))
        return cls(**raw)
