"""CPU products by GGUF weights whose values are int8 with one scale per 32 or 16 values (Q8_0, Q6_K)
and, for Q5_K, one offset per 32 values too, read as stored, in C++.

A Q8_0 block is 32 int8 values q and one fp16 scale d (value = d * q); a Q6_K super-block is 256
6-bit values in 16 groups of 16, each group with an int8 scale s beside the super-block's fp16 d
(value = d * s * (q - 32)); a Q5_K super-block is 256 5-bit values q (0..31) in 8 sub-blocks of 32,
each with 6-bit scale and min (sc, m) beside the super-block's fp16 d and dmin (value = d * sc * q -
dmin * m). Each is, exactly, int8 values times one fp32 scale per block of 32 (Q8_0, Q5_K) or 16
(Q6_K) values, plus one fp32 offset per block (Q5_K: -dmin * m). At load the blocks are
rearranged into `Q8Weight`: the values as int8 [out, in], the scales as fp32 [out, in / block] and
the offsets (Q5_K) alike (`from_gguf`), 1.125 (block 32), 1.25 (block 16 or block 32 with offsets)
bytes per weight against bf16's 2. `q8_0_linear` multiplies small batches by it (cpu_q8_0.cpp,
built per block size and with or without offsets): each weight vector is dequantized in registers
(q * scale, one fp32 rounding, as gguf's own dequantization rounds) and multiplied into fp32
accumulators; the offsets multiply the sums of x per block (taken once per call) into the same
accumulators. So the result is `x.float() @ dequantize(W).T` in another summation order, rounded
once to x's dtype (fp32 or bf16); for Q5_K `dequantize` rounds each q * scale + offset to fp32 once
more (q * scale and the offset are exact: 22 and 17 significant bits), a rounding that the kernel,
multiplying by the two terms apart, does not make: at most half an fp32 ulp a weight, the size of
the summation order's own error. A matrix-vector product is bound by the bytes it reads, so one
row runs in about half the time of the bf16 dense product (benchmarks/RESULTS.md "Q8_0 kept
quantized on the CPU"); larger batches become bound by the conversions and run the dense oneDNN
product (the callers' crossover).

`embedding` reads rows of the same weight (a token embedding tied to its LM head), dequantized.

Built like the other C++ kernels (kernels/cpu_small_ops.py): `utils/cpp_compiler.build`, one
library per dtype, block size and with or without offsets, kept for later processes; `built_for`
builds one when a layer asks for it at load. Without a C++ compiler (and no library built before)
`built_for` is False and the callers keep their dense weights.
"""
import functools
from pathlib import Path

import torch

from nanovllm.utils import cpp_compiler, dequant

SOURCE = Path(__file__).with_suffix(".cpp")
CPP_TYPES = {torch.float32: "float", torch.bfloat16: "at::BFloat16"}
ARG_TYPES = ["const {t}*", "const int8_t*", "const float*", "{t}*", "long", "long", "long", "long"]
# the same with the offsets (const float*) after the scales
OFFSET_ARG_TYPES = ARG_TYPES[:3] + ["const float*"] + ARG_TYPES[3:]
BLOCK = 32          # values per Q8_0 block
BLOCK_BYTES = 34    # fp16 scale + 32 int8 values (ggml-common.h's block_q8_0)
Q6_K_GROUP = 16     # values per int8 group scale of ggml-common.h's block_q6_K
Q5_K_SUB_BLOCK = 32  # values per 6-bit scale and min of ggml-common.h's block_q5_K (QK_K = 256 in 8)
# GGUF types read as int8 values and fp32 scales -> values per scale
BLOCK_OF = {"Q8_0": BLOCK, "Q6_K": Q6_K_GROUP, "Q5_K": Q5_K_SUB_BLOCK}
# the types among those whose blocks have an offset each too
OFFSET_TYPES = frozenset({"Q5_K"})
# the bytes of a Q6_K block that hold its int8 group scales and its fp16 d (ggml-common.h's block_q6_K)
Q6_K_SCALES, Q6_K_D = slice(192, 208), slice(208, 210)
ONE_F16 = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)  # fp16 1.0 as its two bytes


