"""deploy: size parsing, model resolution and model facts, with clear errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from deploy.cli import config_from_args, main, parse_origins, parse_size
from deploy.launcher import Stack, StartupError
from deploy.model_info import ModelError, read_model_info, resolve_model_facts
from deploy.model_source import resolve_model
from proto.config import EngineConfig
from proto.errors import ValidationError


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5G", 1_500_000_000), ("4096", 4096), ("64 kib", 65536),
])
def test_memory_sizes_parse_with_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "2 parsecs", "-1G", ""])
def test_bad_memory_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a memory size"):
        parse_size(text)


@pytest.mark.parametrize("text, expected", [
    ("*", ("*",)), ("", ()), ("https://ui.example, http://localhost:3000", ("https://ui.example", "http://localhost:3000")),
])
def test_allowed_origins_parse_as_browsers_send_them(text: str, expected: tuple[str, ...]) -> None:
    assert parse_origins(text) == expected


@pytest.mark.parametrize("text", ["https://ui.example/", "ui.example", "https://ui.example/chat"])
def test_an_origin_with_a_path_or_no_scheme_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="scheme://host"):
        parse_origins(text)


def test_allowed_origins_travel_to_the_children_in_the_config() -> None:
    config = EngineConfig(model="m", allowed_origins=("https://ui.example",))
    assert EngineConfig.from_json(config.to_json()) == config


def test_model_info_reads_vocab_context_and_merged_eos_ids(tiny_model_dir: Path) -> None:
    info = read_model_info(tiny_model_dir)
    assert (info.vocab_size, info.max_position_embeddings) == (512, 512)
    assert info.eos_token_ids == (2,)
    assert info.architecture == "LlamaForCausalLM"


def test_a_directory_without_config_is_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no config.json"):
        read_model_info(tmp_path)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match="GPT2LMHeadModel"):
        read_model_info(tmp_path)


def test_an_unknown_model_name_is_refused_without_a_download(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelError, match="neither a local directory nor in the local Hugging Face cache"):
        resolve_model("someone/some-model")


def test_a_model_in_the_local_hf_cache_is_found(tmp_path: Path, tiny_model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(tiny_model_dir)
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("acme/tiny") == snapshot
    assert config_from_args(_serve_args("acme/tiny")).served_model_name == "acme/tiny"  # not "abc123"
    assert config_from_args(_serve_args("acme/tiny", "--served-model-name", "t")).served_model_name == "t"


def _serve_args(model: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    from deploy.cli import add_serve_arguments

    add_serve_arguments(parser)
    return parser.parse_args([model, *extra])


def test_serve_arguments_become_an_engine_config_with_model_facts(tiny_model_dir: Path) -> None:
    config = config_from_args(_serve_args(str(tiny_model_dir), "--max-num-seqs", "8",
                                          "--kv-cache-memory", "64MiB", "--scheduling", "static",
                                          "--attention-backend", "torch"))
    assert (config.max_num_seqs, config.kv_cache_memory_bytes, config.scheduling) == (8, 64 << 20, "static")
    assert config.attention_backend == "torch"
    assert (config.vocab_size, config.max_model_len, config.eos_token_ids) == (512, 512, (2,))
    assert config.served_model_name == tiny_model_dir.name


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="does not divide the model's 4 attention heads"):
        config_from_args(_serve_args(str(tiny_model_dir), "--tensor-parallel-size", "3"))


def test_a_max_model_len_beyond_the_context_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="exceeds the model's context length 512"):
        config_from_args(_serve_args(str(tiny_model_dir), "--max-model-len", "4096"))


def test_unresolved_model_facts_become_the_model_s_and_given_ones_stay(tiny_model_dir: Path) -> None:
    info = read_model_info(tiny_model_dir)
    resolved = resolve_model_facts(EngineConfig(model=str(tiny_model_dir)), info)
    assert (resolved.max_model_len, resolved.vocab_size) == (512, 512)
    assert resolved.served_model_name == tiny_model_dir.name
    given = resolve_model_facts(EngineConfig(model=str(tiny_model_dir), max_model_len=128, vocab_size=600),
                                info)
    assert (given.max_model_len, given.vocab_size) == (128, 600)
    assert resolve_model_facts(resolved, info) == resolved
    with pytest.raises(ValidationError, match="--max-model-len 513 exceeds the model's context length 512"):
        resolve_model_facts(EngineConfig(max_model_len=513), info)


def test_a_stack_resolves_model_facts_before_any_process_starts(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="has no config.json"):
        with Stack(EngineConfig(model=str(tmp_path))) as stack:
            pytest.fail(f"started {stack.children} without the model's context length")


def test_serve_exits_with_a_clear_error_for_a_missing_model(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "nowhere" / "x"
    assert main(["serve", str(missing)]) == 2
    errors = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert len(errors) == 1, errors
    assert str(missing) in errors[0] and "neither a local directory" in errors[0], errors[0]


def test_the_api_key_comes_from_its_environment_variable_unless_the_flag_gives_one(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_API_KEY", "from-env")
    assert config_from_args(_serve_args(str(tiny_model_dir))).api_key == "from-env"
    assert config_from_args(_serve_args(str(tiny_model_dir), "--api-key", "flag")).api_key == "flag"
    monkeypatch.delenv("CONVEYOR_API_KEY")
    assert config_from_args(_serve_args(str(tiny_model_dir))).api_key == ""


@pytest.mark.parametrize("flags, message", [
    (["--max-num-seqs", "-1"], "--max-num-seqs: max_num_seqs must be >= 1, got -1"),
    (["--port", "99999"], "--port: port must be a TCP port, 0-65535 (0: any free one), got 99999"),
    (["--client-timeout", "0"], "--client-timeout: client_timeout_s must be > 0 seconds, got 0.0"),
    (["--max-request-body-size", "0"], "--max-request-body-size: max_request_body_bytes must be >= 1, got 0"),
])
def test_a_bad_flag_value_is_refused_naming_the_flag(tiny_model_dir: Path, flags: list[str], message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        config_from_args(_serve_args(str(tiny_model_dir), *flags))
    assert str(refused.value) == message


def test_a_max_model_len_of_one_token_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="--max-model-len: max_model_len must be at least 2"):
        config_from_args(_serve_args(str(tiny_model_dir), "--max-model-len", "1"))
