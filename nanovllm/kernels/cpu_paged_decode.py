"""A C++ decode attention kernel for the CPU that reads K/V where the paged cache holds them.

The torch-only decode path (cpu_attn.decode_attention without this kernel) first copies every
sequence's K/V into `[kv_heads, num_seqs, len, d]` matrices (a gather, or the decode mirror
that keeps last step's), then runs two batched oneDNN bf16 products around an fp32 softmax;
the scores product repacks the transposed K and reads it at ~9 GB/s, and the whole masked
capacity is read (benchmarks/RESULTS.md "B2 CPU, round 11"). This kernel
(cpu_paged_decode.cpp) walks each sequence's block table and reads only its live rows, once:
one task per (sequence, KV head), each K and V row read once for the KV head's whole group
of query heads, fp32 accumulation, an exact fp32 softmax (two passes over a per-thread
scratch), the output rounded once to the query's dtype; the GIL released while it runs. On the
2-core AVX512-BF16 VM (RESULTS.md "B2 CPU, round 12"): 1.1-9x faster a layer than the torch-only
path, cold (it too is limited by reading K and V, in 2 KB pieces at ~9 GB/s at 64 rows, but
copies nothing and reads only live rows); the engine's decode steps 0.80-0.89x eager, 0.81-0.84x
compiled, at 16-64 rows. So it runs wherever it can be built, at every row count.

Build: `utils/cpp_compiler.build`, through torch Inductor's C++ code cache (the compiler
torch.compile finds, no ninja, OpenMP, the CPU's vector ISA for at::vec), one library per
(dtype, head_dim): ~2-5 s the first time on a machine, then loaded from a kept copy without
Inductor. `prepare` builds it at engine start-up; where there is no C++ compiler (and no library
built before), or the build fails, `kernel_for` returns None and the caller keeps its torch-only
path (no error, nothing printed).

bf16 caches on CPUs with AVX512-BF16 (the engine's bf16 kind) take rows of their own in the
C++: each K/V row is converted once for the whole group of query heads (the generic rows convert
it once per head), the scores are `vdpbf16ps` dot products (exact bf16 products summed in fp32,
in another order than the generic rows: the scores differ at fp32 rounding, and B2's greedy ids
part from the generic rows' only at near-ties), the values the generic rows' fmadd in the same
order (their bits). SmolLM2's B2 decode steps (64 rows, two threads): the attention 11.5 against
13.3 ms a step; one layer's K/V in cache, 5.9 against 8.1 ms for 30 calls (RESULTS.md "B2 CPU,
round 15"). Elsewhere (fp32, fp16, AVX2) the generic rows run.

fp8 caches stay on the torch-only path: a first version of this kernel that dequantized e4m3
element by element (c10's exact conversion) ran 4-13x slower than it (RESULTS.md "B2 CPU,
round 12").
"""
import functools
import threading
from pathlib import Path

import torch

from nanovllm.utils import cpp_compiler

SOURCE = Path(__file__).with_suffix(".cpp")
# The C++ element types (ELEMENT_TYPE: query, cache and output) the source is built for.
CPP_TYPES = {torch.float32: "float", torch.bfloat16: "at::BFloat16", torch.float16: "at::Half"}
# head_dim must be a whole number of vectors: 16 floats with AVX512, 8 with AVX2.
HEAD_DIM_MULTIPLE = 16
# A sequence's keys are split into partitions (tasks of their own, merged afterwards) only where
# (sequence, KV head) pairs are fewer than TASKS_PER_THREAD per thread, and never into partitions
# shorter than MIN_PARTITION_KEYS keys: one row of ~16,000 tokens, two threads, 1,462 against 1,607
# us a layer without partitions, within noise at ~1,000 (benchmarks/RESULTS.md "B2 CPU, round 12").
TASKS_PER_THREAD = 4
MIN_PARTITION_KEYS = 256
# Blocks ahead of the one being read whose rows the kernel prefetches (a sequence's blocks lie
# anywhere): cold, 30 layers in turn, two threads, bf16, 16 / 64 rows: 0 blocks 372 / 1,167 us a
# layer, 1 block 307 / 1,059, 2 blocks 297 / 1,008 (RESULTS.md "B2 CPU, round 12"); prefetched
# into L2 since round 15 (its B2-like 64 rows: 1 and 2 blocks alike, 3 and 4 slower).
PREFETCH_BLOCKS = 2
# the C++ entry point's arguments (kernel() in cpu_paged_decode.cpp), {t} the element type
_ARG_TYPES = (["const {t}*"] * 3 + ["const int32_t*"] * 2 + ["{t}*", "float*"] + ["long"] * 14
              + ["float", "long"])

