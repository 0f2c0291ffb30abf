"""The sampler's grammar mask: packed int32 rows applied to logits, checked against a Python reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_proc.grammar_mask import apply_token_bitmask_, disallowed_tokens


def _pack(allowed: np.ndarray) -> torch.Tensor:
    """Reference packing: bool [rows, vocab] -> int32 [rows, ceil(vocab / 32)], bit t % 32 of word t // 32."""
    rows, vocab = allowed.shape
    words = np.zeros((rows, -(-vocab // 32)), dtype=np.uint32)
    for r in range(rows):
        for t in range(vocab):
            if allowed[r, t]:
                words[r, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


@pytest.mark.parametrize("vocab_size", [32, 33, 100, 49152])
def test_unpacking_gives_back_every_bit_including_the_sign_bit(vocab_size: int) -> None:
    rng = np.random.default_rng(vocab_size)
    allowed = rng.random((3, vocab_size)) < 0.5
    allowed[:, 31::32] = True  # bit 31 is the int32 sign bit
    if vocab_size > 2000:
        allowed = allowed[:, :vocab_size]
        packed = torch.from_numpy(np.packbits(allowed, axis=1, bitorder="little").view(np.int32))
    else:
        packed = _pack(allowed)
    np.testing.assert_array_equal(disallowed_tokens(packed, vocab_size).numpy(), ~allowed)


def test_only_the_listed_rows_are_masked_and_allowed_logits_are_untouched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    before = logits.clone()
    allowed = np.zeros((2, 70), dtype=bool)
    allowed[0, [0, 5, 63, 69]] = True
    allowed[1, 31] = True
    apply_token_bitmask_(logits, _pack(allowed), torch.tensor([3, 1]))
    for row in (0, 2):
        torch.testing.assert_close(logits[row], before[row])
    for mask_row, row in ((0, 3), (1, 1)):
        for t in range(70):
            expected = before[row, t].item() if allowed[mask_row, t] else float("-inf")
            assert logits[row, t].item() == expected


def test_masked_greedy_row_picks_the_best_allowed_token() -> None:
    logits = torch.tensor([[5.0, 1.0, 3.0, 4.0]])
    allowed = np.array([[False, True, True, False]])
    apply_token_bitmask_(logits, _pack(allowed), torch.tensor([0]))
    assert logits.argmax(dim=-1).item() == 2


def test_bfloat16_logits_and_no_constrained_rows() -> None:
    logits = torch.zeros(2, 40, dtype=torch.bfloat16)
    apply_token_bitmask_(logits, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    assert torch.isfinite(logits).all()
    apply_token_bitmask_(logits, _pack(np.eye(1, 40, 7, dtype=bool)), torch.tensor([1]))
    assert torch.isinf(logits[1]).sum().item() == 39 and logits[1, 7].item() == 0


SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["fox", "dog"]}, "xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["ok", "n", "tag", "xs"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_masked_sampling_from_random_logits_always_yields_a_valid_document(tmp_path, seed: int) -> None:
    """The scheduler's rows (llguidance's layout) applied by the worker: whatever the logits, the
    output parses and validates, and EOS is sampled only where the grammar accepts."""
    import json

    import tokenizers

    from proto.grammar import GrammarSpec
    from scheduler_proc.grammar import GrammarTable, fill_bitmask
    from tiny_model import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path)
    backend = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    eos, vocab_size = backend.token_to_id("<|im_end|>"), 520
    table = GrammarTable.from_model_dir(tmp_path, vocab_size, [eos])
    grammar, bitmask = table.start(GrammarSpec.json_schema(SCHEMA)), table.allocate_bitmask(1)
    torch.manual_seed(seed)  # the sampling draws too
    generator, output = torch.Generator().manual_seed(seed), []
    for _ in range(300):
        logits = torch.randn(1, vocab_size, generator=generator)
        logits[0, eos] += 4.0  # end as soon as the grammar lets it
        rows = torch.from_numpy(fill_bitmask([grammar], bitmask))
        apply_token_bitmask_(logits, rows, torch.tensor([0]))
        token_id = int(torch.distributions.Categorical(logits=logits[0]).sample().item())
        assert token_id != eos or grammar.is_accepting
        grammar.advance(token_id)
        if token_id == eos:
            break
        output.append(token_id)
    document = json.loads(backend.decode(output))
    assert set(document) == {"ok", "n", "tag", "xs"} and document["tag"] in ("fox", "dog")
    assert isinstance(document["ok"], bool) and 0 <= document["n"] <= 99 and len(document["xs"]) <= 3
