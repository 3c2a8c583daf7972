"""CPU products by GGUF Q8_0 weights read as stored (int8 values, one scale per 32), in C++.

A Q8_0 block is 32 int8 values q and one fp16 scale d (value = d * q). At load the blocks are
rearranged into `Q8Weight`: the values as int8 [out, in] and the scales as fp32 [out, in / 32]
(`from_gguf_blocks`), 1.125 bytes per weight against bf16's 2. `q8_0_linear` multiplies small
batches by it (cpu_q8_0.cpp): each weight vector is dequantized in registers, exactly (d * q has at
most 19 significant bits), and multiplied into fp32 accumulators, so the result is
`x.float() @ dequantize(W).T` in another summation order, rounded once to x's dtype (fp32 or bf16).
A matrix-vector product is bound by the bytes it reads, so one row runs in about half the time of
the bf16 dense product (benchmarks/RESULTS.md "Q8_0 kept quantized on the CPU"); larger batches
become bound by the conversions and run the dense oneDNN product (the callers' crossover).

`embedding` reads rows of the same weight (a token embedding tied to its LM head), dequantized.

Built like the other C++ kernels (kernels/cpu_small_ops.py): `utils/cpp_compiler.build`, one
library per dtype, kept for later processes; `prepare` builds them at start-up. Without a C++
compiler (and no library built before) `built` is False and the callers keep their dense weights.
"""
import functools
from pathlib import Path

import torch

from nanovllm.utils import cpp_compiler

SOURCE = Path(__file__).with_suffix(".cpp")
CPP_TYPES = {torch.float32: "float", torch.bfloat16: "at::BFloat16"}
ARG_TYPES = ["const {t}*", "const int8_t*", "const float*", "{t}*", "long", "long", "long", "long"]
BLOCK = 32          # values per Q8_0 block
BLOCK_BYTES = 34    # fp16 scale + 32 int8 values (ggml-common.h's block_q8_0)


class Q8Weight:
    """A Q8_0 weight in the kernel's layout: values int8 [out, in], scales fp32 [out, in / 32]."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor):
        assert values.dtype == torch.int8 and scales.dtype == torch.float32
        assert values.shape[1] == scales.shape[1] * BLOCK and values.shape[0] == scales.shape[0]
        self.values, self.scales = values.contiguous(), scales.contiguous()

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes

    def rows(self, start: int, size: int) -> "Q8Weight":
        """Rows [start, start + size) (a tensor-parallel shard of the output rows)."""
        return Q8Weight(self.values[start:start + size], self.scales[start:start + size])

    def padded(self, rows: int) -> "Q8Weight":
        """The same rows followed by zero rows up to `rows` (a vocabulary shard's padding)."""
        extra = rows - self.values.shape[0]
        if extra <= 0:
            return self
        pad = lambda t: torch.cat([t, t.new_zeros(extra, t.shape[1])])  # noqa: E731
        return Q8Weight(pad(self.values), pad(self.scales))

    def dequantize(self) -> torch.Tensor:
        """The weight's values as fp32 [out, in] (exact: what the kernel multiplies by)."""
        return self.values.float() * self.scales.repeat_interleave(BLOCK, dim=1)


def from_gguf_blocks(raw: torch.Tensor) -> Q8Weight:
    """raw: [rows, bytes_per_row] uint8, each row a run of Q8_0 blocks -> its Q8Weight."""
    rows = raw.shape[0]
    if raw.shape[1] % BLOCK_BYTES:
        raise ValueError(f"a Q8_0 row of {raw.shape[1]} bytes is not a whole number of blocks")
    blocks = raw.contiguous().view(rows, -1, BLOCK_BYTES)                    # [rows, blocks, 34]
    scales = blocks[..., :2].contiguous().view(torch.float16).float().squeeze(-1)  # [rows, blocks]
    values = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)       # [rows, in]
    return Q8Weight(values, scales)


def quantize(w: torch.Tensor) -> Q8Weight:
    """A float weight [out, in] quantized as llama.cpp's Q8_0 does (d = amax / 127 rounded to fp16,
    q = round(w / d)): for tests and benchmarks."""
    g = w.float().reshape(w.shape[0], -1, BLOCK)                             # [out, blocks, 32]
    d = (g.abs().amax(-1) / 127).half().float()                              # [out, blocks]
    # an all-zero block has d = 0 and q = 0 (the clamp only keeps its division finite)
    q = torch.where(d.unsqueeze(-1) > 0, g / d.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1),
                    torch.zeros_like(g))
    return Q8Weight(q.round().clamp(-127, 127).to(torch.int8).reshape(w.shape), d)


@functools.cache
def _build(dtype: torch.dtype):
    """The built function for `dtype`, or None (no compiler and no library built before)."""
    source = cpp_compiler.source(SOURCE, {"ELEMENT_TYPE": CPP_TYPES[dtype]})
    return cpp_compiler.build(source, [t.format(t=CPP_TYPES[dtype]) for t in ARG_TYPES])


def built(dtype: torch.dtype) -> bool:
    """Whether the kernel runs for activations of `dtype` here (built now if not yet)."""
    return dtype in CPP_TYPES and _build(dtype) is not None


def q8_0_linear(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    """x [num_tokens, in] (fp32 or bf16, CPU) @ dequantize(weight).T -> [num_tokens, out] in x's
    dtype, accumulated in fp32. The caller checks `built(x.dtype)`."""
    fn = _build(x.dtype)
    assert fn is not None, "q8_0_linear called where the kernel is not built"
    x = x.contiguous()
    m, k = x.shape
    n = weight.values.shape[0]
    if k != weight.values.shape[1]:
        raise ValueError(f"input of {k} features for a Q8_0 weight of {weight.values.shape[1]}")
    y = torch.empty(m, n, dtype=x.dtype)
    if m:
        fn(x, weight.values, weight.scales, y, m, n, k, torch.get_num_threads())
    return y


def embedding(ids: torch.Tensor, weight: Q8Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [n] of the dequantized weight -> [n, in] in `dtype` (each value d * q, exact in
    fp32, rounded to `dtype` as the dense embedding's copy was). Four ops: ~28 us for one row and
    ~41 us for 64 against ~5 us for `F.embedding` on the bf16 copy (two threads, the 49152 x 576
    SmolLM2 embedding, the AVX512 VM of benchmarks/RESULTS.md "Q8_0 kept quantized on the CPU")."""
    n = ids.shape[0]
    values = weight.values.index_select(0, ids).view(n, -1, BLOCK)           # [n, blocks, 32] int8
    scales = weight.scales.index_select(0, ids).unsqueeze(-1)                # [n, blocks, 1]
    return torch.mul(values, scales).to(dtype).view(n, -1)                   # [n, in]
