"""Every decoder layer of a CPU step in one native call (layers.native_decoder) computes what the
layers compute one by one, bit for bit: the hidden states of every row and of any chosen rows, and
every K/V row it caches; bad slots and block tables are errors that name them, and the runner goes
on serving."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from native_levels import LEVEL_IDS, VECTOR_LEVELS, vectorised_or_skip
from tiny_model import build_tiny_model
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config

from proto.messages import StepPlan
from worker_proc.runner import ModelRunner

# (architecture, model dtype, KV cache dtype): qwen2 has q/k/v biases; an fp32 model over a bf16
# cache is the attention's mixed path
CASES = [("llama", "float32", "auto"), ("qwen2", "float32", "auto"), ("llama", "float32", "bfloat16"),
         ("llama", "bfloat16", "auto")]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoder_models")
    # an MLP wider than the skinny kernel's blocks of inputs, and a prompt longer than its 64-row path
    return {arch: build_tiny_model(root / arch, arch, intermediate_size=200) for arch in ("llama", "qwen2", "qwen3")}


def runners(model_dir: Path, level: str, dtype: str, kv_cache_dtype: str) -> tuple[ModelRunner, ModelRunner]:
    """(in one call, layer by layer) on the same weights."""
    vectorised_or_skip(level, "skinny_linear_supported")
    if dtype == "bfloat16":
        vectorised_or_skip(level, "skinny_linear_bf16_supported", torch.bfloat16)
    config = tiny_engine_config(model_dir, cpu_isa=level, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                num_kv_blocks=96)
    one_call, by_layer = (ModelRunner(config, rank=0, show_progress=False) for _ in range(2))
    assert one_call.model.native_decoder is not None
    by_layer.model.native_decoder = None
    return one_call, by_layer


def hidden_of(runner: ModelRunner, plan: StepPlan, rows: list[int] | None) -> torch.Tensor:
    batch = runner._batch(plan)
    chosen = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    return runner.model(batch.input_ids, batch.positions, batch.attn, runner.kv_views, chosen)


@pytest.mark.parametrize("level", VECTOR_LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("arch,dtype,kv_cache_dtype", CASES, ids=["-".join(case) for case in CASES])
def test_a_step_in_one_call_computes_the_layers_results_bit_for_bit(
        models: dict[str, Path], level: str, arch: str, dtype: str, kv_cache_dtype: str) -> None:
    one_call, by_layer = runners(models[arch], level, dtype, kv_cache_dtype)
    rng = np.random.default_rng(9)
    pool = BlockPool(96, block_size=4)
    seqs = [Seq(f"r{i}", rng.integers(3, 500, n).tolist()) for i, n in enumerate([9, 90, 6])]
    # prompts whole; r1's prompt in chunks beside decodes (one step samples nothing); decodes alone
    steps = [([0, 2], [9, 6]), ([0, 1, 2], [1, 70, 1]), ([1], [13]), ([0, 1, 2], [1, 7, 1]), ([0, 2], [1, 1])]
    for step_id, (members, scheduled) in enumerate(steps):
        chosen = [seqs[m] for m in members]
        for seq in chosen:  # each decode appends a known token first
            if seq.num_computed == len(seq.token_ids):
                seq.token_ids.append(int(rng.integers(3, 500)))
        plan = make_plan(chosen, scheduled, pool, step_id)
        tokens = sum(scheduled)
        for rows in (None, [tokens - 1, 0], []):  # every row; a few, out of order; none
            ours, theirs = hidden_of(one_call, plan, rows), hidden_of(by_layer, plan, rows)
            assert ours.shape == theirs.shape == (tokens if rows is None else len(rows), ours.shape[1])
            assert torch.equal(ours, theirs), (step_id, rows)
        assert torch.equal(one_call.logits_for_all_tokens(plan), by_layer.logits_for_all_tokens(plan))
        for seq, n in zip(chosen, scheduled):
            seq.num_computed += n
    for (k, v), (k_theirs, v_theirs) in zip(one_call.kv_views, by_layer.kv_views):
        assert torch.equal(k, k_theirs) and torch.equal(v, v_theirs)


def test_a_bad_slot_or_block_table_is_an_error_that_names_it_and_the_next_step_runs(models: dict[str, Path]) -> None:
    one_call, by_layer = runners(models["llama"], "", "float32", "auto")
    pool = BlockPool(96, block_size=4)
    plan = make_plan([Seq("a", [5, 6, 7, 8, 9]), Seq("b", [4, 3])], [5, 2], pool)
    batch = one_call._batch(plan)
    num_slots = one_call.kv_views[0][0].shape[1]
    batch.attn.slot_mapping[3] = num_slots + 7
    with pytest.raises(ValueError, match=f"token 3's slot {num_slots + 7} is outside the cache's {num_slots} slots"):
        one_call.model(batch.input_ids, batch.positions, batch.attn, one_call.kv_views)
    batch = one_call._batch(plan)
    batch.attn.block_tables[1, 0] = 5000
    with pytest.raises(ValueError, match="member 1's block table names block 5000"):
        one_call.model(batch.input_ids, batch.positions, batch.attn, one_call.kv_views)
    assert torch.equal(one_call.logits_for_all_tokens(plan), by_layer.logits_for_all_tokens(plan))


def test_models_or_backends_without_a_native_kernel_for_every_piece_run_layer_by_layer(
        models: dict[str, Path]) -> None:
    vectorised_or_skip("", "skinny_linear_supported")
    qk_norms = ModelRunner(tiny_engine_config(models["qwen3"]), rank=0, show_progress=False)
    torch_attention = ModelRunner(tiny_engine_config(models["llama"], attention_backend="torch"), rank=0,
                                  show_progress=False)
    assert qk_norms.model.native_decoder is None and torch_attention.model.native_decoder is None
