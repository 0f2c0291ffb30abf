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


def _prompt_ids(tokenizer: Tokenizer, messages: list[dict], **rendering: object) -> list[int]:
    from frontend.prompt_text import chat_prompt_ids
    from frontend.protocol import ChatMessage, ChatRendering

    return chat_prompt_ids([ChatMessage(**m) for m in messages], tokenizer, ChatRendering(**rendering), 512)


@pytest.mark.parametrize("which", ["tiny", "rich"])
def test_continue_final_message_ends_the_prompt_inside_it_like_transformers(tiny_model_dir, rich_model_dir, which):
    model_dir = tiny_model_dir if which == "tiny" else rich_model_dir
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    ours = _prompt_ids(Tokenizer.from_dir(model_dir), messages, add_generation_prompt=False,
                       continue_final_message=True)
    hf = hf_tokenizer(model_dir)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert ours == hf(text, add_special_tokens=False).input_ids
    assert Tokenizer.from_dir(model_dir).decode(ours, skip_special_tokens=False).endswith("My favourite is")


def test_continue_final_message_with_a_generation_prompt_is_refused(tokenizer):
    from frontend.errors import APIError

    with pytest.raises(APIError, match="cannot both be true") as raised:
        _prompt_ids(tokenizer, [{"role": "user", "content": "hi"}], continue_final_message=True)
    assert raised.value.param == "continue_final_message"


def test_chat_template_kwargs_reach_the_template_and_may_not_set_its_own_variables(rich_model_dir, tmp_path):
    from frontend.errors import APIError

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(rich_model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{{ messages[0]['content'] }}{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")
    tokenizer = Tokenizer.from_dir(tmp_path)
    user = [{"role": "user", "content": "hey"}]
    assert tokenizer.decode(_prompt_ids(tokenizer, user)) == "hey"
    assert tokenizer.decode(_prompt_ids(tokenizer, user, chat_template_kwargs={"enable_thinking": False})) == \
        "hey /no_think"
    with pytest.raises(APIError, match="may not set add_generation_prompt, messages"):
        _prompt_ids(tokenizer, user, chat_template_kwargs={"messages": [], "add_generation_prompt": 1})
    # names of the renderer's own parameters are just more template variables
    assert tokenizer.decode(_prompt_ids(tokenizer, user, chat_template_kwargs={
        "tokenizer": 1, "source": 2, "special_tokens": 3, "self": 4, "extra": 5})) == "hey"
