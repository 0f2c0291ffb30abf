"""KV cache sizing and checkpoint loading: tied embeddings, aliases, missing and unknown tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from native_levels import VECTOR_LEVELS
from tiny_model import build_tiny_model
from safetensors.torch import load_file, save_file
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config

from proto.config import EngineConfig
from worker_proc.attention.reference import TorchPagedAttention
from worker_proc.kv_cache import KVLayout, num_kv_blocks_for
from worker_proc.loader import load_model
from worker_proc.model_config import load_model_config, parse_model_config
from worker_proc.runner import ModelRunner

TINY_BYTES_PER_BLOCK_FP32 = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, dim 16


def test_kv_blocks_fill_the_memory_budget_unless_a_count_is_given(tiny_model_dir: Path) -> None:
    model = load_model_config(tiny_model_dir)
    budget = EngineConfig(kv_cache_memory_bytes=10 * TINY_BYTES_PER_BLOCK_FP32 + 7, dtype="float32")
    assert num_kv_blocks_for(budget, model, torch.float32) == 10
    assert num_kv_blocks_for(budget, model, torch.bfloat16) == 20
    assert num_kv_blocks_for(budget.with_updates(num_kv_blocks=3), model, torch.float32) == 3
    with pytest.raises(ValueError, match=r"--kv-cache-memory \(100 bytes\) holds no KV block .*: pass "
                                         f"--kv-cache-memory {TINY_BYTES_PER_BLOCK_FP32} or more"):
        num_kv_blocks_for(EngineConfig(kv_cache_memory_bytes=100), model, torch.float32)


def test_runner_allocates_and_reports_the_configured_cache(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_engine_config(tiny_model_dir, num_kv_blocks=0, block_size=16,
                                            kv_cache_memory_bytes=5 * TINY_BYTES_PER_BLOCK_FP32),
                         rank=0, show_progress=False)
    assert runner.num_kv_blocks == 5
    assert runner.kv_cache.num_blocks == 5
    # The CPU reference backend keeps K/V heads-major: [kv_heads, num_blocks, block_size, head_dim].
    assert runner.kv_cache.layout is KVLayout.HEADS_MAJOR
    assert runner.kv_cache.k_blocks[0].shape == (2, 5, 16, 16)
    assert len(runner.kv_cache.v_blocks) == 2


def test_tied_checkpoint_uses_the_embedding_as_lm_head(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(model_dir / "model.safetensors"))
    model = load_model(model_dir, "float32", TorchPagedAttention(), show_progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_checkpoint_without_lm_head_is_tied_even_if_config_says_untied(tmp_path: Path,
                                                                       tiny_model_dir: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "no-head")
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(model_dir, "float32", TorchPagedAttention(), show_progress=False)
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_safetensors_shared_tensor_alias_resolves_to_the_kept_tensor(tmp_path: Path,
                                                                     tiny_model_dir: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "alias")
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["lm_head.weight"]  # what safetensors.save_model does to a shared tensor
    save_file(tensors, str(model_dir / "model.safetensors"),
              metadata={"format": "pt", "lm_head.weight": "model.embed_tokens.weight"})
    model = load_model(model_dir, "float32", TorchPagedAttention(), show_progress=False)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # config says untied
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "sharded")
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for part, chunk in enumerate([names[::2], names[1::2]]):
        filename = f"model-{part + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(model_dir / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, filename))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(model_dir, "float32", TorchPagedAttention(), show_progress=False)
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expected)


def test_missing_or_unknown_tensors_fail_loudly(tmp_path: Path, tiny_model_dir: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "broken")
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"gate_up_proj.weight\[1\]"):
        load_model(model_dir, "float32", TorchPagedAttention(), show_progress=False)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 64)
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mystery"):
        load_model(model_dir, "float32", TorchPagedAttention(), show_progress=False)


def test_bfloat16_weights_and_cache_are_used_when_asked(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_engine_config(tiny_model_dir, dtype="bfloat16"), rank=0,
                         show_progress=False)
    assert runner.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert runner.kv_cache.k_blocks[0].dtype == torch.bfloat16
    seq = Seq("a", [5, 6, 7, 8])
    tokens = runner.execute(make_plan([seq], [4], BlockPool(64, block_size=4))).sampled_token_ids
    assert tokens.dtype == np.int32 and tokens.shape == (1,)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_bfloat16_kv_cache_under_a_float32_model(tiny_model_dir: Path, backend: str) -> None:
    """--kv-cache-dtype bfloat16: fp32 weights, a bf16 cache with twice the blocks in the same
    memory: logits within bf16 rounding of the all-fp32 run's, not equal to them (both backends
    attend in fp32 over the rounded K/V: the reference widens what it gathers, the native kernel
    takes its mixed path)."""
    memory = dict(num_kv_blocks=0, block_size=4, kv_cache_memory_bytes=64 * TINY_BYTES_PER_BLOCK_FP32 // 4,
                  attention_backend=backend)
    full = ModelRunner(tiny_engine_config(tiny_model_dir, **memory), rank=0, show_progress=False)
    half = ModelRunner(tiny_engine_config(tiny_model_dir, kv_cache_dtype="bfloat16", **memory), rank=0,
                       show_progress=False)
    assert half.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    assert half.kv_cache.k_blocks[0].dtype == half.kv_cache.v_blocks[0].dtype == torch.bfloat16
    assert (full.num_kv_blocks, half.num_kv_blocks) == (64, 128)
    logits = []
    for runner in (full, half):
        pool, seqs = BlockPool(64, block_size=4), [Seq("a", [5, 6, 7, 8, 9, 10, 11]), Seq("b", [3, 4, 5])]
        first = runner.logits_for_all_tokens(make_plan(seqs, [7, 2], pool))  # prompts, one of them chunked
        seqs[0].num_computed, seqs[1].num_computed = 7, 2
        seqs[0].token_ids.append(12)
        second = runner.logits_for_all_tokens(make_plan(seqs, [1, 1], pool, step_id=1))  # a decode, the chunk's end
        logits.append(torch.cat([first, second]))
    torch.testing.assert_close(logits[1], logits[0], atol=0.05, rtol=0.05)
    assert not torch.equal(logits[1], logits[0])  # the cache rounds K and V to bf16


def test_a_float32_model_hands_the_reference_float32_queries_over_a_bfloat16_cache(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference attends in the model's dtype (it widens what it gathers), so the model does not
    cast q, k and v to the cache's bf16 for it; nor for the native kernel where it takes its mixed
    path (the tiny model's head_dim 16 has no AVX-512 path, so on every CPU with AVX2 it does), else
    the kernel reads them in the cache's dtype; and a bf16 model over an fp32 cache attends in fp32
    (a wider cache is never narrowed)."""
    from worker_proc.attention import AttentionBackendError
    from worker_proc.attention.native import NativePagedAttention
    from worker_proc.attention.reference import TorchPagedAttention

    seen, native_mixes = [], None
    for cls in (TorchPagedAttention, NativePagedAttention):
        real = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, q, k, v, *rest, real=real: (
            seen.append((type(self).__name__, q.dtype, k.dtype)) or real(self, q, k, v, *rest)))
    for backend, dtype, kv_cache_dtype in [("torch", "float32", "bfloat16"), ("native", "float32", "bfloat16"),
                                           ("torch", "bfloat16", "float32")]:
        try:
            runner = ModelRunner(tiny_engine_config(tiny_model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                                    attention_backend=backend), rank=0, show_progress=False)
        except AttentionBackendError:  # no native kernel here (no compiler)
            continue
        if backend == "native":
            native_mixes = runner.attention.mixed_dtypes
        runner.model.native_decoder = None  # the layers one by one, through the backend's forward
        runner.logits_for_all_tokens(make_plan([Seq("a", [5, 6, 7])], [3], BlockPool(64, block_size=4)))
    by_backend = {name: {(q, k) for other, q, k in seen if other == name} for name, _, _ in seen}
    assert by_backend["TorchPagedAttention"] == {(torch.float32, torch.float32)}
    if native_mixes is not None:
        native_dtype = torch.float32 if native_mixes else torch.bfloat16
        assert by_backend["NativePagedAttention"] == {(native_dtype, native_dtype)}
    if "avx2" in VECTOR_LEVELS and native_mixes is not None:  # the kernel's mixed path runs here
        assert native_mixes


def test_config_accepts_old_and_new_rope_formats() -> None:
    base = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=4)
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    new = parse_model_config({**base, "rope_parameters": {"rope_theta": 5e5, **scaling}})
    old = parse_model_config({**base, "rope_theta": 5e5, "rope_scaling": scaling})
    assert (new.rope_theta, new.rope_scaling) == (old.rope_theta, old.rope_scaling) == (5e5, scaling)
    assert new.head_dim == 16 and new.num_kv_heads == 4
    with pytest.raises(ValueError, match="model_type"):
        parse_model_config({**base, "model_type": "gpt2"})


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
