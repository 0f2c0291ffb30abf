"""Logprobs of sampled and prompt tokens equal log_softmax of Hugging Face's logits (fp32)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config

from proto import codec
from proto.config import EngineConfig
from proto.messages import StepPlan, StepResult
from worker_proc.logprobs import compute_entries
from worker_proc.null_runner import NULL_OTHER_LOGPROB, NullModelRunner
from worker_proc.runner import ModelRunner

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir),
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(tiny_engine_config(tiny_model_dir, num_kv_blocks=128), rank=0,
                       show_progress=False)


def hf_logprobs(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """float32 [len, vocab]: row q is log P(token at q + 1 | tokens <= q)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def asking(plan: StepPlan, num_logprobs: list[int], num_prompt_logprobs: list[int],
           next_prompt_token_ids: list[int] | None = None) -> StepPlan:
    nexts = next_prompt_token_ids if next_prompt_token_ids is not None else [-1] * plan.num_seqs
    sampling = dataclasses.replace(plan.sampling, logprobs=np.array(num_logprobs, dtype=np.int32),
                                   num_prompt_logprobs=np.array(num_prompt_logprobs, dtype=np.int32),
                                   next_prompt_token_ids=np.array(nexts, dtype=np.int32))
    return dataclasses.replace(plan, sampling=sampling)


def entries_of(result: StepResult) -> list[tuple[int, int, int, float, list[int], list[float], int]]:
    """(row, position, token, logprob, top ids, top logprobs, rank) per entry, after a codec round trip."""
    result = codec.decode(codec.encode(result), type(result))
    out = []
    for e in range(len(result.logprobs.rows)):
        top = slice(result.logprobs.cu_top[e], result.logprobs.cu_top[e + 1])
        out.append((int(result.logprobs.rows[e]), int(result.logprobs.positions[e]), int(result.logprobs.token_ids[e]),
                    float(result.logprobs.logprobs[e]), result.logprobs.top_token_ids[top].tolist(),
                    result.logprobs.top_logprobs[top].tolist(), int(result.logprobs.ranks[e])))
    return out


def assert_entry_matches(entry: tuple, reference: torch.Tensor, num_top: int, ranked: bool = False) -> None:
    """reference: float32 [vocab], the HF log-distribution the entry's token was drawn from; ranked:
    a prompt entry, whose rank counts the tokens at least as likely (within ATOL of a tie: either way)."""
    _, _, token, logprob, top_ids, top_logprobs, rank = entry
    assert logprob == pytest.approx(float(reference[token]), abs=ATOL)
    value = float(reference[token])
    if ranked:
        assert int((reference >= value + ATOL).sum()) <= rank <= int((reference >= value - ATOL).sum())
    else:
        assert rank == 0  # not computed: only prompt_logprobs show ranks
    want = reference.topk(num_top)
    assert top_ids == want.indices.tolist()
    np.testing.assert_allclose(top_logprobs, want.values.numpy(), atol=ATOL)
    assert top_logprobs == sorted(top_logprobs, reverse=True)


def test_sampled_token_logprobs_are_the_raw_model_distribution(runner: ModelRunner,
                                                               hf: torch.nn.Module) -> None:
    pool = BlockPool(128, block_size=4)
    # A penalty, a bias and a temperature change the sampler's view, not the reported logprobs.
    seqs = [Seq("greedy", [5, 9, 13, 17, 21]),
            Seq("hot", [40, 41, 42], temperature=0.7, top_k=5, seed=3, repetition_penalty=1.3,
                logit_bias=[(7, 5.0)]),
            Seq("silent", [60, 61, 62, 63])]
    plan = asking(make_plan(seqs, [5, 3, 4], pool), [3, 0, -1], [-1, -1, -1])
    result = runner.execute(plan)
    entries = entries_of(result)
    assert [(row, pos) for row, pos, *_ in entries] == [(0, 5), (1, 3)]
    assert [tok for _, _, tok, *_ in entries] == result.sampled_token_ids[:2].tolist()
    assert_entry_matches(entries[0], hf_logprobs(hf, seqs[0].token_ids)[-1], 3)
    assert_entry_matches(entries[1], hf_logprobs(hf, seqs[1].token_ids)[-1], 0)


