"""Tensor parallelism: the process group, the partition arithmetic and the worker processes.

With tensor_parallel_size 1 nothing in this package touches torch.distributed.
"""
