"""Every decoder layer of a CPU step as one native call (worker_proc/csrc/decoder_layers.c).

Layer by layer (worker_proc/model.py), a step makes about ten native calls a layer from Python,
each with its checks, views and allocations: a third of a one-sequence decode step of SmolLM2-135M.
One call here runs the same kernels in the same order on the same values, so the hidden states,
and the logits, are the same bit for bit. It serves a step where every piece of a layer has its
native kernel: the skinny linear for all four projections (a step of at most skinny.MAX_ROWS rows,
or of any size where the kernel serves all rows), the fused norm, rotary and silu passes, and the
attention kernel for every query (no chunk handed to SDPA), on one rank, for a Llama-family layer
without q/k norms. Other steps and models run layer by layer. docs/benchmarks.md, "Decoder layers
in one call".
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import torch

from worker_proc.attention.native import NativeMetadata, NativePagedAttention
from worker_proc.attention.native_kernel import failure_of, load_native_library, thread_count
from worker_proc.layers.skinny import MAX_ROWS, SkinnyWeight

if TYPE_CHECKING:
    from worker_proc.model import KVCaches, LlamaForCausalLM

log = logging.getLogger(__name__)

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_LINEARS = ("qkv", "o", "gate_up", "down")  # decoder_layers.c's order
# decoder_layers.c's enum Failure
_BAD_SLOT, _BAD_ROW, _ATTENTION, _LINEAR, _NO_MEMORY = 1, 2, 3, 4, 5
_SKINNY_NO_MEMORY = -3


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("panels", _P * 4), ("bias", _P * 4), ("wide", _I32 * 4)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.POINTER(_Layer)), ("num_layers", _I32), ("final_norm", _P),
                ("hidden", _I32), ("num_heads", _I32), ("num_kv_heads", _I32), ("head_dim", _I32), ("inter", _I32),
                ("eps", _F32), ("scale", _F32), ("bf16", _I32), ("cache_bf16", _I32), ("block_size", _I32),
                ("split_positions", _I32)]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _I64), ("embedded", _P), ("cos", _P), ("signed_sin", _P), ("slot_mapping", _P),
                ("block_tables", _P), ("num_seqs", _I64), ("max_blocks", _I64), ("token_members", _P),
                ("context_lens", _P), ("kv_caches", _P), ("num_slots", _I64), ("rows", _P), ("num_rows", _I64),
                ("out", _P), ("num_threads", _I32), ("failure", _I64 * 4)]


class NativeDecoder:
    """The model's layers as decoder_layers.c reads them: pointers into the model's own tensors
    (its panels, biases and norm weights), taken once; the model keeps them alive."""

    def __init__(self, library: ctypes.CDLL, num_threads_cap: int | None, model: LlamaForCausalLM,
                 backend: NativePagedAttention, cache_dtype: torch.dtype, all_rows: bool) -> None:
        config, layers = model.config, model.model.layers
        self._layers = (_Layer * len(layers))()
        for entry, layer in zip(self._layers, layers):
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for i, linear in enumerate(linears):
                skinny: SkinnyWeight = linear.skinny
                entry.panels[i] = skinny.panels.data_ptr()
                entry.bias[i] = None if linear.bias is None else linear.bias.data_ptr()
                entry.wide[i] = skinny.widened
        attention = layers[0].self_attn
        self.shape = (attention.num_heads, attention.num_kv_heads, attention.head_dim)
        self.block_size, self.split_positions = backend.block_size, backend.split_positions
        self._model = _Model(self._layers, len(layers), model.model.norm.weight.data_ptr(), config.hidden_size,
                             *self.shape, config.intermediate_size, config.rms_norm_eps,
                             attention.head_dim ** -0.5, layers[0].mlp.fused.dtype == torch.bfloat16,
                             cache_dtype == torch.bfloat16, backend.block_size, backend.split_positions)
        self._call = library.decoder_layers
        self._call.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
        self._call.restype = _I32
        self.max_rows = None if all_rows else MAX_ROWS
        self.num_threads_cap = num_threads_cap
        self._kv_caches: tuple[KVCaches, ctypes.Array] | None = None  # the list last seen, and its pointers

    def serves(self, meta: object, num_tokens: int) -> bool:
        """Whether this step's every layer runs on the native kernels alone."""
        return (isinstance(meta, NativeMetadata) and meta.kernel_rows is None
                and (self.max_rows is None or num_tokens <= self.max_rows))

    def __call__(self, embedded: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, meta: NativeMetadata,
                 kv_caches: KVCaches, rows: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward after the embedding: embedded [num_tokens, hidden] (read only),
        cos, signed_sin [num_tokens, 1, head_dim] -> the final norm's hidden [len(rows) or
        num_tokens, hidden]."""
        num_tokens = embedded.shape[0]
        if rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()):
            raise ValueError(f"native decoder: rows must be contiguous int64, got {rows.dtype} {tuple(rows.shape)}")
        out = embedded.new_empty(num_tokens if rows is None else len(rows), embedded.shape[1])
        tables = meta.block_tables
        step = _Step(num_tokens, embedded.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
                     meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[0], tables.shape[1],
                     meta.token_members.data_ptr(), meta.token_context_lens.data_ptr(),
                     ctypes.addressof(self._cache_pointers(kv_caches)), kv_caches[0][0].shape[1],
                     None if rows is None else rows.data_ptr(), -1 if rows is None else len(rows), out.data_ptr(),
                     thread_count(self.num_threads_cap))
        if self._call(ctypes.byref(self._model), ctypes.byref(step)) != 0:
            raise self._failure(tuple(step.failure), meta, kv_caches, rows)
        return out

    def _cache_pointers(self, kv_caches: KVCaches) -> ctypes.Array:
        """[num_layers][2] K, V pointers of this list of caches (the runner's, or a throwaway one)."""
        if self._kv_caches is None or self._kv_caches[0] is not kv_caches:
            pointers = (_P * (2 * len(kv_caches)))(*(t.data_ptr() for pair in kv_caches for t in pair))
            self._kv_caches = (kv_caches, pointers)
        return self._kv_caches[1]

    def _failure(self, failure: tuple[int, ...], meta: NativeMetadata, kv_caches: KVCaches,
                 rows: torch.Tensor | None) -> Exception:
        what, layer, status, index = failure
        num_slots = kv_caches[0][0].shape[1]
        if what == _BAD_SLOT:
            return ValueError(f"native decoder: token {index}'s slot {int(meta.slot_mapping[index])} is outside the "
                              f"cache's {num_slots} slots")
        if what == _BAD_ROW:
            return ValueError(f"native decoder: output row {int(rows[index])} is not one of the step's "
                              f"{len(meta.slot_mapping)} tokens")
        if what == _ATTENTION:
            return failure_of(status, index, meta.block_tables, meta.token_members, meta.token_context_lens,
                              num_slots, self.block_size, self.shape, self.split_positions)
        if what == _NO_MEMORY or (what == _LINEAR and status == _SKINNY_NO_MEMORY):
            return MemoryError(f"native decoder: out of memory for a {len(meta.slot_mapping)}-token step's buffers")
        if what == _LINEAR:
            return ValueError(f"native decoder: layer {layer}'s {_LINEARS[index]} linear refused its input "
                              f"(status {status})")
        return RuntimeError(f"native decoder failed: {failure}")


def native_decoder_for(model: LlamaForCausalLM, backend: object, cache_dtype: torch.dtype, cpu_isa: str,
                       tp_size: int) -> NativeDecoder | None:
    """The one-call decoder when every piece of this model's layers has its native kernel here, else
    None with the reason logged: the layers then run one by one."""
    layers = model.model.layers
    linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    fused = layers[0].mlp.fused
    why = None
    if not isinstance(backend, NativePagedAttention):
        why = "attention is not the native kernel"
    elif tp_size > 1:
        why = f"{tp_size} tensor-parallel ranks (their all-reduces run between the kernels)"
    elif model.config.qk_norm:
        why = "q/k norms run through torch"
    elif any(linear.skinny is None for linear in linears):
        why = "the linears run through oneDNN"
    elif fused is None:
        why = "the norms, rotary and silu run through torch"
    elif cache_dtype != fused.dtype and not (backend.mixed_dtypes and fused.dtype == torch.float32):
        why = f"a {cache_dtype} KV cache under a {fused.dtype} model is cast between the kernels"
    if why is not None:
        log.info("decoder layers: one by one (%s)", why)
        return None
    library, _, cap = load_native_library(cpu_isa)
    log.info("decoder layers: one native call a step")
    return NativeDecoder(library, cap, model, backend, cache_dtype, linears[0].skinny.kernel.all_rows)
