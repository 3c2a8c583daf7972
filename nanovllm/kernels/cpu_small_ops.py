"""A decode step's small ops on the CPU in C++: residual add + RMSNorm, RoPE + K/V store, SiLU-and-mul.

In eager mode each of these is several torch ops (fused_ops.py: the RMSNorm with its residual add
~8, RoPE ~10 with the two `index_copy_` of the store, SiLU-and-mul 3), and each op pays torch's
dispatch and, from 32,768 elements, an OpenMP fork and join on top of its own few microseconds of
work. At 64 rows on the 2-core AVX512-BF16 VM (benchmarks/RESULTS.md "B2 CPU, round 13";
benchmarks/profile_cpu_step.py, two threads) the 61 RMSNorms of a decode step took 9.3 ms, the 30
RoPEs 7.0 ms, the 30 SiLU-and-muls 3.7 ms: 17% of a 116 ms step. Here each is one call of a C++
function (cpu_small_ops.cpp) that reads its rows once, computes in fp32 and rounds where the torch
code rounds: RoPE, the store and SiLU-and-mul give the same bits as that code; the RMSNorm's sum of
squares is summed in another order (a bf16/fp16 output can differ by a step, a few in a million;
fp32 keeps torch's `F.rms_norm`, so fp32 runs are unchanged). The engine's decode steps took 0.81-0.83x
as long at 64 rows and 0.88-0.95x at one (the torch code and this alternating in one engine).

Where they run: on CPU tensors of a dtype they are built for (fp32, bf16, fp16), outside
`torch.compile` (a compiled forward fuses the torch code itself), on the shapes the functions check
(`rms_norm`, `rope_store`, `silu_and_mul` return None otherwise and the caller runs its torch
code). RoPE runs with the store only, in place on the qkv product's output (the layer's q and k are
views of it): the attention layer asks for it (`Attention.kv_store`) where the cache is not fp8 and
no scales are being calibrated, and then does not store K/V again.

Built like the paged decode kernel (kernels/cpu_paged_decode.py): `utils/cpp_compiler.build`
through Inductor's C++ code cache (the compiler torch.compile finds, -march=native, the CPU's vector
ISA for at::vec, -ffp-contract=off, OpenMP), one library per (op, dtype[, head_dim]), kept and
loaded directly in later processes; `prepare` builds them at engine start-up. Without a C++ compiler
(and no library built before) every function returns None and the torch code runs.
"""
import functools
from pathlib import Path

import torch

from nanovllm.utils import cpp_compiler

SOURCE = Path(__file__).with_suffix(".cpp")
CPP_TYPES = {torch.float32: "float", torch.bfloat16: "at::BFloat16", torch.float16: "at::Half"}
OPS = {"rms_norm": "OP_RMS_NORM", "rope_store": "OP_ROPE_STORE", "silu_mul": "OP_SILU_MUL"}
# The C++ entry points' arguments, {t} the element type (kernel() of each OP in cpu_small_ops.cpp)
ARG_TYPES = {
    "rms_norm": ["const {t}*"] * 3 + ["{t}*"] * 2 + ["long"] * 3 + ["float", "long"],
    "rope_store": ["{t}*", "const int64_t*", "const float*", "{t}*", "{t}*", "const int64_t*"] + ["long"] * 12,
    "silu_mul": ["const {t}*", "{t}*"] + ["long"] * 3,
}
# Below this many elements an op runs on one thread: torch's own grain (at::internal::GRAIN_SIZE),
# under which its elementwise ops do not fork either.
PARALLEL_MIN_ELEMENTS = 32768
# The longest row the C++ keeps in fp32 on its stack (RMSNorm's hidden size, SiLU's width)
MAX_ROW = 8192
# RoPE's head size: each half a whole number of vector pairs (2 x 16 floats with AVX512)
HEAD_DIM_MULTIPLE = 64


def _source(op: str, dtype: torch.dtype, head_dim: int) -> str:
    macros = {"ELEMENT_TYPE": CPP_TYPES[dtype], "OP": OPS[op], "HEAD_DIM": head_dim,
              "PARALLEL_MIN_ELEMENTS": PARALLEL_MIN_ELEMENTS}
    return cpp_compiler.source(SOURCE, macros)


@functools.cache
def _build(op: str, dtype: torch.dtype, head_dim: int = 0):
    """The built function, or None (no compiler and no library built before, or a build error)."""
    return cpp_compiler.build(_source(op, dtype, head_dim), [t.format(t=CPP_TYPES[dtype]) for t in ARG_TYPES[op]])