_local = threading.local()  # per-thread scratch for partitions (two engines in two threads)


def supports(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel is built for these dtypes and head size (compiler aside)."""
    return q_dtype in CPP_TYPES and cache_dtype == q_dtype and head_dim % HEAD_DIM_MULTIPLE == 0


def kernel_for(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int):
    """The built kernel for these dtypes, or None where it does not apply or cannot be built (no C++
    compiler and no library built before)."""
    if not supports(q_dtype, cache_dtype, head_dim):
        return None
    return _build(q_dtype, head_dim)


def prepare(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Build the kernel now (engine start-up) rather than at the first decode step; whether it runs."""
    return kernel_for(q_dtype, cache_dtype, head_dim) is not None


@functools.cache
def _build(dtype: torch.dtype, head_dim: int):
    return cpp_compiler.build(source_for(dtype, head_dim), arg_types(dtype))


def source_for(dtype: torch.dtype, head_dim: int) -> str:
    """cpu_paged_decode.cpp with the macros it is built with."""
    macros = {"ELEMENT_TYPE": CPP_TYPES[dtype], "HEAD_DIM": head_dim, "PREFETCH_BLOCKS": PREFETCH_BLOCKS}
    return cpp_compiler.source(SOURCE, macros)


def arg_types(dtype: torch.dtype) -> list[str]:
    """The C++ entry point's argument types (kernel() in cpu_paged_decode.cpp)."""
    return [t.format(t=CPP_TYPES[dtype]) for t in _ARG_TYPES]


def decode_attention(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens_k: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     max_seqlen_k: int) -> torch.Tensor:
    """One query per sequence over its paged context, by `kernel` (from `kernel_for`).

    q:            [num_seqs, num_heads, d]
    k/v_cache:    [num_blocks, block_size, kv_heads, d], q's dtype, any strides with d contiguous
    seq_lens_k:   [num_seqs]; block_tables: [num_seqs, max_blocks] (-1 padded)
    max_seqlen_k: the longest of seq_lens_k
    Returns:      [num_seqs, num_heads, d] in q's dtype
    """
    return DecodeStep(kernel, k_cache, seq_lens_k, block_tables, scale, max_seqlen_k)(q, k_cache, v_cache)


class DecodeStep:
    """`decode_attention`'s arguments that every layer of a step shares (the tables, the
    partitions), prepared once; called per layer with its q and caches, which
    must have the shape and strides of the `k_cache` given here."""

    def __init__(self, kernel, k_cache: torch.Tensor, seq_lens_k: torch.Tensor,
                 block_tables: torch.Tensor, scale: float, max_seqlen_k: int):
        self.kernel, self.scale = kernel, scale
        _, self.block_size, self.kv_heads, _ = k_cache.shape
        self.num_seqs = seq_lens_k.shape[0]
        self.tables = block_tables.to(torch.int32).contiguous()  # [num_seqs, max_blocks]
        self.lens = seq_lens_k.to(torch.int32).contiguous()      # [num_seqs]
        self.threads = torch.get_num_threads()
        self.num_parts, self.part_len = partitions(self.num_seqs * self.kv_heads, max_seqlen_k, self.threads)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [num_seqs, num_heads, d] -> [num_seqs, num_heads, d]"""
        num_seqs, num_heads, d = q.shape
        assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head_dim must be contiguous"
        q = q.contiguous()
        out = torch.empty_like(q)
        partials = self.scratch(num_heads, d)
        self.kernel(q, k_cache, v_cache, self.tables, self.lens, out, partials, num_seqs, num_heads, self.kv_heads, d,
                    self.block_size, self.tables.shape[1], *k_cache.stride()[:3], *v_cache.stride()[:3],
                    self.part_len, self.num_parts, self.scale, self.threads)
        return out

    def scratch(self, num_heads: int, d: int) -> torch.Tensor:
        """The fp32 scratch the kernel's partitions write for this step (a placeholder without partitions)."""
        group = num_heads // self.kv_heads
        return _scratch(self.num_seqs * self.kv_heads * self.num_parts * group * (d + 2) if self.num_parts > 1 else 0)


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
