"""A C++ decode attention kernel for the CPU that reads K/V where the paged cache holds them.

The torch-only decode path (cpu_attn.decode_attention without this kernel) first copies every
sequence's K/V into `[kv_heads, num_seqs, len, d]` matrices (a gather, or the decode mirror
that keeps last step's), then runs two batched oneDNN bf16 products around an fp32 softmax;
the scores product repacks the transposed K and reads it at ~9 GB/s, and the whole masked
capacity is read (benchmarks/RESULTS.md "B2 CPU, round 11"). This kernel
(cpu_paged_decode.cpp) walks each sequence's block table and reads only its live rows, once:
one task per (sequence, KV head), each K and V row read once for the KV head's whole group
of query heads, fp32 accumulation, an exact fp32 softmax (two passes over a per-thread
scratch), the output rounded once to the query's dtype.

Build: through torch Inductor's C++ code cache (`CppPythonBindingsCodeCache`), which finds
the compiler as torch.compile does, needs no ninja, builds with OpenMP and the CPU's vector
ISA (at::vec), and keeps the library on disk: ~2-5 s the first time per (query dtype, cache
dtype), well under 1 s from the cache. `prepare` builds it at engine start-up; where there is
no C++ compiler, or the build fails, `kernel_for` returns None and the caller keeps its
torch-only path (no error, nothing printed).

fp8 caches (e4m3, e5m2) are dequantized in the kernel, element by element (exact), their
per-KV-head scales applied in fp32: the reference rounds the dequantized values to the query's
dtype first, so the two differ by that rounding.
"""
import functools
import logging
import threading
from pathlib import Path

import torch

from nanovllm.utils import cpp_compiler

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
# The C++ element types the source is built for (QUERY_TYPE: query and output, CACHE_TYPE: cache).
CPP_TYPES = {
    torch.float32: "float",
    torch.bfloat16: "at::BFloat16",
    torch.float16: "at::Half",
    torch.float8_e4m3fn: "c10::Float8_e4m3fn",
    torch.float8_e5m2: "c10::Float8_e5m2",
}
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# head_dim must be a whole number of vectors: 16 floats with AVX512, 8 with AVX2.
HEAD_DIM_MULTIPLE = 16
# A sequence's keys are split into partitions (tasks of their own, merged afterwards) only where
# (sequence, KV head) pairs are fewer than TASKS_PER_THREAD per thread, and never into partitions
# shorter than MIN_PARTITION_KEYS keys (benchmarks/RESULTS.md "B2 CPU, round 12").
TASKS_PER_THREAD = 4
# Blocks ahead of the one being read whose rows the kernel prefetches (a sequence's blocks lie
# anywhere): cold, 30 layers in turn, two threads, bf16, 16 / 64 rows: 0 blocks 372 / 1,167 us a
# layer, 1 block 307 / 1,059, 2 blocks 297 / 1,008 (RESULTS.md "B2 CPU, round 12").
PREFETCH_BLOCKS = 2
MIN_PARTITION_KEYS = 256
_ARG_TYPES = (["const {q}*", "const {c}*", "const {c}*", "const int32_t*", "const int32_t*", "const float*",
               "const float*", "{q}*", "float*"] + ["long"] * 14 + ["float", "long"])

_local = threading.local()  # per-thread scratch for partitions (two engines in two threads)


def supports(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel is built for these dtypes and head size (compiler aside)."""
    cache_ok = cache_dtype == q_dtype or cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return q_dtype in QUERY_DTYPES and cache_ok and head_dim % HEAD_DIM_MULTIPLE == 0


def kernel_for(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int):
    """The built kernel for these dtypes, or None where it does not apply or cannot be built."""
    if not supports(q_dtype, cache_dtype, head_dim) or not cpp_compiler.cpp_compiler_found():
        return None
    return _build(q_dtype, cache_dtype, head_dim)


def prepare(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Build the kernel now (engine start-up) rather than at the first decode step; whether it runs."""
    return kernel_for(q_dtype, cache_dtype, head_dim) is not None


@functools.cache
def _build(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int):
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    q, c = CPP_TYPES[q_dtype], CPP_TYPES[cache_dtype]
    macros = {"QUERY_TYPE": q, "CACHE_TYPE": c, "HEAD_DIM": head_dim, "PREFETCH_BLOCKS": PREFETCH_BLOCKS}
    source = "".join(f"#define {name} {value}\n" for name, value in macros.items()) + SOURCE.read_text()
    try:
        return CppPythonBindingsCodeCache.load_pybinding([t.format(q=q, c=c) for t in _ARG_TYPES], source)
    except Exception as e:  # a compiler that cannot build it: the torch-only path stays
        logger.debug("cpu_paged_decode: build failed for %s / %s: %s", q_dtype, cache_dtype, e)
        return None


def decode_attention(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens_k: torch.Tensor, block_tables: torch.Tensor, scale: float, max_seqlen_k: int,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its paged context, by `kernel` (from `kernel_for`).

    q:            [num_seqs, num_heads, d]
    k/v_cache:    [num_blocks, block_size, kv_heads, d], any strides with d contiguous
    seq_lens_k:   [num_seqs]; block_tables: [num_seqs, max_blocks] (-1 padded)
    max_seqlen_k: the longest of seq_lens_k
    k/v_scale:    [kv_heads] float32, for an fp8 cache
    Returns:      [num_seqs, num_heads, d] in q's dtype
    """
    num_seqs, num_heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head_dim must be contiguous"
    q = q.contiguous()
    out = torch.empty_like(q)
    tables, lens = block_tables.to(torch.int32).contiguous(), seq_lens_k.to(torch.int32).contiguous()
    threads = torch.get_num_threads()
    num_parts, part_len = partitions(num_seqs * kv_heads, max_seqlen_k, threads)
    group = num_heads // kv_heads
    partials = _scratch(num_seqs * kv_heads * num_parts * group * (d + 2) if num_parts > 1 else 0)
    ones = _ones(kv_heads)
    kernel(q, k_cache, v_cache, tables, lens, ones if k_scale is None else k_scale.float().contiguous(),
           ones if v_scale is None else v_scale.float().contiguous(), out, partials, num_seqs, num_heads,
           kv_heads, d, block_size, tables.shape[1], *k_cache.stride()[:3], *v_cache.stride()[:3], part_len,
           num_parts, scale, threads)
    return out


def partitions(num_pairs: int, max_len: int, threads: int) -> tuple[int, int]:
    """(partitions per sequence, keys per partition): one partition of max_len keys unless the
    (sequence, KV head) pairs leave threads idle and the keys are many (module constants)."""
    wanted = threads * TASKS_PER_THREAD
    max_parts = max(1, max_len // MIN_PARTITION_KEYS)
    num_parts = min(max_parts, -(-wanted // num_pairs)) if num_pairs < wanted else 1
    part_len = -(-max_len // num_parts)
    return -(-max_len // part_len), part_len


def _scratch(numel: int) -> torch.Tensor:
    """This thread's fp32 scratch of at least `numel` elements (grown when too small)."""
    buf = getattr(_local, "partials", None)
    if buf is None or buf.numel() < max(numel, 1):
        buf = torch.empty(max(numel, 1), dtype=torch.float32)
        _local.partials = buf
    return buf


@functools.cache
def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32)
