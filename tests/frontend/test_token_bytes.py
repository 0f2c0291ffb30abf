"""Each token's own bytes and text, as logprobs report them, for byte-level and SentencePiece vocabularies."""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models

from frontend.tokenizer import Tokenizer


def test_byte_level_token_bytes_keep_a_partial_character(tokenizer, tiny_model_dir):
    backend = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    half_of_e_acute = backend.token_to_id("Ã")  # the byte 0xC3: the first half of "é"
    assert tokenizer.token_bytes(half_of_e_acute) == b"\xc3"
    assert tokenizer.token_text(half_of_e_acute) == "\ufffd"
    ids = tokenizer.encode("Héllo wörld", add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == "Héllo wörld".encode()
    assert tokenizer.token_text(tokenizer.eos_token_id) == "<|im_end|>"


def test_sentencepiece_byte_fallback_pieces_are_single_bytes_and_spaces_are_restored():
    vocab = {"<unk>": 0, "<0xE4>": 1, "<0xBD>": 2, "\u2581the": 3, "a": 4}
    backend = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer = Tokenizer(backend, {}, None)
    assert [tokenizer.token_bytes(t) for t in (1, 2, 3, 4)] == [b"\xe4", b"\xbd", b" the", b"a"]
    assert tokenizer.token_text(3) == " the"
    assert tokenizer.token_bytes(99) == b""  # beyond the vocabulary (a padded embedding row)
