"""Tensor parallelism over torch.distributed: the rank group, its collectives and model sharding."""

from segkv.distributed.parallel import TensorParallel, init_tensor_parallel

__all__ = ["TensorParallel", "init_tensor_parallel"]
