"""Llama-family causal LM (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over flattened ragged tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_proc.attention import AttentionBackend, AttentionMetadata
from worker_proc.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_proc.layers.fused_cpu import FusedCpuOps
from worker_proc.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from worker_proc.layers.native_decoder import NativeDecoder
from worker_proc.layers.norm import RMSNorm
from worker_proc.layers.rotary import RotaryEmbedding, apply_rotary
from worker_proc.layers.skinny import SkinnyLinear
from worker_proc.model_config import ModelConfig

# Per layer (K, V), slot-addressed flat views in the backend's kv_layout (kv_cache.KVLayout).
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_heads,
                                          config.num_kv_heads, bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size,
                                        bias=config.o_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.backend = backend
        self.fused: FusedCpuOps | None = None  # set by pack_for_cpu where it serves (fp32 CPU)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] -> [num_tokens, hidden_size], or [len(rows), hidden_size]:
        every token's K and V go to the cache, but only these rows' outputs are projected."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, self.num_heads + 2 * self.num_kv_heads,
                                         self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, signed_sin), apply_rotary(k, cos, signed_sin)
        elif self.fused is not None:  # in place: q, k stay views of qkv
            self.fused.rotary_(qkv[:, :self.num_heads + self.num_kv_heads], cos, signed_sin)
        else:  # q and k sit side by side in qkv: rotate both head groups with one call
            qk = apply_rotary(qkv[:, :self.num_heads + self.num_kv_heads], cos, signed_sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        cache_dtype = kv_cache[0].dtype
        if cache_dtype != q.dtype and not self._widens(q, cache_dtype):  # --kv-cache-dtype other
            q, k, v = q.to(cache_dtype), k.to(cache_dtype), v.to(cache_dtype)  # than the model's
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta)  # [tokens, heads * dim]
        if rows is not None:
            out = out[rows]
            if not len(rows):  # every rank alike: the all-reduce is skipped on all of them
                return hidden.new_empty(0, hidden.shape[1])
        return self.o_proj(out.to(hidden.dtype))

    def _widens(self, q: torch.Tensor, cache_dtype: torch.dtype) -> bool:
        """Whether the backend takes q, k, v in the model's dtype and widens a narrower cache's K/V
        (the reference, on the CPU, where bf16 matmuls may be emulated; the native kernel's mixed
        path); else attention runs in the cache's dtype: the native kernel's bf16 path and
        flash-attn read it, a wider cache is not narrowed, and a GPU multiplies bf16 natively."""
        return self.backend.mixed_dtypes and q.is_cpu and cache_dtype.itemsize < q.dtype.itemsize


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=config.mlp_bias)
        self.fused: FusedCpuOps | None = None  # set by pack_for_cpu where it serves (fp32 CPU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                signed_sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream); the caller adds them (fused into the next norm).
        With rows, both hold only those token rows, in that order (see LlamaForCausalLM.forward)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, cos, signed_sin, meta, kv_cache, rows)
        if rows is not None:
            residual = residual[rows]
            if not len(rows):
                return hidden, residual
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Our parameter names equal HF's except the fused projections, listed in PACKED_MODULES."""

    # HF projection name -> (our fused projection, shard id inside it)
    PACKED_MODULES = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        if config.tie_word_embeddings:
            self.tie_lm_head()
        # set by the runner where every piece of a layer has its native kernel (CPU): steps it
        # serves run all layers in one call, with the same results
        self.native_decoder: NativeDecoder | None = None

    def tie_lm_head(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def pack_for_cpu(self, skinny: SkinnyLinear | None = None, fused: FusedCpuOps | None = None) -> None:
        """Prepack every matmul weight for oneDNN (CPU only, after loading; see layers.linear); with
        `skinny`, steps of few rows run through it instead (layers.skinny); with `fused`, the
        hidden-size norms, silu * up and the rotary embedding run as its native passes."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.pack_for_cpu(skinny)
        for layer in self.model.layers:
            layer.input_layernorm.fused = layer.post_attention_layernorm.fused = fused
            layer.self_attn.fused = layer.mlp.fused = fused
        self.model.norm.fused = fused
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        self.lm_head.pack_for_cpu(keep_weight=tied, skinny=skinny)
        if tied and self.lm_head.skinny is not None and self.lm_head.skinny.widened:
            self.model.embed_tokens.narrow_to_bf16()  # the LM head reads its own bf16 panels

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCaches, rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: int64 [num_tokens] -> final-normed hidden [num_tokens, hidden_size].

        rows: int64, the token rows whose hidden state the caller wants (the LM head's), in the
        order wanted -> hidden [len(rows), hidden_size]. The last layer then attends for every token
        (its K and V are cached) but runs its output projection and MLP only for these rows: a
        prompt chunk, whose rows but the last are never sampled, skips most of one layer's matmuls.
        """
        hidden = self.model.embed_tokens(input_ids)
        cos, signed_sin = self.rotary.cos_sin(positions, hidden.dtype)
        if self.native_decoder is not None and self.native_decoder.serves(meta, len(hidden)):
            return self.native_decoder(hidden, cos, signed_sin, meta, kv_caches, rows)
        residual = None
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            hidden, residual = layer(hidden, residual, cos, signed_sin, meta, kv_cache,
                                     rows if i == last else None)
        if not len(hidden):
            return hidden
        hidden, _ = self.model.norm.add_forward(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> float32 [num_rows, vocab_size]; call it only for sampled rows."""
        return self.lm_head.compute_logits(hidden)
