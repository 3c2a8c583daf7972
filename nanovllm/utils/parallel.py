"""Tensor-parallel rank and world size, read from torch.distributed when it is set up."""
import torch.distributed as dist


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def all_reduce(x):
    """Sum `x` over the tensor-parallel ranks, in place; a no-op on one rank."""
    if get_tp_size() > 1:
        dist.all_reduce(x)
    return x
