"""CPU int8 products for batches: FBGEMM's dynamic int8 linear on an int8 copy of a dense weight.

`torch.ops.quantized.linear_dynamic(x, packed, reduce_range)` multiplies fp32 activations by a
weight prepacked as per-output-channel symmetric int8 (`torch.ops.quantized.linear_prepack`):
it quantizes `x` to uint8 with one scale and zero point for the whole tensor at run time,
runs FBGEMM's u8 x s8 -> int32 product and returns fp32. `reduce_range=True` (x86: AVX2
without VNNI sums pairs of u8 x s8 products in int16, which 8-bit activations could
overflow) leaves the activations 7 bits.

Per-token activation scales: the kernel takes one scale for the tensor, so each row is
divided by its own absolute maximum first (every row then spans [-1, 1], and the tensor's
scale is every row's) and the product's row multiplied back: a row of small values (most
tokens, beside one with large ones) keeps its 7 bits instead of sharing the largest row's
grid. That costs an [M, in] and an [M, out] elementwise pass (and ~50 us of calls, so one row
takes FBGEMM's own asymmetric scale, which is that row's).

Error: the weight is off by at most half a step of its row (max |w| / 254) on top of
whatever it already was (a dequantized GGUF 4-bit weight); the activations by half a step
of 1/127 of their range (per token, or per tensor). benchmarks/RESULTS.md ("B2 CPU, round
7") has what that does to the embedded SmolLM2's logprobs and greedy ids, and where the
kernel beats the oneDNN-packed fp32 product (kernels/cpu_gemm.py) by row count.

torch 2.13 warns that quantized tensors (`torch.quantize_per_channel`, which the prepack
takes) are deprecated (torch issue 184982); torch has no other entry to FBGEMM's int8 linear
(oneDNN's `torch.ops.onednn.qlinear_pointwise` takes plain int8 tensors but was 2-4x slower
here), so the warning is silenced at that one call, at load.
"""
import dataclasses
import functools
import warnings

import torch

INT8_MAX = 127
# Rows from which a layer's batches run this kernel. Measured on AVX2 (SmolLM2-135M's 120 layers
# and LM head, one thread, benchmarks/bench_cpu_gemm.py; RESULTS "B2 CPU, round 7"): faster than
# the int4 kernel and the fp32 products at every row count from 1 (1 row: 16.2 + head 3.2 ms
# against int4's 21.3 + the column-major head's 8.1; 64 rows: 158 + 48 against oneDNN fp32's
# 278 + 64). Only fp32 engines use it (bf16 CPUs keep their bf16 products); AVX512 CPUs without
# fast bf16 (VNNI or not) were not measured and take this value.
INT8_MIN_ROWS = 1
PER_TOKEN = True  # per-token activation scales (the row scaling above); False: FBGEMM's per tensor
# Input features rotated in blocks of this many by a normalized Hadamard matrix H (weight W H at
# load, activations x H at run time; x W^T = (x H)(W H)^T as H H^T = 1), which spreads each
# channel's outliers over its block; 0: no rotation. A power of 2 dividing the input size.
ROTATION_BLOCK = 64
# 7: uint8 activations in 7 bits (reduce_range) against 8-bit weights; 8: all 8 bits against 7-bit
# weights (|w| <= 63), which keeps AVX2's int16 pair sums (2 x 255 x 63) from saturating too
ACTIVATION_BITS = 7


@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """A layer's int8 copy for batches: FBGEMM's packed params and the rows it starts at."""
    packed: torch.ScriptObject  # LinearPackedParamsBase: per-channel qint8 weight [out, in]
    min_rows: int
    out_features: int
    rotation_block: int  # the weight's input features rotated in blocks of this many (0: none)


@functools.cache
def can_run() -> bool:
    """Whether this torch build has FBGEMM's dynamic int8 linear (x86 builds do)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        y = int8_linear(torch.ones(2, 16), prepack(torch.ones(16, 16), 1), None)
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(y, torch.full((2, 16), 16.0), rtol=1e-2))


def weight_max() -> int:
    """The largest int8 weight magnitude: 127, or 63 with 8-bit activations (module docstring)."""
    return INT8_MAX if ACTIVATION_BITS == 7 else INT8_MAX // 2


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of w [out, in]: (q int8 [out, in], scale fp32 [out])."""
    top = weight_max()
    scale = (w.float().abs().amax(1) / top).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w.float() / scale.unsqueeze(1)).round_().clamp_(-top, top).to(torch.int8)
    return q, scale


@functools.cache
def hadamard(n: int) -> torch.Tensor:
    """The normalized Sylvester-Hadamard matrix [n, n] (n a power of 2): symmetric, H H = 1."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def rotation_block(in_features: int) -> int:
    """The rotation block for a layer of `in_features` inputs (0: none)."""
    return ROTATION_BLOCK if ROTATION_BLOCK and in_features % ROTATION_BLOCK == 0 else 0


def rotate(t: torch.Tensor, block: int) -> torch.Tensor:
    """t [rows, in] -> t with each block of `block` input features multiplied by H. # [rows, in]"""
    return (t.reshape(-1, block) @ hadamard(block)).view(t.shape)


def prepack(weight: torch.Tensor, min_rows: int) -> Int8Weight:
    """weight [out, in] float -> its int8 form for FBGEMM (the float weight is not kept)."""
    block = rotation_block(weight.shape[1])
    w = weight.detach().float()
    q, scale = quantize_per_channel(rotate(w.contiguous(), block) if block else w)
    zero = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # the quantized-tensor deprecation (module docstring)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
    return Int8Weight(torch.ops.quantized.linear_prepack(qweight, None), min_rows, q.shape[0], block)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [num_tokens, in] fp32 -> [num_tokens, out] fp32 (+ bias), activations quantized at run time."""
    if weight.rotation_block:
        x = rotate(x, weight.rotation_block)
    if not PER_TOKEN or x.shape[0] == 1:  # one row: FBGEMM's own (per tensor) scale is per token
        y = torch.ops.quantized.linear_dynamic(x, weight.packed, ACTIVATION_BITS == 7)
    else:
        rows = x.abs().amax(1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)  # [num_tokens, 1]
        y = torch.ops.quantized.linear_dynamic(x / rows, weight.packed, ACTIVATION_BITS == 7).mul_(rows)
    return y if bias is None else y.add_(bias)
