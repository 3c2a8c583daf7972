"""Tensor parallelism: this process's rank, the group's size, and the collectives.

A layer reads its rank and the tensor-parallel size once, when it is built:
`ModelRunner` builds its model inside `tensor_parallel(rank, size)`, so a TP=1
engine built in a process that also hosts rank 0 of a TP=2 engine still gets
whole layers. Outside such a block the values come from torch.distributed
(rank 0 of 1 when no process group is set up).

`init_distributed` / `destroy_distributed` start and stop this process's process
group: gloo for CPU tensors, NCCL (one GPU per rank) for CUDA tensors. The ranks
meet through a TCP store whose port rank 0 got from the OS, never a fixed one.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist

_building: tuple[int, int] | None = None  # (rank, size) while a model is being built

# Where the ranks meet: the TCP store that rank 0's process serves (loopback only).
STORE_HOST = "127.0.0.1"


def get_tp_rank() -> int:
    if _building is not None:
        return _building[0]
    return dist.get_rank() if dist.is_initialized() else 0


def get_tp_size() -> int:
    if _building is not None:
        return _building[1]
    return dist.get_world_size() if dist.is_initialized() else 1


@contextmanager
def tensor_parallel(rank: int, size: int):
    """Layers built inside this block hold rank `rank`'s shard of a `size`-way split."""
    global _building
    assert 0 <= rank < size, (rank, size)
    outer, _building = _building, (rank, size)
    try:
        yield
    finally:
        _building = outer


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place. Layers call it only when their tp_size > 1."""
    dist.all_reduce(x)
    return x


def gather_to_rank0(x: torch.Tensor, rank: int, size: int) -> list[torch.Tensor] | None:
    """Every rank's `x` (same shape everywhere), in rank order, on rank 0; None on the others."""
    parts = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
    dist.gather(x.contiguous(), parts, dst=0)
    return parts


def min_over_ranks(value: int, tp_size: int, device: torch.device) -> int:
    """The smallest of the `tp_size` ranks' `value`s (e.g. KV blocks: every rank allocates as many)."""
    if tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def init_distributed(rank: int, world_size: int, store_port: int, device: torch.device) -> None:
    """Join the process group of `world_size` ranks that meet at the TCP store on `store_port`.

    CUDA ranks use NCCL and GPU number `rank` (one GPU per rank); CPU ranks use gloo.
    """
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a tensor-parallel group: run one "
                           "tensor-parallel engine per process at a time (shut the other one down first)")
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore(STORE_HOST, store_port, world_size, is_master=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
