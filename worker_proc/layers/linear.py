"""Column- and row-parallel linear layers, including the fused qkv and gate_up projections."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from worker_proc import parallel
from worker_proc.layers.skinny import MAX_ROWS as SKINNY_MAX_ROWS
from worker_proc.layers.skinny import SkinnyLinear, SkinnyWeight

log = logging.getLogger(__name__)


def _attach_loader(param: nn.Parameter, loader: object) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


@functools.cache
def cpu_prepack_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks weights of this dtype on this CPU, asked of oneDNN itself: it refuses
    bf16 without AVX512BW/VL/DQ or AVX-NE-CONVERT (AVX2-only CPUs, or ONEDNN_MAX_CPU_ISA capped),
    and there unpacked F.linear still runs, emulated."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        prepack(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError as error:
        log.info("oneDNN cannot prepack %s weights on this CPU (%s): linears run unpacked", dtype,
                 " ".join(str(error).split())[:200])
        return False
    return True


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered once into oneDNN's blocked layout. Plain F.linear re-reads it through a
    per-call reorder; prepacked, a SmolLM2 bf16 decode step's matmuls drop from 19.1 to 13.4 ms."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def best_linear(x: torch.Tensor, weight: torch.Tensor, packed_weight: torch.Tensor | None,
                skinny: SkinnyWeight | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) by the fastest path a layer has: the skinny linear for a decode step's rows (or
    any step, when the layer has no oneDNN copy), oneDNN's packed weight, else F.linear."""
    if skinny is not None and (x.shape[0] <= SKINNY_MAX_ROWS or packed_weight is None):
        return skinny(x, bias)
    if packed_weight is not None:
        return packed_linear(x, packed_weight, bias)
    return F.linear(x, weight, bias)


class LinearBase(nn.Module):
    """y = x W^T (+ b) over this rank's shard; subclasses decide which dim is split."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = parallel.get_rank()
        self.tp_size = parallel.get_world_size()
        self.weight = _attach_loader(nn.Parameter(torch.empty(output_size, input_size),
                                                  requires_grad=False), self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _attach_loader(nn.Parameter(torch.empty(output_size), requires_grad=False),
                                       self.weight_loader)
        self.packed_weight: torch.Tensor | None = None
        self.skinny: SkinnyWeight | None = None

    def pack_for_cpu(self, skinny: SkinnyLinear | None = None) -> None:
        """Call once, after loading. Afterwards `weight` holds no data: oneDNN's packed copy runs
        the steps, and with `skinny` its own copy runs those of up to skinny.MAX_ROWS rows, or
        every step where it serves all rows (skinny.all_rows; then no oneDNN copy is kept)."""
        self.packed_weight = None if skinny is not None and skinny.all_rows else prepack(self.weight)
        self.skinny = None if skinny is None else skinny.pack(self.weight)
        self.weight.data = self.weight.data.new_empty(0)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return best_linear(x, self.weight, self.packed_weight, self.skinny, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice of the output (no gather)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = parallel.get_world_size()
        super().__init__(input_size, parallel.divide(output_size, tp_size, "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate_up).

    Rank r's weight is [shard_0 slice r; shard_1 slice r; ...], so the output splits evenly.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        assert isinstance(shard_id, int), f"merged linear needs an integer shard id, got {shard_id!r}"
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(LinearBase):
    """q, k and v projections fused into one matmul; query heads are split across ranks, KV heads
    too when there are enough, else replicated (see parallel.kv_heads_per_rank)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size = parallel.get_world_size()
        self.num_heads = parallel.divide(num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = parallel.kv_heads_per_rank(num_kv_heads, tp_size)
        self.kv_shard = parallel.kv_head_shard(parallel.get_rank(), num_kv_heads, tp_size)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        offset, size, shard = {"q": (0, self.q_size, self.tp_rank),
                               "k": (self.q_size, self.kv_size, self.kv_shard),
                               "v": (self.q_size + self.kv_size, self.kv_size, self.kv_shard)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, shard * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with one all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = parallel.get_world_size()
        super().__init__(parallel.divide(input_size, tp_size, "input features"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias is added once, on rank 0, so it is not split
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return parallel.all_reduce(self._matmul(x, bias))
