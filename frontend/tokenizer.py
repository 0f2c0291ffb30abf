"""Text <-> token ids for the frontend, from tokenizer.json and tokenizer_config.json (no transformers)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers

from frontend.chat_template import render_chat_template

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                       "cls_token", "mask_token")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback
_SENTENCEPIECE_SPACE = "\u2581"


class Tokenizer:
    """The frontend's only view of the vocabulary. Owns the chat template; never touches tensors."""

    def __init__(self, backend: tokenizers.Tokenizer, tokenizer_config: dict[str, Any],
                 chat_template: str | None) -> None:
        self._backend = backend
        self.special_tokens = _special_tokens(tokenizer_config)
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        backend_json = json.loads(backend.to_str())
        decoder_types = _decoder_types(backend_json.get("decoder"))
        self._byte_level = "ByteLevel" in decoder_types
        self._sentencepiece = bool({"ByteFallback", "Metaspace"} & decoder_types)
        self._token_bytes: dict[int, bytes] = {}
        # 0 = no bound known: the text's length then says nothing about its token count.
        self.max_token_bytes = self._longest_piece() if covers_every_byte(backend_json) else 0

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load a Hugging Face model directory; raise FileNotFoundError/ValueError saying what is wrong."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {model_dir}: the frontend needs a fast (tokenizers) tokenizer")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception for malformed files
            raise ValueError(f"cannot load {tokenizer_file}: {exc}") from exc
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(backend, config, _find_chat_template(model_dir, config))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode does not), so a long prompt
        # tokenized in a worker thread leaves the event loop free for other clients.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def backend_json(self) -> str:
        """The tokenizer.json text (llguidance builds its token table from it)."""
        return self._backend.to_str()

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, known without tokenizing it: every token stands
        for at most `max_token_bytes` of the text's bytes (and a character is at least one byte)."""
        return -(-len(text) // self.max_token_bytes) if self.max_token_bytes else 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, extra: Mapping[str, Any] | None = None) -> str:
        """The prompt text for `messages` (`extra`: more template variables); raises
        ChatTemplateError (or ValueError without a template)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template: use /v1/completions with a plain prompt")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    self.special_tokens, tools, extra)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template already writes bos and friends, so encoding must not add them again.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def token_piece(self, token_id: int) -> str:
        """The vocabulary's own spelling of the token (e.g. "Ġthe" in a byte-level BPE)."""
        return self._backend.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, even when they are only part of a UTF-8 character."""
        found = self._token_bytes.get(token_id)
        if found is None:
            found = self._token_bytes[token_id] = self._piece_bytes(token_id)
        return found

    def token_text(self, token_id: int) -> str:
        """One token as text (logprobs): its bytes, with U+FFFD where they split a character."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self._backend.id_to_token(token_id)
        if piece is None:  # beyond the tokenizer's vocabulary (a padded embedding row)
            return b""
        if self._byte_level and all(char in _BYTE_OF_CHAR for char in piece):
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        if self._sentencepiece:
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace(_SENTENCEPIECE_SPACE, " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def _longest_piece(self) -> int:
        return max(len(self._piece_bytes(token_id)) for token_id in range(self.vocab_size))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet: printable Latin-1 bytes stand for themselves, every other byte
    for chr(256 + n), n counting those bytes in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet, num_shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + num_shifted)] = byte
            num_shifted += 1
    return alphabet


_BYTE_OF_CHAR = _byte_level_alphabet()


def covers_every_byte(backend_json: dict[str, Any]) -> bool:
    """Whether each token stands for a piece of the client's text itself: no normalizer or
    pre-tokenizer that drops or merges characters, and no unknown token that swallows a run of
    them. True for the Llama family's byte-level and byte-fallback BPE tokenizers."""
    model = backend_json.get("model") or {}
    lossless_model = model.get("type") == "BPE" and (model.get("byte_fallback") or not model.get("fuse_unk"))
    return (lossless_model and _only_growing(backend_json.get("normalizer"), _GROWING_NORMALIZERS)
            and _only_growing(backend_json.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS))


_GROWING_NORMALIZERS = frozenset({"Prepend", "Replace"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})


def _only_growing(step: dict[str, Any] | None, kinds: frozenset[str]) -> bool:
    """A normalizer or pre-tokenizer (or a Sequence of them) that never shortens the text."""
    if step is None:
        return True
    if step.get("type") == "Sequence":
        members = step.get("normalizers") or step.get("pretokenizers") or []
        return all(_only_growing(member, kinds) for member in members)
    if step.get("type") not in kinds or step.get("behavior") == "Removed":
        return False
    if step.get("type") == "Replace":  # only a plain string replaced by one at least as long
        pattern = (step.get("pattern") or {}).get("String")
        return isinstance(pattern, str) and len(step.get("content", "").encode()) >= len(pattern.encode())
    return True


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    """The types of a tokenizer.json decoder and of the members of a Sequence decoder."""
    if not isinstance(decoder, dict):
        return set()
    members = decoder.get("decoders") or []
    return {decoder.get("type", "")} | {m.get("type", "") for m in members if isinstance(m, dict)}


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as plain strings; entries may be strings or AddedToken dicts."""
    found = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[key] = value
    return found


def _find_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    # Newer checkpoints keep the template in its own file, which then wins over the config entry.
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
