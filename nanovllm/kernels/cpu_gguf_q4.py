"""A C++ product for GGUF Q4_0 / Q4_1 weights and a few rows of activations (one sequence's decode).

torch's `_weight_int4pack_mm_for_cpu` (kernels/cpu_int4.py), which the GGUF 4-bit layers run
up to MAX_INT4_ROWS rows, reads SmolLM2-135M's 4-bit weights at ~15 GB/s on the 2-core AVX512
VM, where one thread streams ~25 GB/s. This kernel (cpu_gguf_q4.cpp) reads the weight once per
call in a layout made for it at load (`pack`): tiles of 32 output rows whose 4-bit values at one
input position are one 16-byte load (rows r and r + 16 in one byte), the tile's per-block scales
(and Q4_1 mins) as f16 beside each block's values, so the vector lanes are output rows and one
unpacked weight serves all rows of x. It computes in fp32 (x in fp32; bf16 x converted once):
per block s = sum(q * x), then y += d * s + m * sum(x) (Q4_0: m = -8 d), which differs from
`x.float() @ dequant(W).T` only in summation order and rounding (tests/test_cpu_gguf_q4.py).
Timings, the row count where torch's int4 kernel catches up, and the error: benchmarks/RESULTS.md
"A 4-bit GGUF kernel for one sequence (eighteenth session)"; benchmarks/bench_cpu_q4.py.

Built like the other C++ kernels (kernels/cpu_paged_decode.py, cpu_small_ops.py):
`utils/cpp_compiler.build` through Inductor's C++ code cache (-march=native; AVX512, else AVX2,
else plain C++, picked by the macros Inductor defines for the CPU's vector ISA; OpenMP), one
library per (x's dtype, Q4 type), kept and loaded directly in later processes. Where there is no
C++ compiler (and no library built before) `pack` and `q4_linear` return None and the caller
keeps its own path.
"""
import dataclasses
import functools
from pathlib import Path

import torch

from nanovllm.utils import cpp_compiler, dequant

SOURCE = Path(__file__).with_suffix(".cpp")
CPP_TYPES = {torch.float32: "float", torch.bfloat16: "at::BFloat16"}
Q4_TYPES = {"Q4_0": 0, "Q4_1": 1}            # Q4_TYPE of the C++
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # d f16 | (m f16) | 16 bytes of nibbles, 32 values
BLOCK = 32            # values of a GGUF block, along the input
TILE_ROWS = 32        # output rows of a packed tile (the C++'s ROWS)
MAX_ROWS = 8          # rows of x one call of the C++ takes (its MAX_M); q4_linear runs more in chunks of it
# ISA choices (Q4_ISA of the C++): the widest the CPU has; AVX2 at most; plain C++ (tests build all)
ISAS = {"native": 0, "avx2": 2, "plain": 1}
# Bytes ahead of the block being read that each block asks for (into L1, one request per 64-byte
# line). SmolLM2's 120 layers cold, two threads, Q4_1, 1 / 2 / 4 / 8 rows, ms, on the shared 2-core
# VM (benchmarks/bench_cpu_q4.py; benchmarks/RESULTS.md "A 4-bit GGUF kernel for one sequence
# (eighteenth session)"): one run none 3.96 / 4.98 / 6.75 / 12.05, 1024 bytes 3.56 / 4.44 / 6.40 /
# 11.08, 4096 3.50 / 4.35 / 6.27 / 11.10; two later runs none 3.74 / 4.98 / 8.14 / 13.67 and
# 4.43 / 6.28 / 9.05 / 14.31, 4096 4.09 / 5.04 / 7.64 / 12.93 and 4.88 / 6.05 / 8.88 / 13.75: a
# gain of 5-10% from 2 rows up, within the noise at one row.
PREFETCH_BYTES = 4096
_ARG_TYPES = ["const {t}*", "const uint8_t*", "{t}*", "long", "long", "long", "long"]  # kernel() in the .cpp


@dataclasses.dataclass(frozen=True)
class PackedQ4:
    """A GGUF Q4_0 / Q4_1 weight [out_features, in_features] in the kernel's layout."""
    data: torch.Tensor   # [tiles, in_features // 32, tile block bytes] uint8
    type_name: str       # "Q4_0" or "Q4_1"
    out_features: int
    in_features: int


def tile_block_bytes(type_name: str) -> int:
    """Bytes of one packed (tile, block): 32 x 16 nibble bytes, then f16 d (and m) of 32 rows."""
    return BLOCK * TILE_ROWS // 2 + (2 if type_name == "Q4_1" else 1) * TILE_ROWS * 2


def source_for(dtype: torch.dtype, type_name: str, isa: str = "native") -> str:
    macros = {"ELEMENT_TYPE": CPP_TYPES[dtype], "Q4_TYPE": Q4_TYPES[type_name], "Q4_ISA": ISAS[isa],
              "PREFETCH_BYTES": PREFETCH_BYTES}
    return cpp_compiler.source(SOURCE, macros)


