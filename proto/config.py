"""The engine configuration every process receives from the supervisor (JSON on argv)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

from proto.errors import ValidationError

SCHEDULING_POLICIES = ("continuous", "static")
DTYPES = ("bfloat16", "float32")  # what a worker runs in
# auto: bf16 where the CPU or GPU computes it natively, else fp32 (resolved by the supervisor).
DTYPE_CHOICES = ("auto", *DTYPES)
# The KV cache's element type; auto: the model's dtype. bfloat16 under a float32 model halves both
# the cache's memory per token and attention's reads (on the CPU attention widens what it reads,
# except on the native kernel's AVX-512 bf16 path; on a GPU it computes in the cache's dtype).
KV_CACHE_DTYPE_CHOICES = ("auto", *DTYPES)
# CPU instruction-set levels, each including the ones before it; a cap holds conveyor to one.
CPU_ISAS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
# auto: flash-attn on CUDA when installed, the native CPU kernel when it builds, else torch.
ATTENTION_BACKENDS = ("auto", "torch", "native", "flash")
# How `auto` tool choices are read from the output (frontend/tool_parsers.py); auto = by the
# chat template (Llama 3 JSON for a Llama 3 template, else Hermes `<tool_call>` blocks).
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen", "llama3_json")


# The API key's environment variable: `--api-key`'s default, and how the supervisor hands the key
# to the frontend (a process's command line is world-readable in /proc; its environment is not).
API_KEY_ENV = "CONVEYOR_API_KEY"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the processes must agree on. Model facts (vocab, eos, context) are filled in
    by the supervisor from the model's config.json before any child starts."""

    model: str = ""
    served_model_name: str = ""
    dtype: str = "auto"  # the supervisor resolves auto before any child starts
    dtype_reason: str = ""  # why the supervisor chose dtype (logged, shown on /version)
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPE_CHOICES; kv_dtype resolves auto
    cpu_isa: str = ""  # cap on the CPU ISA conveyor uses, one of CPU_ISAS; "" = all the CPU has
    attention_backend: str = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30  # CPU: the KV cache budget per worker
    gpu_memory_utilization: float = 0.9  # GPU: share of each GPU for weights, activations and KV
    num_kv_blocks: int = 0  # 0 = derive from kv_cache_memory_bytes
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0 = the model's max_position_embeddings (the supervisor resolves 0)
    max_num_waiting: int = 1024
    max_waiting_tokens: int = 1 << 20  # prompt tokens the waiting queue may hold (the scheduler enforces it)
    max_request_body_bytes: int = 16 << 20  # HTTP request bodies beyond this get 413
    # A request body must arrive within this, and a response write still waiting for the client
    # after this long ends the response: a slow or stalled client never keeps its seat and slot.
    client_timeout_s: float = 60.0
    scheduling: str = "continuous"
    tool_call_parser: str = "auto"  # one of TOOL_CALL_PARSERS
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # 0 = off; a prompt longer than this gets at most this many tokens per step
    max_num_partial_prefills: int = 1  # how many partially-prefilled long prompts may share one step
    null_model: bool = False
    tensor_parallel_size: int = 1
    num_threads: int = 0  # torch threads per worker; 0 = cores / tensor_parallel_size
    vocab_size: int = 0  # 0 = the model's (the supervisor resolves 0)
    eos_token_ids: tuple[int, ...] = ()
    runtime_dir: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""  # travels to the frontend in API_KEY_ENV, never in a command line (ps shows those)
    # Origins whose browser pages may call the API (CORS); ("*",) = any, () = none (no CORS headers).
    allowed_origins: tuple[str, ...] = ("*",)
    ready_timeout_s: float = 120.0
    step_timeout_s: float = 120.0
    # A step whose ranks on the scheduler's node use no CPU for this long turns /health 503
    # ("stalled") until they compute again or the step ends (scheduler_proc.rank_progress); the
    # ranks are replaced only at step_timeout_s, which bounds every step's running time.
    stall_timeout_s: float = 10.0
    shutdown_timeout_s: float = 30.0
    # A worker group that dies or hangs is replaced and its requests recomputed, at most
    # max_restarts times within restart_window_s; one more fault stops the stack.
    max_restarts: int = 5
    restart_window_s: float = 600.0
    # Which worker group this is: node 0's supervisor counts replaced groups and tells the other
    # nodes' supervisors (StartGroup); it keys the torch.distributed rendezvous and every StepPlan.
    worker_generation: int = 0
    log_level: str = "info"
    # Across devices and nodes: tensor_parallel_size ranks spread evenly over nnodes supervisors.
    nnodes: int = 1
    node_rank: int = 0  # node 0 runs the frontend, the scheduler and ranks 0..workers_per_node-1
    master_addr: str = ""  # node 0's address as every node reaches it; required when nnodes > 1
    master_port: int = 29500  # torch.distributed rendezvous; the ZMQ step channels use the next ports
    devices: tuple[int, ...] = ()  # this node's GPU per local worker; () = 0, 1, ... (GPU) or none (CPU)
    # Multi-node: the directory of the deployment's CURVE key pair (proto.transport), or the
    # explicit opt-out that sends the step channels unauthenticated and unencrypted.
    transport_keys_dir: str = ""
    insecure_transport: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValidationError(
                f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}", "scheduling")
        if self.dtype not in DTYPE_CHOICES:
            raise ValidationError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}", "dtype")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValidationError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got "
                                  f"{self.kv_cache_dtype!r}", "kv_cache_dtype")
        if self.cpu_isa and self.cpu_isa not in CPU_ISAS:
            raise ValidationError(f"cpu_isa must be one of {CPU_ISAS} or empty, got {self.cpu_isa!r}",
                                  "cpu_isa")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValidationError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got "
                                  f"{self.tool_call_parser!r}", "tool_call_parser")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValidationError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                                  f"{self.attention_backend!r}", "attention_backend")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_num_waiting",
                    "max_waiting_tokens", "max_request_body_bytes", "tensor_parallel_size",
                    "kv_cache_memory_bytes", "max_num_partial_prefills")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValidationError(f"{name} must be >= 1, got {getattr(self, name)}", name)
        if not 0 <= self.port < 65536:
            raise ValidationError(f"port must be a TCP port, 0-65535 (0: any free one), got {self.port}",
                                  "port")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValidationError(f"gpu_memory_utilization must be in (0, 1], got "
                                  f"{self.gpu_memory_utilization}", "gpu_memory_utilization")
        for name in ("ready_timeout_s", "step_timeout_s", "stall_timeout_s", "restart_window_s",
                     "client_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValidationError(f"{name} must be > 0 seconds, got {getattr(self, name)}", name)
        for name in ("num_kv_blocks", "max_model_len", "num_threads", "vocab_size",
                     "long_prefill_token_threshold", "max_restarts", "shutdown_timeout_s"):
            if getattr(self, name) < 0:
                raise ValidationError(f"{name} must be >= 0, got {getattr(self, name)}", name)
        if self.max_model_len == 1:  # a prompt needs a token, and its output a position after it
            raise ValidationError("max_model_len must be at least 2 (one prompt token and one output "
                                  "token), or 0 for the model's own, got 1", "max_model_len")
        self._validate_placement()

    def _validate_placement(self) -> None:
        """Nodes, ranks and devices; each message says what is wrong and how to fix it."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValidationError(
                f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}", "node_rank")
        if self.tensor_parallel_size % self.nnodes:
            raise ValidationError(f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple "
                                  f"of nnodes {self.nnodes} (the same number of workers on every node)",
                                  "tensor_parallel_size")
        if self.nnodes > 1 and not self.master_addr:
            raise ValidationError(f"nnodes={self.nnodes} needs master_addr: the address of node 0 "
                                  "that every node can reach (--master-addr)", "master_addr")
        self._validate_transport()
        top_port = self.master_port + 2 + self.tensor_parallel_size  # the supervisors' group channel
        if self.master_port < 1 or top_port > 65535:
            raise ValidationError(f"master_port must leave room for ports {self.master_port}.."
                                  f"{top_port} below 65536, got {self.master_port}", "master_port")
        if self.devices and len(self.devices) != self.workers_per_node:
            raise ValidationError(f"devices lists {len(self.devices)} devices {list(self.devices)} for "
                                  f"{self.workers_per_node} workers on this node", "devices")
        if len(set(self.devices)) != len(self.devices) or any(d < 0 for d in self.devices):
            raise ValidationError(f"devices must be distinct non-negative indices, got {list(self.devices)}",
                                  "devices")

    def _validate_transport(self) -> None:
        if self.transport_keys_dir and self.insecure_transport:
            raise ValidationError("--transport-keys and --insecure-transport contradict each other: "
                                  "give one", "insecure_transport")
        if self.nnodes > 1 and not (self.transport_keys_dir or self.insecure_transport):
            raise ValidationError(
                f"nnodes={self.nnodes} sends the step channels over TCP: give every node the "
                "deployment's key pair with --transport-keys DIR (create it once with `conveyor "
                "keygen DIR`), or pass --insecure-transport to send them unauthenticated and "
                "unencrypted (a private network only)", "transport_keys_dir")

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype (dtype resolved): kv_cache_dtype, or the model's for auto."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def workers_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The tensor-parallel ranks this node's supervisor starts."""
        return range(self.node_rank * self.workers_per_node, (self.node_rank + 1) * self.workers_per_node)

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
        raw["devices"] = tuple(raw.get("devices", ()))
        raw["allowed_origins"] = tuple(raw.get("allowed_origins", ("*",)))
        return cls(**raw)


def free_seats(config: EngineConfig, num_running: int, workers_serving: bool = True) -> int:
    """Seats the next step may give to waiting sequences: none while no worker group serves, and
    under static scheduling none until the whole batch has ended. The scheduler's admission and
    the frontend's door both count only the waiting sequences beyond these against
    max_num_waiting, so a burst to an idle server fills its seats and then its queue."""
    if not workers_serving or (config.scheduling == "static" and num_running):
        return 0
    return max(config.max_num_seqs - num_running, 0)


def beyond_free_seats(num_free_seats: int) -> str:
    """How a queue-full message says that the free seats were not counted against max_num_waiting."""
    return f"(beyond {num_free_seats} free seat{'' if num_free_seats == 1 else 's'})"


def prompt_fits(num_prompt_tokens: int, max_model_len: int) -> bool:
    """Whether a prompt leaves room for at least one generated token: prompt and output share the
    context, so a prompt of L tokens fits only if L < max_model_len (vLLM's rule too). The frontend
    and the scheduler both ask this; they never disagree about a prompt."""
    return num_prompt_tokens < max_model_len
