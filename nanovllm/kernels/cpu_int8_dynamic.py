"""CPU int8 products: FBGEMM's dynamic int8 linear on a Hadamard-rotated int8 copy of a dense weight.

`torch.ops.quantized.linear_dynamic(x, packed, reduce_range)` multiplies fp32 activations by a
weight prepacked as per-output-channel symmetric int8 (`torch.ops.quantized.linear_prepack`):
it quantizes `x` to uint8 with one scale and zero point for the whole tensor at run time,
runs FBGEMM's u8 x s8 -> int32 product and returns fp32. `reduce_range=True` (x86: AVX2
without VNNI sums pairs of u8 x s8 products in int16, which 8-bit activations could
overflow) leaves the activations 7 bits.

Two things make that accurate enough on a real model's activations:

- Per-token scales: the kernel takes one scale for the tensor, so each row is divided by its
  own absolute maximum first (every row then spans [-1, 1], and the tensor's scale is every
  row's) and the product's row multiplied back: a row of small values beside one with large
  ones keeps its 7 bits instead of sharing the largest row's grid. One row takes FBGEMM's own
  asymmetric scale, which is that row's.
- The rotation: the input features of both sides are multiplied in blocks of 64 by a
  normalized Hadamard matrix H (the weight at load, the activations at run time; x W^T =
  (x H)(W H)^T as H H^T = 1), which spreads a channel of large values (LLMs have a few in
  every layer's input) over its block instead of leaving the other channels a few levels.

Error: the weight is off by at most half a step of its (rotated) row, max |w| / 254, on top
of whatever it already was (a dequantized GGUF 4-bit weight); each activation by half a step
of its row's max / 63.5. On the embedded SmolLM2's activations a layer's product is off by
~1.5-2.3% (5.8% without the rotation, more per tensor); benchmarks/RESULTS.md ("B2 CPU, round
7") has what that does to its logprobs and greedy ids, and the speed against the int4 kernel
and oneDNN's packed fp32 product (kernels/cpu_gemm.py) by row count.

torch 2.13 warns that quantized tensors (which the prepack takes) are deprecated (torch issue
184982); torch has no other entry to FBGEMM's int8 linear (oneDNN's
`torch.ops.onednn.qlinear_pointwise` takes plain int8 tensors but was ~4x slower than FBGEMM
here), so the warning is silenced at the one call that makes such a tensor, at load.
"""
import dataclasses
import functools
import warnings

import torch

INT8_MAX = 127
# Rows from which a layer's products run this kernel. Measured on AVX2 (SmolLM2-135M's 120 layers
# and LM head, one thread, benchmarks/bench_cpu_gemm.py; RESULTS "B2 CPU, round 7"): faster than
# oneDNN's fp32 product at every row count (64 rows: 226 + head 55 ms against 312 + 67) and than
# the int4 kernel from 2 rows; at 1 row the layers are as fast as int4's (30.8 against 27.0 ms
# there, the other way round in other runs) and the head faster than the column-major fp32 one
# (4.0 against 9.9 ms). Only fp32 engines use it; AVX512 CPUs without fast bf16 (VNNI or not)
# were not measured and take this value.
INT8_MIN_ROWS = 1
PER_TOKEN = True  # per-token activation scales (the row scaling above); False: FBGEMM's per tensor
# Input features rotated in blocks of this many (module docstring); 0: no rotation. A power of 2;
# a layer whose input size it does not divide is not rotated.
ROTATION_BLOCK = 64
# 7: uint8 activations in 7 bits (reduce_range) against 8-bit weights; 8: all 8 bits against 7-bit
# weights (|w| <= 63), which keeps AVX2's int16 pair sums (2 x 255 x 63) from saturating too
ACTIVATION_BITS = 7


@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """A layer's int8 copy: FBGEMM's packed params and the row count it runs from."""
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


def quantize_per_channel(w: torch.Tensor, top: int = INT8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of w [out, in], |q| <= top: (q int8 [out, in], scale fp32 [out])."""
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
    q, scale = quantize_per_channel(rotate(w.contiguous(), block) if block else w, weight_max())
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
