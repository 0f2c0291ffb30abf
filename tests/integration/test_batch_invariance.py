"""Through the whole stack, in fp32 on the native CPU kernels, a greedy request's logprobs do not
depend on what else shares its steps. The model's MLP is wider than 256, so that its down
projection sums more than one of the blocks of inputs the skinny linear once split only its steps
of up to 64 rows into."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest
from support import tiny_config
from tiny_model import build_tiny_model

from deploy.launcher import Stack


@pytest.fixture(scope="module", params=["", "avx2"], ids=["native", "avx2 cap"])
def wide_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The native kernels as built for this CPU, and capped to AVX2 (every fp32 step through them)."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("wide-mlp"), "llama", intermediate_size=600)
    config = tiny_config(model_dir, cpu_isa=request.param)
    with Stack(config, log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running


def complete(stack: Stack, body: dict) -> dict:
    response = httpx.post(f"{stack.url}/v1/completions", json={"model": "tiny", **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize(("prompt_len", "cached"), [(20, 16), (17, 0)])
def test_a_greedy_request_gets_the_same_logprobs_alone_and_beside_other_prompts(wide_stack: Stack, prompt_len: int,
                                                                               cached: int) -> None:
    """Alone its steps have at most 20 rows; beside two 100-token prompts (at most 220 prompt tokens,
    within one step's budget of 256) its prompt or its decodes share steps of more than 64 rows. The
    second time a 20-token prompt's first block of 16 comes from the prefix cache, so it also runs
    cut where the cache ends; a 17-token one computes that block again rather than its last token
    alone."""
    target = {"prompt": [(13 * i + prompt_len) % 450 + 7 for i in range(prompt_len)], "max_tokens": 24,
              "temperature": 0, "ignore_eos": True, "logprobs": 1}
    others = [{"prompt": [(29 * i + k) % 450 + 7 for i in range(100)], "max_tokens": 16, "temperature": 0,
               "ignore_eos": True} for k in (1, 2)]
    alone = complete(wide_stack, target)["choices"][0]["logprobs"]["token_logprobs"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        beside = [pool.submit(complete, wide_stack, body) for body in [*others, target]]
        shared = beside[-1].result()
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert shared["choices"][0]["logprobs"]["token_logprobs"] == alone
