"""Our jinja chat template rendering matches transformers' apply_chat_template exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from frontend.chat_template import ChatTemplateError
from frontend.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Héllo 你好 🙂"}],
]

# Exercises what real templates use: bos_token, raise_exception, tojson, loop controls,
# namespace, whitespace control and indented blocks (trim_blocks / lstrip_blocks).
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}{% if ns.system and loop.first %} [{{ ns.system }}]{% endif %}

    {{- '\\n' + message['content'] | trim }}<|im_end|>
{% endfor %}
{% if tools is not none %}tools={{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def hf_tokenizer(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def rich_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rich-template")
    shutil.copy(tiny_model_dir / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>", chat_template=RICH_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tiny_template_renders_like_transformers(tiny_model_dir, tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer(tiny_model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tokenizer.render_chat(messages, add_generation_prompt) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_rich_template_renders_and_tokenizes_like_transformers(rich_model_dir, messages):
    ours = Tokenizer.from_dir(rich_model_dir)
    hf = hf_tokenizer(rich_model_dir)
    assert ours.render_chat(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                add_generation_prompt=True)
    hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert ours.encode_chat(messages) == list(hf_ids)


def test_template_raise_exception_becomes_a_chat_template_error(rich_model_dir):
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        Tokenizer.from_dir(rich_model_dir).render_chat([{"role": "robot", "content": "beep"}])


def test_tokenizer_reads_special_tokens_and_vocab(tokenizer):
    assert 0 < tokenizer.vocab_size <= 512  # BPE training stops early: below the model vocab
    assert tokenizer.eos_token_id == tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
    assert tokenizer.bos_token_id is None
    assert tokenizer.special_tokens["eos_token"] == "<|im_end|>"


def test_chat_template_file_wins_over_the_config_entry(rich_model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(rich_model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "hey"}]) == "hey!"


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
