"""A tiny random model of each supported family (with a real byte-level BPE tokenizer), in HF format."""

from __future__ import annotations

import json
from pathlib import Path

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching admits new requests between two forward passes.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "What is the capital of France? The capital of France is Paris.",
    "Héllo wörld — ünïcode 你好 🙂 emoji and accents are multi-byte.",
] * 20


def build_tiny_tokenizer(out_dir: Path) -> None:
    """Train a 512-token byte-level BPE and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": "<|im_end|>", "unk_token": None, "pad_token": "<|endoftext|>",
              "chat_template": TINY_CHAT_TEMPLATE, "model_max_length": 512}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def build_tiny_model(out_dir: Path, arch: str = "llama", **overrides: object) -> Path:
    """Save a random tiny model of the given family (llama, qwen2, qwen3, mistral) in HF format."""
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(out_dir)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
                  pad_token_id=0)
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    torch.manual_seed(0)
    model = model_cls(config_cls(**common)).eval()
    with torch.no_grad():  # larger weights than the default init: logits that actually vary
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(str(out_dir))
    return out_dir