class Q8Weight:
    """A weight in the kernel's layout: values int8 [out, in], scales fp32 [out, in / block] (one per
    `block` values: 32 or 16) and optionally offsets fp32 [out, in / block] (value = q * scale + offset)."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None):
        assert values.dtype == torch.int8 and scales.dtype == torch.float32 and values.shape[0] == scales.shape[0]
        self.block = values.shape[1] // max(scales.shape[1], 1)
        assert self.block in BLOCK_OF.values() and values.shape[1] == scales.shape[1] * self.block
        assert offsets is None or (offsets.dtype == torch.float32 and offsets.shape == scales.shape)
        self.values, self.scales = values.contiguous(), scales.contiguous()
        self.offsets = None if offsets is None else offsets.contiguous()

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """values, scales and (where kept) offsets."""
        return [self.values, self.scales] + ([] if self.offsets is None else [self.offsets])

    def rows(self, start: int, size: int) -> "Q8Weight":
        """Rows [start, start + size) (a tensor-parallel shard of the output rows)."""
        return Q8Weight(*(t[start:start + size] for t in self.tensors()))

    def padded(self, rows: int) -> "Q8Weight":
        """The same rows followed by zero rows up to `rows` (a vocabulary shard's padding)."""
        extra = rows - self.values.shape[0]
        if extra <= 0:
            return self
        return Q8Weight(*(torch.cat([t, t.new_zeros(extra, t.shape[1])]) for t in self.tensors()))

    def dequantize(self) -> torch.Tensor:
        """The weight's values as fp32 [out, in] (exact: gguf's dequantization, q * scale rounded
        once, then the offset added and rounded once)."""
        w = self.values.float() * self.scales.repeat_interleave(self.block, dim=1)
        return w if self.offsets is None else w + self.offsets.repeat_interleave(self.block, dim=1)


def from_gguf(raw: torch.Tensor, type_name: str) -> Q8Weight:
    """raw: [rows, bytes_per_row] uint8, each row a run of `type_name` blocks (a BLOCK_OF type) -> its
    Q8Weight. Q6_K values are the loader's own dequantization of the blocks with their scales set
    to 1 (the integers q - 32, exactly), their scales d * s from the blocks' bytes (exact in fp32).
    Q5_K: the loader's own values, scales and offsets (utils/dequant.q5_k_parts), offsets negated."""
    if type_name == "Q8_0":
        return from_gguf_blocks(raw)
    if type_name == "Q5_K":
        return from_q5_k_blocks(raw)
    assert type_name == "Q6_K", f"{type_name} is not read as int8 values"
    block_values, block_bytes, dequantize_blocks = dequant.QUANT_TYPES[type_name]
    rows = raw.shape[0]
    if raw.shape[1] % block_bytes:
        raise ValueError(f"a {type_name} row of {raw.shape[1]} bytes is not a whole number of blocks")
    blocks = raw.contiguous().view(-1, block_bytes)                               # [rows * blocks, 210]
    unit = blocks.clone()
    unit[:, Q6_K_SCALES], unit[:, Q6_K_D] = 1, ONE_F16
    values = dequantize_blocks(unit).to(torch.int8).reshape(rows, -1)             # [rows, in]
    d = blocks[:, Q6_K_D].contiguous().view(torch.float16).float()                # [rows * blocks, 1]
    scales = d * blocks[:, Q6_K_SCALES].contiguous().view(torch.int8).float()     # [rows * blocks, 16]
    return Q8Weight(values, scales.reshape(rows, -1))


def from_q5_k_blocks(raw: torch.Tensor) -> Q8Weight:
    """raw: [rows, bytes_per_row] uint8, each row a run of Q5_K blocks -> its Q8Weight (block 32, with
    offsets): q as int8 (0..31, exact), d * sc and -(dmin * m) as the loader computes them."""
    _, block_bytes, _ = dequant.QUANT_TYPES["Q5_K"]
    blocks = dequant.row_blocks(raw, "Q5_K", block_bytes)                     # [rows, blocks, 176]
    rows = blocks.shape[0]
    q, scale, offset = dequant.q5_k_parts(blocks.reshape(-1, block_bytes))   # [rows * blocks, 8, 32 | 1]
    return Q8Weight(q.to(torch.int8).reshape(rows, -1),                       # [rows, in]
                    scale.reshape(rows, -1), offset.neg().reshape(rows, -1))  # [rows, in / 32] each


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


def source_for(dtype: torch.dtype, block: int = BLOCK, offsets: bool = False, path: Path = SOURCE) -> str:
    """The kernel's source (`path`: cpu_q8_0.cpp, or another revision's copy of it) for activations of
    `dtype`, `block` values a scale and (`offsets`) an offset a block."""
    macros = {"ELEMENT_TYPE": CPP_TYPES[dtype], "SCALE_BLOCK": block, "HAS_OFFSETS": int(offsets)}
    return cpp_compiler.source(path, macros)


def arg_types(dtype: torch.dtype, offsets: bool = False) -> list[str]:
    """The C++ types of `kernel`'s arguments for activations of `dtype` (and with offsets)."""
    return [t.format(t=CPP_TYPES[dtype]) for t in (OFFSET_ARG_TYPES if offsets else ARG_TYPES)]


@functools.cache
def _build(dtype: torch.dtype, block: int = BLOCK, offsets: bool = False):
    """The built function for `dtype`, `block` values a scale and (`offsets`) an offset a block, or
    None (no compiler and no library built before)."""
    return cpp_compiler.build(source_for(dtype, block, offsets), arg_types(dtype, offsets))


def built(dtype: torch.dtype, block: int = BLOCK, offsets: bool = False) -> bool:
    """Whether the kernel runs for activations of `dtype`, `block` values a scale and (`offsets`) an
    offset a block here (built now if not yet)."""
    return dtype in CPP_TYPES and _build(dtype, block, offsets) is not None


def built_for(dtype: torch.dtype, type_name: str) -> bool:
    """Whether the kernel runs here for activations of `dtype` and a weight of GGUF type `type_name`
    (a BLOCK_OF type)."""
    return built(dtype, BLOCK_OF[type_name], type_name in OFFSET_TYPES)


def q8_0_linear(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    """x [num_tokens, in] (fp32 or bf16, CPU) @ dequantize(weight).T -> [num_tokens, out] in x's
    dtype, accumulated in fp32. The caller checks `built` (`built_for`) for x's dtype and the weight."""
    fn = _build(x.dtype, weight.block, weight.offsets is not None)
    assert fn is not None, "q8_0_linear called where the kernel is not built"
    x = x.contiguous()
    m, k = x.shape
    n = weight.values.shape[0]
    if k != weight.values.shape[1]:
        raise ValueError(f"input of {k} features for a Q8_0 weight of {weight.values.shape[1]}")
    y = torch.empty(m, n, dtype=x.dtype)
    if m:
        fn(x, *weight.tensors(), y, m, n, k, torch.get_num_threads())
    return y


def embedding(ids: torch.Tensor, weight: Q8Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [n] of the dequantized weight -> [n, in] in `dtype` (each value d * q, plus the
    offset where there is one: `dequantize`'s values, rounded to `dtype` as the dense embedding's copy
    was). Four ops (Q8_0, Q6_K; the offsets two more): ~28 us for one Q8_0 row and ~41 us for 64
    against ~5 us for `F.embedding` on the bf16 copy (two threads, the 49152 x 576 SmolLM2 embedding,
    the AVX512 VM of benchmarks/RESULTS.md "Q8_0 kept quantized on the CPU")."""
    n = ids.shape[0]
    values = weight.values.index_select(0, ids).view(n, -1, weight.block)    # [n, blocks, block] int8
    scales = weight.scales.index_select(0, ids).unsqueeze(-1)                # [n, blocks, 1]
    rows = torch.mul(values, scales)                                         # [n, blocks, block] fp32
    if weight.offsets is not None:
        rows += weight.offsets.index_select(0, ids).unsqueeze(-1)            # [n, blocks, 1]
    return rows.to(dtype).view(n, -1)                                        # [n, in]
