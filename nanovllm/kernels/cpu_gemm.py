"""CPU dense products: oneDNN's pre-packed fp32 weights for batches, MKL's plain product for one row.

`F.linear` on the CPU runs MKL's sgemm on the weight as stored, re-blocking it on every
call. oneDNN can block a weight once, at load (`torch.ops.mkldnn._reorder_linear_weight`),
and then multiply by it directly (`torch.ops.mkldnn._linear_pointwise`). On the AVX2 CPU of
benchmarks/RESULTS.md ("B2 CPU, round 3") that made a step of SmolLM2-135M's 120 linear
layers and its LM head (one thread, fp32) faster from 4 rows on, and the LM head about
twice as fast (64 rows: 61.8 against 102.5 ms); for 1 or 2 rows (a matrix-vector
product, bound by memory) the column-major weight with `F.linear` stays faster
(kernels/cpu_linear.py), so both are kept: the packed copy costs the weight's bytes again.

Only fp32 weights are packed: oneDNN's bf16 packing needs AVX512 (or AVX-NE-CONVERT), and
where bf16 is fast the engine's bf16 products go through oneDNN already. The values differ
from `F.linear`'s by fp32 rounding (another summation order), as any two gemm kernels do.
"""
import functools

import torch
import torch.nn.functional as F

from nanovllm.kernels import cpu_int8_dynamic

# Rows from which the packed product is used; below it the column-major `F.linear`. Measured
# on AVX2 (fp32, one thread, benchmarks/bench_cpu_gemm.py): 2 rows 55.5 (packed) against 51.7 ms
# (column-major) for the 120 layers, 4 rows 58.1 against 83.9 ms.
PACKED_MIN_ROWS = 3
# The batch size oneDNN is told to block for. 64 (a full decode batch) also served 512-row
# prefill chunks as well as a weight blocked for 512 did (benchmarks/RESULTS.md).
PACK_BATCH_HINT = 64


@functools.cache
def can_pack() -> bool:
    """Whether this torch build packs fp32 weights with oneDNN (a tiny trial, once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 16)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(4, 16), pack(w), None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(y, torch.full((4, 16), 16.0)))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] fp32 -> oneDNN's blocked copy (an opaque mkldnn tensor, same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def dense_linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 packed: torch.Tensor | None, int8: "cpu_int8_dynamic.Int8Weight | None" = None) -> torch.Tensor:
    """x [num_tokens, in] @ weight.T (+ bias) -> [num_tokens, out]; by the int8 copy where there
    is one and the batch has its `min_rows` (kernels/cpu_int8_dynamic.py); else by the packed
    weight where there is one and the batch has PACKED_MIN_ROWS rows or more, or where only the
    packed copy is kept (`weight` None: kernels/cpu_linear.py drops what no batch reads)."""
    if int8 is not None and x.dtype == torch.float32 and x.shape[0] >= int8.min_rows:
        return cpu_int8_dynamic.int8_linear(x, int8, bias)
    if packed is not None and x.dtype == torch.float32 and (weight is None or x.shape[0] >= PACKED_MIN_ROWS):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    assert weight is not None, "a layer without its dense weight got a batch its packed copy cannot run"
    return F.linear(x, weight, bias)