def test_prompt_logprobs_cover_every_position_once_across_chunked_prefill(
        runner: ModelRunner, hf: torch.nn.Module) -> None:
    prompt = [3, 44, 17, 250, 9, 81, 123, 6, 77, 301, 12]
    reference = hf_logprobs(hf, prompt)
    pool = BlockPool(128, block_size=4)
    seq, neighbour = Seq("chunked", list(prompt)), Seq("other", [7, 8, 9, 10, 11, 12])
    seen = []
    for step, n in enumerate([4, 4, 3]):  # 11 prompt tokens in three chunks
        end = seq.num_computed + n
        next_id = prompt[end] if end < len(prompt) else -1
        plan = asking(make_plan([seq, neighbour], [n, 1 if step else 5], pool, step),
                      [2, -1], [4, -1], [next_id, -1])
        entries = entries_of(runner.execute(plan))
        assert all(row == 0 for row, *_ in entries)  # the neighbour asked for nothing
        seen += entries
        seq.num_computed = end
        neighbour.num_computed += 1 if step else 5
        if step == 1:  # it sampled: its next token is known
            neighbour.token_ids.append(2)
    prompt_entries, sampled_entry = seen[:-1], seen[-1]
    assert [pos for _, pos, *_ in prompt_entries] == list(range(1, len(prompt)))
    for _, pos, token, *_ in prompt_entries:
        assert token == prompt[pos]
    for entry in prompt_entries:
        assert_entry_matches(entry, reference[entry[1] - 1], 4, ranked=True)
    assert sampled_entry[1] == len(prompt)
    assert_entry_matches(sampled_entry, reference[-1], 2)


def test_a_rank_counts_the_tokens_at_least_as_likely_so_tied_tokens_share_the_worse_rank() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -2.0]]).expand(3, 4).contiguous()
    args = (logprobs, torch.tensor([1, 2, 3]), np.zeros(3, np.int64), np.arange(3), np.zeros(3, np.int64))
    assert compute_entries(*args, with_ranks=True).ranks.tolist() == [4, 1, 4]  # vLLM's count
    assert compute_entries(*args, with_ranks=False).ranks.tolist() == [0, 0, 0]


def test_plans_without_logprob_fields_produce_no_entries(runner: ModelRunner) -> None:
    plan = make_plan([Seq("a", [5, 6, 7]), Seq("b", [8, 9])], [3, 2], BlockPool(128, block_size=4))
    result = runner.execute(plan)
    assert len(result.logprobs.rows) == 0 and result.logprobs.cu_top.tolist() == [0]
    assert result.sampled_token_ids.shape == (2,)


def test_null_runner_answers_logprob_requests_with_well_formed_entries() -> None:
    runner = NullModelRunner(EngineConfig(null_model=True, vocab_size=50, num_kv_blocks=8), rank=0)
    seqs = [Seq("p", list(range(10, 16))), Seq("s", [1, 2, 3], seed=4), Seq("x", [4, 5])]
    plan = asking(make_plan(seqs, [4, 3, 2], BlockPool(8, block_size=16)), [-1, 2, -1],
                  [3, -1, -1], [14, -1, -1])
    result = runner.execute(plan)
    entries = entries_of(result)
    assert [(row, pos, tok) for row, pos, tok, *_ in entries] == [
        (0, 1, 11), (0, 2, 12), (0, 3, 13), (0, 4, 14), (1, 3, int(result.sampled_token_ids[0]))]
    for _, _, token, logprob, top_ids, top_logprobs, rank in entries:
        assert logprob == 0.0 and top_ids[0] == token and rank == 1
        assert top_logprobs == [0.0] + [NULL_OTHER_LOGPROB] * (len(top_ids) - 1)
    assert [len(e[4]) for e in entries] == [3, 3, 3, 3, 2]
