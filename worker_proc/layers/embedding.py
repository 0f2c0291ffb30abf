"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_proc import parallel
from worker_proc.layers.linear import best_linear, prepack
from worker_proc.layers.skinny import SkinnyLinear, SkinnyWeight


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * per_rank, (rank + 1) * per_rank) of the table; the vocab is padded to split evenly."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank = parallel.get_rank()
        self.tp_size = parallel.get_world_size()
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.out_dtype: torch.dtype | None = None  # set by narrow_to_bf16: the rows are widened to it

    def narrow_to_bf16(self) -> None:
        """Keep the fp32 table as bf16, half the memory; looked-up rows are widened back exactly.
        Only for a table whose every value bf16 holds, which nothing else reads as fp32:
        LlamaForCausalLM.pack_for_cpu calls it when the tied LM head kept bf16 panels of it (the
        skinny linear checked every value then)."""
        self.out_dtype, self.weight.data = self.weight.dtype, self.weight.data.bfloat16()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        rows = max(0, min(self.vocab_per_rank, loaded.shape[0] - self.vocab_start))
        param.data.narrow(0, 0, rows).copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 [num_tokens] -> [num_tokens, hidden]."""
        if self.tp_size == 1:
            return self._rows(input_ids)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.vocab_per_rank)
        embedded = self._rows(local_ids.masked_fill(outside, 0))
        embedded.masked_fill_(outside.unsqueeze(-1), 0.0)
        return parallel.all_reduce(embedded)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        return rows if self.out_dtype is None else rows.to(self.out_dtype)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocab (shards gathered from every rank)."""

    packed_weight: torch.Tensor | None = None
    skinny: SkinnyWeight | None = None

    def pack_for_cpu(self, keep_weight: bool, skinny: SkinnyLinear | None = None) -> None:
        """Call once, after loading; keep_weight when the table is tied to the token embedding.
        The logits run through one packed copy: the skinny linear's where it serves (at every row
        count: a step samples at most max_num_seqs rows, unless it asks for prompt logprobs),
        else oneDNN's."""
        if skinny is not None:
            self.skinny = skinny.pack(self.weight)
        else:
            self.packed_weight = prepack(self.weight)
        if not keep_weight:
            self.weight.data = self.weight.data.new_empty(0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> float32 [num_rows, vocab_size]."""
        local = best_linear(hidden, self.weight, self.packed_weight, self.skinny, None)
        logits = parallel.all_gather_last_dim(local)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, :self.vocab_size]
        return logits.float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
