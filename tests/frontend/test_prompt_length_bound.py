"""The token count a prompt certainly reaches, known from its length alone, never overstates it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.tokenizer import covers_every_byte

PIECES = st.sampled_from(["hello", " world", "  ", "\n\n", "<|im_end|>", "é", "日本", "🙂", "\t", "fox"])


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(max_size=300), st.lists(PIECES, max_size=200).map("".join)))
def test_the_bound_is_at_most_the_real_token_count(tokenizer, text):
    assert tokenizer.min_num_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False))


def test_the_bound_is_tight_enough_to_refuse_a_huge_prompt_without_tokenizing(tokenizer):
    assert 1 < tokenizer.max_token_bytes <= 16  # the tiny vocabulary's longest piece
    assert tokenizer.min_num_tokens("x" * 1_000_000) >= 1_000_000 // tokenizer.max_token_bytes


def test_only_tokenizers_that_keep_every_byte_get_a_bound():
    byte_level = {"model": {"type": "BPE", "byte_fallback": False, "fuse_unk": False},
                  "normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}}
    llama2 = {"model": {"type": "BPE", "byte_fallback": True, "fuse_unk": True},
              "normalizer": {"type": "Sequence", "normalizers": [
                  {"type": "Prepend", "prepend": "▁"},
                  {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
              "pre_tokenizer": None}
    assert covers_every_byte(byte_level) and covers_every_byte(llama2)
    shrinking = [
        {**byte_level, "normalizer": {"type": "NFKC"}},
        {**byte_level, "normalizer": {"type": "Replace", "pattern": {"String": "  "}, "content": " "}},
        {**byte_level, "pre_tokenizer": {"type": "Whitespace"}},
        {**byte_level, "pre_tokenizer": {"type": "Split", "behavior": "Removed"}},
        {**byte_level, "model": {"type": "WordPiece"}},
        {**byte_level, "model": {"type": "BPE", "byte_fallback": False, "fuse_unk": True}},
    ]
    assert not any(covers_every_byte(config) for config in shrinking)
