"""In fp32 on the native paths a decode's logits do not depend on the rest of its step: the skinny
linear sums a row's products over the same blocks of inputs at every row count (its row-packing
path above 64 rows too), the attention kernel attends a decode the same way in any batch, and a
prompt's queries the same way in any chunking (the scheduler never leaves a prompt token alone in
a step: scheduler_proc/policy.py, without_lone_query). So a greedy request gets the same tokens
alone, or beside a long prompt, or with its own prompt cut into chunks by the step's token budget
(not after a preemption: its recomputed tokens are then prompt queries, not decodes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from native_levels import LEVEL_IDS, VECTOR_LEVELS, vectorised_or_skip
from tiny_model import build_tiny_model
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config

from worker_proc.runner import ModelRunner


@pytest.fixture(scope="module")
def wide_mlp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # an MLP wider than 256: the down projection's inputs span more than one of the first path's
    # former blocks, where a packed step used to sum them differently
    return build_tiny_model(tmp_path_factory.mktemp("wide_mlp"), "llama", intermediate_size=600)


@pytest.fixture(scope="module", params=VECTOR_LEVELS, ids=LEVEL_IDS)
def runner(request: pytest.FixtureRequest, wide_mlp_model: Path) -> ModelRunner:
    """The model on the native kernels built for this CPU, or under each cap below it."""
    vectorised_or_skip(request.param, "skinny_linear_supported")
    config = tiny_engine_config(wide_mlp_model, cpu_isa=request.param, num_kv_blocks=128)
    return ModelRunner(config, rank=0, show_progress=False)


def test_a_decode_gets_the_same_logits_alone_and_beside_a_long_prompt_chunk(runner: ModelRunner) -> None:
    rng = np.random.default_rng(4)
    pool = BlockPool(128, block_size=4)
    seq = Seq("decoding", rng.integers(3, 500, 12).tolist())
    prompt = runner.logits_for_all_tokens(make_plan([seq], [12], pool, step_id=0))
    seq.num_computed = 12
    seq.token_ids.append(int(prompt[-1].argmax()))
    alone = runner.logits_for_all_tokens(make_plan([seq], [1], pool, step_id=1))
    other = Seq("prompt", rng.integers(3, 500, 150).tolist())  # 151 rows: the packed path
    beside = runner.logits_for_all_tokens(make_plan([other, seq], [150, 1], pool, step_id=2))
    assert beside.shape[0] == 151
    assert torch.equal(beside[-1], alone[0])


def test_a_prompt_gets_the_same_logits_whole_and_in_chunks_beside_other_requests(runner: ModelRunner) -> None:
    rng = np.random.default_rng(5)
    pool = BlockPool(128, block_size=4)
    prompt = rng.integers(3, 500, 90).tolist()
    whole = runner.logits_for_all_tokens(make_plan([Seq("whole", list(prompt))], [90], pool))
    chunked, parts = Seq("chunked", list(prompt)), []
    for step, n in enumerate([7, 70, 13]):  # 70 + the other's 40: the packed path
        other = Seq(f"other{step}", rng.integers(3, 500, 40).tolist())
        logits = runner.logits_for_all_tokens(make_plan([chunked, other], [n, 40], pool, step_id=step + 1))
        parts.append(logits[:n])
        chunked.num_computed += n
    assert torch.equal(torch.cat(parts), whole)