def function(op: str, dtype: torch.dtype, head_dim: int = 0):
    """The built C++ function of `op` (OPS) for `dtype` (and RoPE's `head_dim`), or None: for callers
    that check their tensors once and then call it directly (engine/cpu_decode_plan.py)."""
    return _build(op, dtype, head_dim) if dtype in CPP_TYPES else None


def _runs_here(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in CPP_TYPES and not torch.compiler.is_compiling()


def prepare(dtype: torch.dtype, head_dim: int) -> bool:
    """Build the three ops for `dtype` (and RoPE's `head_dim`) now, at engine start-up; whether they
    all run (False: no C++ compiler, or a dtype / head size they are not built for)."""
    if dtype not in CPP_TYPES:
        return False
    built = [_build("rms_norm", dtype), _build("silu_mul", dtype)]
    if head_dim % HEAD_DIM_MULTIPLE == 0:
        built.append(_build("rope_store", dtype, head_dim))
    return all(fn is not None for fn in built) and head_dim % HEAD_DIM_MULTIPLE == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """As fused_ops.rms_norm (norm(x), or (norm(x + residual), x + residual)) for x [n, hidden];
    None where the C++ does not apply (the caller runs its torch code)."""
    if not (_runs_here(x) and x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype
            and weight.is_contiguous() and x.shape[1] <= MAX_ROW
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                      and residual.is_contiguous()))):
        return None
    fn = _build("rms_norm", x.dtype)
    if fn is None:
        return None
    n, hidden = x.shape
    out = torch.empty_like(x)
    summed = out if residual is None else torch.empty_like(x)  # (not written without a residual)
    fn(x, x if residual is None else residual, weight, out, summed, n, hidden, int(residual is not None), eps,
       torch.get_num_threads())
    return out if residual is None else (out, summed)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """x [n, 2d] (gate | up) -> silu(gate) * up [n, d], as fused_ops.silu_and_mul; None where the
    C++ does not apply."""
    if not (_runs_here(x) and x.dim() == 2 and x.is_contiguous() and x.shape[1] % 2 == 0
            and x.shape[1] // 2 <= MAX_ROW):
        return None
    fn = _build("silu_mul", x.dtype)
    if fn is None:
        return None
    n, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(n, d, dtype=x.dtype)
    fn(x, out, n, d, torch.get_num_threads())
    return out


def rope_store_built(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the C++ RoPE + store is built for `dtype` and `head_dim` (built now if not yet)."""
    return dtype in CPP_TYPES and head_dim % HEAD_DIM_MULTIPLE == 0 and _build("rope_store", dtype, head_dim) is not None


def rope_store_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `rope_store` takes these: q [n, heads, d], k and v [n, kv_heads, d], consecutive views
    of one qkv row ([n, (heads + 2 kv_heads) d], d contiguous), a cache of their dtype, a head size
    it is built for, and the C++ built."""
    if not (_runs_here(q) and k.dtype == q.dtype and v.dtype == q.dtype and k_cache.dtype == q.dtype):
        return False
    d = q.shape[-1]
    if d % HEAD_DIM_MULTIPLE or k_cache.stride(-1) != 1 or q.stride(-1) != 1 or q.stride(-2) != d:
        return False
    heads, kv_heads = q.shape[1], k.shape[1]
    row = q.stride(0)
    # one token: its row stride is never used, and views of a one-row qkv may report any stride
    # there (a size-1 dimension's): q's is then 576 and k's 192 for SmolLM2 though they share a row
    rows_match = q.shape[0] == 1 or (k.stride(0) == row and v.stride(0) == row)
    if (not rows_match or k.stride(1) != d or v.stride(1) != d
            or k.data_ptr() != q.data_ptr() + heads * d * q.element_size()
            or v.data_ptr() != k.data_ptr() + kv_heads * d * q.element_size()):
        return False
    return _build("rope_store", q.dtype, d) is not None


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
    """q and k rotated in place (fused_ops._rotate's arithmetic), then each token's k and v written
    to the caches at its slot (slot -1: not written). Shapes as `rope_store_applies` checks;
    positions and slot_mapping [n] int64; cos_sin_cache [max_position, d] fp32 (cos | sin);
    k/v_cache [num_blocks, block_size, kv_heads, d], any strides with d contiguous."""
    fn = _build("rope_store", q.dtype, q.shape[-1])
    n, heads, _ = q.shape
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    table = cos_sin_cache.to(torch.float32).contiguous()
    fn(q, positions, table, k_cache, v_cache, slots, n, q.stride(0), heads, k.shape[1], k_cache.shape[1],
       *k_cache.stride()[:3], *v_cache.stride()[:3], torch.get_num_threads())
