"""Column- and row-parallel linear layers, including the fused qkv and gate_up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_proc import parallel


def _attach_loader(param: nn.Parameter, loader: object) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class LinearBase(nn.Module):
    """y = x W^T (+ b); `tp_dim` is the weight dim split across ranks (0 = output, 1 = input)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int) -> None:
        super().__init__()
        self.tp_rank = parallel.get_rank()
        self.tp_size = parallel.get_world_size()
        self.tp_dim = tp_dim
        self.weight = _attach_loader(nn.Parameter(torch.empty(output_size, input_size),
                                                  requires_grad=False), self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _attach_loader(nn.Parameter(torch.empty(output_size), requires_grad=False),
                                       self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice of the output (no gather)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = parallel.get_world_size()
        super().__init__(input_size, parallel.divide(output_size, tp_size, "output features"),
                         bias, tp_dim=0)

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


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused into one matmul; heads are split across ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size = parallel.get_world_size()
        self.num_heads = parallel.divide(num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = parallel.divide(num_kv_heads, tp_size, "num_key_value_heads")
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                        "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with one all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = parallel.get_world_size()
        super().__init__(parallel.divide(input_size, tp_size, "input features"), output_size,
                         bias, tp_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias is added once, on rank 0, so it is not split
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return parallel.all_reduce(F.linear(x, self.weight, bias))
