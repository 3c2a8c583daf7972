"""Linear layers, split across tensor-parallel ranks where it matters.

- `ColumnParallelLinear`: output features split; each rank holds its slice.
- `MergedColumnParallelLinear`: several column-parallel outputs packed in one
  matrix (gate_proj + up_proj), each split on its own.
- `QKVParallelLinear`: q, k and v packed, split by heads.
- `RowParallelLinear`: input features split; partial sums all-reduced.

Each parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that
copies this rank's part of a checkpoint tensor into it. `loaded_weight` may be a
whole tensor (dummy or dequantized GGUF weights, sliced here) or a lazy
safetensors slice (only the rows this rank needs are read from disk).

K/V heads: with fewer KV heads than ranks (MQA/GQA, e.g. 1 KV head on 2 ranks)
each KV head is replicated on `tp_size // num_kv_heads` ranks, as vLLM does; a
count that neither divides nor is divided by the TP size is a clear error.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.parallel import all_reduce, divide, get_tp_rank, get_tp_size


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: a split when they divide, else one replicated head."""
    if num_kv_heads % tp_size == 0:
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads == 0:
        return 1  # each head replicated on tp_size // num_kv_heads ranks
    raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({tp_size}) "
                     "must divide one another")


def read_shard(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start+size) of a tensor or lazy slice."""
    index = [slice(None)] * (dim + 1)
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


def read_whole(loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        param.data.copy_(read_whole(loaded))


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_size(), "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        size = param.shape[0]
        param.data.copy_(read_shard(loaded, 0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        for size in output_sizes:
            divide(size, get_tp_size(), "output size")
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data[offset:offset + size].copy_(read_shard(loaded, 0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp)
        replicas = max(tp // num_kv_heads, 1)  # ranks holding the same KV heads
        self.kv_shard = get_tp_rank() // replicas  # which slice of the checkpoint's KV heads
        # per rank: num_heads / tp query heads + num_kv_heads (per rank) keys and values
        super().__init__(hidden_size, (num_heads + 2 * self.num_kv_heads * tp) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        shard = self.tp_rank if shard_id == "q" else self.kv_shard
        param.data[offset:offset + size].copy_(read_shard(loaded, 0, shard * size, size))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size(), "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if param.dim() == 1:  # the bias is added once, on rank 0's partial sum
            param.data.copy_(read_whole(loaded) if self.tp_rank == 0 else torch.zeros_like(param))
            return
        size = param.shape[1]
        param.data.copy_(read_shard(loaded, 1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # [num_tokens, output_size]: this rank's partial sum
        return all_reduce(y) if self.tp_size > 1 else y
