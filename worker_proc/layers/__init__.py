"""Tensor-parallel-ready building blocks of the Llama family; weights load through `param.weight_loader`."""
