"""Argmax over the vocabulary on the CPU, in two vectorized passes.

torch's CPU `argmax` along the last dimension runs a scalar loop: for one decode step of
64 sequences over SmolLM2's 49,152-token vocabulary it took 17.8 ms on one thread of the
AVX2 machine of benchmarks/RESULTS.md ("B2 CPU, round 4"), against 2.5 ms for `amax` over
the same values split into chunks of 1,024 (a vectorized reduction), and about 2.2 ms for
the whole two-step argmax below in an engine's trace. The two steps:

1. the maximum of each chunk of `chunk` columns (the first of `CHUNKS` that divides the
   vocabulary), `[rows, vocab / chunk]`, and the first chunk holding the row's maximum
   (a small argmax);
2. the first position of that maximum inside that chunk (an argmax over `chunk` values).

That is exactly torch's answer, ties included (the lowest index wins: the first chunk
holding the maximum, then the first position in it), NaN included (`amax` and `argmax`
both take NaN as the largest value). A vocabulary that no chunk size divides takes
torch's argmax unchanged.

Where a C++ compiler is found (utils/cpp_compiler.py, as the other CPU kernels), contiguous
fp32 / bf16 / fp16 rows take one call of cpu_argmax.cpp instead (the same two passes in float
vectors, the same answer): in an engine's one-sequence step, right after the LM head has
streamed its weights through the caches, the six torch ops above took ~0.24 ms for one row of
49,152 (each op's dispatch then misses the caches), against ~0.05 ms measured alone
(benchmarks/RESULTS.md "One-sequence decode steps: host time (nineteenth session)").
"""
import functools
from pathlib import Path

import torch

from nanovllm.utils import cpp_compiler

SOURCE = Path(__file__).with_suffix(".cpp")
CPP_TYPES = {torch.float32: "float", torch.bfloat16: "at::BFloat16", torch.float16: "at::Half"}
_ARG_TYPES = ["const {t}*", "int64_t*", "long", "long", "long"]  # kernel() in cpu_argmax.cpp
CHUNKS = (1024, 512, 256, 128)  # chunk sizes tried, largest first: the first that divides the vocab
MIN_VOCAB = 8192                # below this the scalar argmax is cheap enough


@functools.cache
def _build(dtype: torch.dtype):
    """The built C++ argmax for rows of `dtype`, or None (no compiler and no library built before)."""
    source = cpp_compiler.source(SOURCE, {"ELEMENT_TYPE": CPP_TYPES[dtype]})
    return cpp_compiler.build(source, [t.format(t=CPP_TYPES[dtype]) for t in _ARG_TYPES])


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, vocab] -> [rows] int64: `x.argmax(-1)`, faster on the CPU."""
    rows, vocab = x.shape
    if x.is_cpu and x.dtype in CPP_TYPES and x.is_contiguous() and not torch.compiler.is_compiling():
        fn = _build(x.dtype)
        if fn is not None:
            out = torch.empty(rows, dtype=torch.int64)  # [rows]
            fn(x, out, rows, vocab, torch.get_num_threads())
            return out
    chunk = next((c for c in CHUNKS if vocab % c == 0), None)
    if x.is_cuda or chunk is None or vocab < MIN_VOCAB or x.stride(-1) != 1:
        return x.argmax(-1)
    chunks = x.view(rows, vocab // chunk, chunk) if x.is_contiguous() else x.reshape(rows, vocab // chunk, chunk)
    best_chunk = chunks.amax(-1).argmax(-1)                      # [rows]
    within = chunks[torch.arange(rows), best_chunk].argmax(-1)   # [rows]
    return best_chunk * chunk + within
