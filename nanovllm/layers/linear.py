"""Linear layers, split across tensor-parallel ranks where it matters.

- `ColumnParallelLinear`: output features split; each rank holds its slice.
- `MergedColumnParallelLinear`: several column-parallel outputs packed in one
  matrix (gate_proj + up_proj), each split on its own.
- `QKVParallelLinear`: q, k and v packed, split by heads.
- `RowParallelLinear`: input features split; partial sums all-reduced.

What a layer stores and how it multiplies is its `quant_method`'s (layers/quantization:
dense by default; fp8 or int weight-only where configured). The layer knows only its
split: each parameter carries a `weight_loader(param, loaded[, shard_id])` that copies
this rank's part of a checkpoint tensor into it, following the parameter's shard tags
(`output_dim`, `input_dim`, `shard_unit`), so a scale tensor is split with its weight.
`loaded` may be a whole tensor (dummy or dequantized GGUF weights, sliced here) or a lazy
safetensors slice (only the rows this rank needs are read from disk).

K/V heads: with fewer KV heads than ranks (MQA/GQA, e.g. 1 KV head on 2 ranks)
each KV head is replicated on `tp_size // num_kv_heads` ranks, as vLLM does; a
count that neither divides nor is divided by the TP size is a clear error.
"""
import torch
from torch import nn

from nanovllm.layers import opaque_ops
from nanovllm.layers.quantization import get_linear_method, set_shard_tags
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


def in_param_units(param: nn.Parameter, start: int, size: int) -> tuple[int, int]:
    """Weight rows/columns [start, start+size) as entries of `param` along its split dim
    (one entry covers `param.shard_unit` of them: 128 for 128x128 block scales)."""
    unit = getattr(param, "shard_unit", 1)
    if start % unit:
        raise ValueError(f"a tensor-parallel shard starts at row {start}, inside a block of {unit}: "
                         "this quantized checkpoint cannot be split into that many ranks")
    return start // unit, -(-(start + size) // unit) - start // unit


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), refusing a src of another shape (copy_ would broadcast a wrong-shaped
    scale silently); the loader names the checkpoint tensor."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"shape {tuple(src.shape)} where this rank's part is {tuple(dst.shape)}")
    dst.copy_(src)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool):
        """`input_size` / `output_size`: this rank's partition."""
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.quant_method = get_linear_method(self)
        self.quant_method.create_weights(self, input_size, output_size, torch.get_default_dtype())
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader
        if bias:
            self.bias = set_shard_tags(nn.Parameter(torch.empty(output_size), requires_grad=False), 0, None)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled CPU forward keeps it opaque (layers/opaque_ops.py)
            return opaque_ops.linear(x, self.opaque_key, self.output_size)
        return self.quant_method.apply(self, x, self.bias)

    def _copy_rows(self, param: nn.Parameter, loaded, offset: int, start: int, size: int) -> None:
        """Copy checkpoint output rows [start, start+size) into `param` at output row `offset`
        (all in weight rows; converted to the parameter's own units)."""
        if param.output_dim is None:  # not split with the outputs (a per-tensor scale)
            param.data.copy_(read_whole(loaded))
            return
        dim = param.output_dim
        first, count = in_param_units(param, start, size)
        at, _ = in_param_units(param, offset, size)
        _copy_checked(param.data.narrow(dim, at, count), read_shard(loaded, dim, first, count))


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        param.data.copy_(read_whole(loaded))


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_size(), "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        size = self.output_size
        self._copy_rows(param, loaded, 0, self.tp_rank * size, size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        for size in output_sizes:
            divide(size, get_tp_size(), "output size")
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        self._copy_rows(param, loaded, offset, self.tp_rank * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp)
        replicas = max(tp // num_kv_heads, 1)  # ranks holding the same KV heads
        self.kv_shard = get_tp_rank() // replicas  # which slice of the checkpoint's KV heads
        # per rank: num_heads / tp query heads + num_kv_heads (per rank) keys and values
        self.output_sizes = [self.num_heads * head_dim * tp] + [self.num_kv_heads * head_dim * tp] * 2
        super().__init__(hidden_size, (num_heads + 2 * self.num_kv_heads * tp) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        shard = self.tp_rank if shard_id == "q" else self.kv_shard
        self._copy_rows(param, loaded, offset, shard * size, size)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size(), "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if param is self.bias:  # the bias is added once, on rank 0's partial sum
            param.data.copy_(read_whole(loaded) if self.tp_rank == 0 else torch.zeros_like(param))
            return
        if param.input_dim is None:  # not split with the inputs (per-output-channel scales)
            param.data.copy_(read_whole(loaded))
            return
        size = self.input_size
        first, count = in_param_units(param, self.tp_rank * size, size)
        _copy_checked(param.data, read_shard(loaded, param.input_dim, first, count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # [num_tokens, output_size]: this rank's partial sum
        return all_reduce(y) if self.tp_size > 1 else y
