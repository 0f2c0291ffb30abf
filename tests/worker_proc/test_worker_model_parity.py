"""Our paged, ragged forward pass equals Hugging Face's, token for token, in fp32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_model import build_tiny_model
from safetensors.torch import load_file, save_file
from worker_plans import BlockPool, Seq, advance, make_plan, tiny_engine_config

from worker_proc.runner import ModelRunner

ATOL = 1e-4
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # q/k/v bias
    "qwen3": ("qwen3", {}),  # per-head q/k RMSNorm
    "tied_llama": ("llama", {"tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "bf16_checkpoint": ("llama", {}),  # served in fp32: the skinny linear keeps its weights as bf16
    "tied_bf16_checkpoint": ("llama", {"tie_word_embeddings": True}),  # and the token table too
}


def randomize_vectors(model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """The fixture leaves biases at 0 and norm weights at 1, which would hide a mis-loaded one.
    dtype: of the saved checkpoint (bf16, as the default model's is, then loaded in fp32)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if tensor.dim() == 1:
            tensor = tensor + 0.2 * torch.randn(tensor.shape, generator=generator)
        tensors[name] = tensor.to(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    import transformers

    arch, overrides = VARIANTS[request.param]
    model_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    randomize_vectors(model_dir, torch.bfloat16 if request.param.endswith("bf16_checkpoint") else torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model_dir, hf


def hf_logits(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


def test_mixed_prefill_and_decode_batch_matches_hf_logits(variant: tuple[Path, torch.nn.Module]) -> None:
    model_dir, hf = variant
    runner = ModelRunner(tiny_engine_config(model_dir), rank=0, show_progress=False)
    pool = BlockPool(64, block_size=4)
    seqs = [Seq(f"r{i}", p) for i, p in enumerate(prompts([7, 13, 1, 21, 6]))]
    # Step 1: whole prompts, partial chunks and a one-token prompt, in one ragged batch.
    first = [7, 5, 1, 10, 6]
    plan = make_plan(seqs, first, pool)
    expected = [hf_logits(hf, s.token_ids)[:n] for s, n in zip(seqs, first)]
    torch.testing.assert_close(runner.logits_for_all_tokens(plan), torch.cat(expected),
                               atol=ATOL, rtol=0)
    for seq, n in zip(seqs, first):
        seq.num_computed += n
    # Step 2: decodes (KV cached from step 1) next to chunks that continue mid-prompt.
    seqs[0].token_ids.append(5)
    seqs[2].token_ids.append(9)
    seqs[4].token_ids.append(11)
    second = [1, 8, 1, 11, 1]
    plan = make_plan(seqs, second, pool, step_id=1)
    expected = [hf_logits(hf, s.token_ids)[s.num_computed:s.num_computed + n]
                for s, n in zip(seqs, second)]
    torch.testing.assert_close(runner.logits_for_all_tokens(plan), torch.cat(expected),
                               atol=ATOL, rtol=0)


def test_prompt_chunked_over_three_steps_equals_one_step_prefill(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_engine_config(tiny_model_dir), rank=0, show_progress=False)
    prompt = prompts([23], seed=3)[0]
    pool = BlockPool(64, block_size=4)
    whole = Seq("whole", list(prompt))
    whole_logits = runner.logits_for_all_tokens(make_plan([whole], [23], pool))
    chunked = Seq("chunked", list(prompt))
    parts = []
    for step, n in enumerate([8, 8, 7]):
        parts.append(runner.logits_for_all_tokens(make_plan([chunked], [n], pool, step)))
        chunked.num_computed += n
    torch.testing.assert_close(torch.cat(parts), whole_logits, atol=1e-5, rtol=0)


def test_lone_decoding_sequence_matches_hf(tiny_model_dir: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    runner = ModelRunner(tiny_engine_config(tiny_model_dir), rank=0, show_progress=False)
    pool = BlockPool(64, block_size=4)
    seq = Seq("alone", prompts([6], seed=9)[0])
    for step in range(4):  # one prefill, then decodes with nothing to pad or mask
        scheduled = [len(seq.token_ids) - seq.num_computed]
        plan = make_plan([seq], scheduled, pool, step)
        logits = runner.logits_for_all_tokens(plan)
        expected = hf_logits(hf.eval(), seq.token_ids)[seq.num_computed:]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        seq.num_computed += scheduled[0]
        seq.token_ids.append(int(logits[-1].argmax()))


def test_greedy_decoding_matches_hf_generate_for_20_tokens(variant: tuple[Path, torch.nn.Module]) -> None:
    model_dir, hf = variant
    runner = ModelRunner(tiny_engine_config(model_dir), rank=0, show_progress=False)
    pool = BlockPool(64, block_size=4)
    starts = prompts([5, 12, 9], seed=5)
    seqs = [Seq(f"r{i}", list(p)) for i, p in enumerate(starts)]
    for step in range(20):  # all three decode side by side in one ragged batch
        scheduled = [len(s.token_ids) - s.num_computed for s in seqs]
        plan = make_plan(seqs, scheduled, pool, step)
        advance(seqs, scheduled, plan, runner.execute(plan))
    hf.generation_config.eos_token_id = None  # compare 20 tokens even if one happens to be EOS
    for seq, prompt in zip(seqs, starts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                              pad_token_id=0)
        assert seq.token_ids == out[0].tolist()


def test_the_last_layers_mlp_runs_only_for_the_rows_the_lm_head_reads(variant: tuple[Path, torch.nn.Module]) -> None:
    """A step's last layer caches every token's K and V but projects and runs its MLP only for the
    sampling rows; a chunk in mid-prompt samples nothing and skips that MLP. The tokens sampled
    after such steps still equal HF's greedy choice, so the K/V they cached are whole."""
    model_dir, hf = variant
    runner = ModelRunner(tiny_engine_config(model_dir), rank=0, show_progress=False)
    runner.model.native_decoder = None  # the layers one by one, where hooks see them (its rows: test_worker_native_decoder)
    seen: dict[str, list[int]] = {"first": [], "last": []}
    layers = runner.model.model.layers
    layers[0].mlp.register_forward_hook(lambda _m, args, _o: seen["first"].append(args[0].shape[0]))
    layers[-1].mlp.register_forward_hook(lambda _m, args, _o: seen["last"].append(args[0].shape[0]))
    pool = BlockPool(64, block_size=4)
    seqs = [Seq(f"r{i}", p) for i, p in enumerate(prompts([7, 13, 9], seed=11))]
    steps = [[7, 5, 9], [1, 5, 1], [1, 3, 1]]  # r1's prompt in three chunks; r0 and r2 decode
    for step, scheduled in enumerate(steps):
        plan = make_plan(seqs, scheduled, pool, step)
        advance(seqs, scheduled, plan, runner.execute(plan))
    assert seen["first"] == [21, 7, 5]
    assert seen["last"] == [2, 2, 3]  # r0, r2 (r1 mid-prompt); then all three sample
    for seq in seqs:
        prompt_len = len(seq.token_ids) - 1
        expected = int(hf_logits(hf, seq.token_ids[:prompt_len])[-1].argmax())
        assert seq.token_ids[-1] == expected, seq.request_id
    alone = Seq("alone", prompts([10], seed=12)[0])
    plan = make_plan([alone], [6], pool, step_id=9)  # nothing samples: the last MLP is skipped
    assert runner.execute(plan).sampled_token_ids.size == 0
    assert seen["last"] == [2, 2, 3]


def test_a_bf16_checkpoint_served_in_fp32_keeps_its_weights_as_bf16_where_the_kernel_serves(
        variant: tuple[Path, torch.nn.Module]) -> None:
    """The parity tests above hold for the bf16_checkpoint variant through the widening kernel."""
    from worker_proc.layers.skinny import skinny_linear_for

    model_dir, _ = variant
    runner = ModelRunner(tiny_engine_config(model_dir), rank=0, show_progress=False)
    packed = [m.skinny for m in runner.model.modules() if getattr(m, "skinny", None) is not None]
    if skinny_linear_for(torch.float32, "") is None:
        pytest.skip("no skinny linear here (needs AVX2 + FMA and the native library)")
    bf16_checkpoint = "bf16_checkpoint" in model_dir.name
    assert packed and all(weight.widened == bf16_checkpoint for weight in packed)
    table = runner.model.model.embed_tokens  # tied to the LM head, which reads its own panels: bf16
    narrowed = bf16_checkpoint and runner.model.config.tie_word_embeddings
    assert table.weight.dtype == (torch.bfloat16 if narrowed else torch.float32)
    ids = torch.tensor([0, 5, 17])
    assert table(ids).dtype == torch.float32
    if narrowed:
        assert torch.equal(table(ids), table.weight[ids].float())
