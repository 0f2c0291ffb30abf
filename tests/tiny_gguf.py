"""The tiny Llama as a llama.cpp GGUF: Q4_1 / Q8_0 weights, tied embeddings, byte-level BPE, chat template."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from tiny_model import TINY_CHAT_TEMPLATE

Q4_1 = gguf.GGMLQuantizationType.Q4_1  # what the default model's GGUF holds
# HF per-layer module -> llama.cpp tensor name, as in a file converted by llama.cpp.
_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                "post_attention_layernorm": "ffn_norm"}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, *module, _ = hf_name.split(".")  # model.layers.<i>.<module...>.weight
    return f"blk.{layer}.{_LAYER_NAMES['.'.join(module)]}.weight"


def interleave_rope_halves(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: HF rotates each head's two halves, GGUF stores them pairwise."""
    rows_per_half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, rows_per_half, -1).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(model_dir: Path, gguf_path: Path) -> Path:
    """Write the HF checkpoint in `model_dir` (a tiny_model.build_tiny_model) as a GGUF file.

    Matrices are quantised (the embedding Q8_0, the others Q4_1, as in the default model's file),
    norms stay F32, and no output.weight is written, so readers tie the LM head to the embedding.
    The vocabulary is padded with [PADi] tokens to the model's vocab_size, as llama.cpp pads it.
    """
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(gguf_path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    _add_tokenizer(writer, model_dir, config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    for hf_name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if hf_name == "lm_head.weight":
            continue  # tied: the GGUF reader reuses token_embd
        name, weight = gguf_tensor_name(hf_name), tensor.astype(np.float32)
        if ".attn_q." in name:
            weight = interleave_rope_halves(weight, config.num_attention_heads)
        elif ".attn_k." in name:
            weight = interleave_rope_halves(weight, config.num_key_value_heads)
        if weight.ndim == 1:
            writer.add_tensor(name, weight)
            continue
        qtype = gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else Q4_1
        packed = gguf.quants.quantize(weight, qtype)  # uint8 [rows, bytes per row]
        writer.add_tensor(name, packed, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    tokens += [f"[PAD{index}]" for index in range(len(tokens), vocab_size)]
    specials = {added["content"] for added in tokenizer["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if token in specials else gguf.TokenType.NORMAL
                            for token in tokens])
    writer.add_token_merges(merges)
