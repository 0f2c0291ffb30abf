"""The sampler: per-row params in one vectorised pass, seeded noise independent of batch-mates."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from worker_plans import BlockPool, Seq, make_plan

from worker_proc.sampler import SamplingBatch, adjust_logits, sample, sampling_batch_from_plan

VOCAB = 300


def sampling_batch(seqs: list[Seq]) -> SamplingBatch:
    """Every seq decodes its last known token this step, so every one samples."""
    for seq in seqs:
        seq.num_computed = len(seq.token_ids) - 1
    plan = make_plan(seqs, [1] * len(seqs), BlockPool(len(seqs), block_size=16))
    members = np.flatnonzero(plan.sample_mask)
    positions = plan.num_computed_tokens[members] + plan.num_scheduled_tokens[members]
    return sampling_batch_from_plan(plan, members, positions)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def seq(**params: object) -> Seq:
    tokens = params.pop("token_ids", [1, 2, 3])
    return Seq("r", list(tokens), **params)


MIXED_ROWS = [
    dict(temperature=0.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=20, top_p=0.9),
    dict(temperature=1.0),
    dict(temperature=0.05, top_k=-1),
    dict(temperature=2.0, top_k=1),
    dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3,
         token_ids=[4, 5, 5, 6], num_prompt=2),
    dict(temperature=1.0, logit_bias=[(7, 5.0), (8, float("-inf"))]),
]


@pytest.mark.parametrize("trial", range(5))
def test_each_row_gets_the_same_token_alone_as_in_a_mixed_batch(trial: int) -> None:
    logits = random_logits(len(MIXED_ROWS), seed=trial)
    rows = [seq(seed=1000 * trial + i, **params) for i, params in enumerate(MIXED_ROWS)]
    together = sample(logits.clone(), sampling_batch(rows))
    for i, params in enumerate(MIXED_ROWS):
        alone = sample(logits[i:i + 1].clone(), sampling_batch([seq(seed=1000 * trial + i, **params)]))
        assert together[i] == alone[0], f"row {i} {params}"


def test_same_seed_and_position_give_the_same_token_and_other_positions_vary() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: the token is decided by the noise alone
    first = sample(logits.clone(), sampling_batch([seq(temperature=1.0, seed=42)]))
    again = sample(logits.clone(), sampling_batch([seq(temperature=1.0, seed=42)]))
    assert first == again
    later = {int(sample(logits.clone(), sampling_batch([seq(temperature=1.0, seed=42,
                                                            token_ids=[1] * n)]))[0])
             for n in range(2, 12)}
    assert len(later) > 5


def test_greedy_rows_take_the_argmax_exactly() -> None:
    logits = random_logits(6, seed=3)
    tokens = sample(logits.clone(), sampling_batch([seq(temperature=0.0, seed=i) for i in range(6)]))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_1_equals_greedy_at_any_temperature() -> None:
    logits = random_logits(8, seed=4)
    rows = [seq(temperature=t, top_k=1, seed=i) for i, t in enumerate([0.5, 1.0, 3.0, 10.0] * 2)]
    assert torch.equal(sample(logits.clone(), sampling_batch(rows)), logits.argmax(dim=-1))


def test_logit_bias_can_force_a_token_and_minus_inf_forbids_one() -> None:
    logits = random_logits(2, seed=5)
    best = int(logits[1].argmax())
    rows = [seq(temperature=0.0, logit_bias=[(17, 100.0)]),
            seq(temperature=0.0, logit_bias=[(best, float("-inf"))])]
    tokens = sample(logits.clone(), sampling_batch(rows))
    assert tokens[0] == 17
    assert tokens[1] == int(logits[1].topk(2).indices[1])
    for trial in range(20):  # a masked token is never drawn, whatever the noise
        row = seq(temperature=5.0, seed=trial, logit_bias=[(t, float("-inf")) for t in range(VOCAB - 1)])
        assert sample(logits[:1].clone(), sampling_batch([row]))[0] == VOCAB - 1


def test_penalties_change_exactly_the_logits_hf_and_openai_would() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    # prompt [0, 1], output [2, 2, 3]: repetition over all of them, presence/frequency over output
    row = Seq("r", [0, 1, 2, 2, 3], num_prompt=2, temperature=1.0, repetition_penalty=2.0,
              presence_penalty=0.5, frequency_penalty=0.25)
    adjusted = logits.clone()
    adjust_logits(adjusted, sampling_batch([row]))
    expected = torch.tensor([[2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 2 * 0.25, 3.0 / 2 - 0.5 - 0.25,
                              -2.0, 1.0]])
    torch.testing.assert_close(adjusted, expected, atol=1e-6, rtol=0)


def test_rows_without_penalties_are_untouched_next_to_rows_with_them() -> None:
    logits = random_logits(2, seed=6)
    rows = [seq(temperature=1.0, token_ids=[5, 6, 7]),
            seq(temperature=1.0, repetition_penalty=1.3, token_ids=[5, 6, 7])]
    adjusted = logits.clone()
    adjust_logits(adjusted, sampling_batch(rows))
    assert torch.equal(adjusted[0], logits[0])
    assert not torch.equal(adjusted[1], logits[1])


def test_top_k_top_p_and_min_p_only_ever_draw_allowed_tokens() -> None:
    logits = random_logits(1, seed=7)
    order = logits[0].argsort(descending=True)
    probs = logits[0].softmax(-1)
    nucleus_size = int((probs[order].cumsum(0) - probs[order] < 0.6).sum())
    allowed = {
        "top_k": (dict(top_k=4), set(order[:4].tolist())),
        "top_p": (dict(top_p=0.6), set(order[:nucleus_size].tolist())),
        "min_p": (dict(min_p=0.2), set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())),
    }
    for name, (params, tokens) in allowed.items():
        rows = [seq(temperature=1.0, seed=s, **params) for s in range(200)]
        drawn = set(sample(logits.repeat(200, 1), sampling_batch(rows)).tolist())
        assert drawn <= tokens, name
        assert len(drawn) > 1, name


def test_seeded_draws_follow_the_softmax_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    num_draws = 4000
    rows = [seq(temperature=1.0, seed=s) for s in range(num_draws)]
    padded = torch.full((num_draws, VOCAB), -math.inf)
    padded[:, :4] = logits
    counts = np.bincount(sample(padded, sampling_batch(rows)).numpy(), minlength=4)[:4]
    expected = logits[0].softmax(-1).numpy() * num_draws
    assert np.all(np.abs(counts - expected) < 4 * np.sqrt(expected) + 5)