@functools.cache
def _build(dtype: torch.dtype, type_name: str, isa: str = "native"):
    """The built function, or None (no compiler and no library built before, or a build error)."""
    return cpp_compiler.build(source_for(dtype, type_name, isa), [t.format(t=CPP_TYPES[dtype]) for t in _ARG_TYPES])


def prepare(dtype: torch.dtype, type_name: str) -> bool:
    """Build the kernel for x's `dtype` and the weight's type now (engine start-up); whether it runs."""
    return dtype in CPP_TYPES and type_name in Q4_TYPES and _build(dtype, type_name, "native") is not None


def function(dtype: torch.dtype, type_name: str):
    """The built kernel for x's `dtype` and the weight's type, or None: for callers that check their
    tensors once and then call it directly (engine/cpu_decode_plan.py), as `q4_linear` calls it."""
    return _build(dtype, type_name, "native") if dtype in CPP_TYPES and type_name in Q4_TYPES else None


def pack(raw: torch.Tensor, type_name: str, dtype: torch.dtype | None = None) -> PackedQ4 | None:
    """GGUF rows in the kernel's layout, or None where it does not take them (another type, no C++).

    Args:
        raw: [out_features, bytes_per_row] uint8, each row a run of `type_name` blocks (as the file
            holds a 2-D weight: row n is output n, its blocks along the input).
        dtype: the activations' dtype it will run with (its kernel built now); None: any.
    """
    if not any(prepare(dt, type_name) for dt in (CPP_TYPES if dtype is None else [dtype])):
        return None
    blocks = dequant.row_blocks(raw, type_name, GGUF_BLOCK_BYTES[type_name])  # [n, blocks, bytes]
    return PackedQ4(_tiles(blocks, type_name), type_name, blocks.shape[0], blocks.shape[1] * BLOCK)


def _tiles(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """blocks [n, blocks, bytes] -> [tiles, blocks, tile block bytes] (the layout cpu_gguf_q4.cpp reads)."""
    n, nb, _ = blocks.shape
    tiles = -(-n // TILE_ROWS)
    pad = torch.zeros(tiles * TILE_ROWS - n, nb, blocks.shape[2], dtype=torch.uint8)  # rows of q = d = m = 0
    blocks = torch.cat([blocks, pad]).reshape(tiles, TILE_ROWS, nb, -1)                 # [tiles, 32 rows, nb, bytes]
    scales = 2 if type_name == "Q4_1" else 1
    qs = blocks[..., 2 * scales:]                                                       # [tiles, 32 rows, nb, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], -1)                                             # [tiles, 32 rows, nb, 32 k]
    q = q.permute(0, 2, 3, 1)                                                           # [tiles, nb, 32 k, 32 rows]
    nibbles = q[..., :TILE_ROWS // 2] | (q[..., TILE_ROWS // 2:] << 4)                  # [tiles, nb, 32 k, 16]
    f16s = blocks[..., :2 * scales].reshape(tiles, TILE_ROWS, nb, scales, 2)            # d (m) bytes per row
    f16s = f16s.permute(0, 2, 3, 1, 4)                                                  # [tiles, nb, scales, 32 rows, 2]
    out = torch.cat([nibbles.reshape(tiles, nb, -1), f16s.reshape(tiles, nb, -1)], -1).contiguous()
    assert out.shape[-1] == tile_block_bytes(type_name)
    return out


def q4_linear(x: torch.Tensor, packed: PackedQ4, isa: str = "native") -> torch.Tensor | None:
    """x [m, in_features] @ W^T -> [m, out_features] in x's dtype, fp32 accumulation (more than MAX_ROWS
    rows: one call per MAX_ROWS of them, each reading the whole weight); None where the kernel does
    not take x (a dtype other than fp32/bf16, not on the CPU, inside torch.compile, no C++) and the
    caller runs its own product."""
    if x.dim() != 2 or x.shape[1] != packed.in_features:
        raise ValueError(f"x must be [rows, {packed.in_features}], got {tuple(x.shape)}")
    # (x.is_cpu, not x.device.type: 0.1 against 0.7 us, of a call that takes ~1.3 us in C++ for 64x64)
    if not x.is_cpu or x.dtype not in CPP_TYPES or x.shape[0] < 1 or torch.compiler.is_compiling():
        return None
    fn = _build(x.dtype, packed.type_name, isa)
    if fn is None:
        return None
    x = x.contiguous()
    y = torch.empty(x.shape[0], packed.out_features, dtype=x.dtype)  # [m, out_features]
    threads = torch.get_num_threads()
    for start in range(0, x.shape[0], MAX_ROWS):  # (rows of x and y: contiguous slices)
        xs, ys = x[start:start + MAX_ROWS], y[start:start + MAX_ROWS]
        fn(xs, packed.data, ys, xs.shape[0], packed.out_features, packed.in_features, threads)
    return y
