"""CPU dense products: oneDNN's pre-packed fp32 weights for batches, MKL's plain product for one row.

`F.linear` on the CPU runs MKL's sgemm on the weight as stored, re-blocking it on every
call. oneDNN can block a weight once, at load (`torch.ops.mkldnn._reorder_linear_weight`),
and then multiply by it directly (`torch.ops.mkldnn._linear_pointwise`). On the AVX2 CPU of
benchmarks/RESULTS.md ("B2 CPU, round 3") that made a step of SmolLM2-135M's 120 linear
layers and its LM head (one thread, fp32) faster from 4 rows on, and the LM head about
twice as fast (64 rows: 61.8 against 102.5 ms); for 1 or 2 rows (a matrix-vector
product, bound by memory) the column-major weight with `F.linear` stays faster
(kernels/cpu_linear.py), so both are kept: the packed copy costs the weight's bytes again.

bf16 weights are packed too where the CPU multiplies bf16 fast (AVX512-BF16, AMX:
utils/device.py), the only CPUs whose engines run bf16 by default: there the packed product
was faster than `F.linear` on the bf16 weight at every row count (PACKED_MIN_ROWS_BF16 has the
figures). The values differ from `F.linear`'s by rounding
(another summation order), as any two gemm kernels do.
"""
import functools

import torch
import torch.nn.functional as F

from nanovllm.kernels import cpu_int8_dynamic
from nanovllm.utils.device import cpu_has_fast_bf16

# Rows from which the packed product is used; below it the column-major `F.linear`. Measured
# on AVX2 (fp32, one thread, benchmarks/bench_cpu_gemm.py): 2 rows 55.5 (packed) against 51.7 ms
# (column-major) for the 120 layers, 4 rows 58.1 against 83.9 ms.
PACKED_MIN_ROWS = 3
# The same for bf16 weights and activations, on AVX512-BF16 (benchmarks/RESULTS.md "B2 CPU, round 8";
# bench_cpu_gemm.py --kinds colbf dnnbf, one thread): the packed product was faster at every row
# count measured, one row included (120 layers + LM head: 1 row 21.8 + 4.1 ms against 34.2 + 11.8
# for the column-major `F.linear`, 64 rows 91.7 + 22.5 against 115.1 + 30.5, 256 rows 287.6 + 71.6
# against 313.9 + 81.7), so every bf16 product runs it and no dense bf16 weight is kept for it.
PACKED_MIN_ROWS_BF16 = 1
# The batch size oneDNN is told to block for. 64 (a full decode batch) also served 512-row
# prefill chunks as well as a weight blocked for 512 did (benchmarks/RESULTS.md).
PACK_BATCH_HINT = 64


@functools.cache
def can_pack(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build packs `dtype` weights with oneDNN (a tiny trial, once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 16, dtype=dtype)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(4, 16, dtype=dtype), pack(w), None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(y.float(), torch.full((4, 16), 16.0)))


def packs(dtype: torch.dtype) -> bool:
    """Whether dense weights of `dtype` get a packed copy: fp32 wherever oneDNN packs, bf16 where
    the CPU multiplies bf16 fast (elsewhere oneDNN's bf16 products are emulated and slow)."""
    if dtype == torch.bfloat16:
        return cpu_has_fast_bf16() and can_pack(dtype)
    return dtype == torch.float32 and can_pack(dtype)


def packed_min_rows(dtype: torch.dtype) -> int:
    """Rows from which a `dtype` product runs the packed copy (where the dense weight is kept)."""
    return PACKED_MIN_ROWS_BF16 if dtype == torch.bfloat16 else PACKED_MIN_ROWS


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] fp32 or bf16 -> oneDNN's blocked copy (an opaque mkldnn tensor, same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def dense_linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 packed: torch.Tensor | None, int8: "cpu_int8_dynamic.Int8Weight | None" = None) -> torch.Tensor:
    """x [num_tokens, in] @ weight.T (+ bias) -> [num_tokens, out]; by the int8 copy where there
    is one and the batch has its `min_rows` (kernels/cpu_int8_dynamic.py); else by the packed
    weight where there is one of x's dtype and the batch has `packed_min_rows` rows or more, or
    where only the packed copy is kept (`weight` None: kernels/cpu_linear.py drops what no batch
    reads)."""
    if int8 is not None and x.dtype == torch.float32 and x.shape[0] >= int8.min_rows:
        return cpu_int8_dynamic.int8_linear(x, int8, bias)
    if packed is not None and x.dtype == packed.dtype and (weight is None or
                                                           x.shape[0] >= packed_min_rows(x.dtype)):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    assert weight is not None, "a layer without its dense weight got a batch its packed copy cannot run"
    return F.linear(x, weight, bias)
