"""An int8 product for GGUF Q4_0 / Q4_1 / Q8_0 weights and batches of rows (not exact), by
AVX512-VNNI or, where the CPU has none, AVX2.

oneDNN's packed bf16 product (kernels/cpu_gemm.py), which the GGUF 4-bit layers run above the Q4
kernel's few rows (kernels/cpu_gguf_q4.py), multiplies at `vdpbf16ps`'s rate: 32 multiply-adds per
512-bit instruction. `vpdpbusd` (u8 x s8, four products summed into each int32 lane) does 64, at
the same rate on Zen 4. This kernel (cpu_gguf_vnni.cpp) multiplies the file's 4-bit values, as
stored (u8 0..15, repacked at load by `pack`: groups of 16 output rows, four consecutive k of a row
in one int32 lane), by x quantized on the fly to int8 per row and per 32 values (d_x = max|x| / 127,
as llama.cpp's Q8_1 does for its own products), then per block
    y += (d_w * d_x) * dot(q_w, q_x) + m_w * d_x * sum(q_x)      (Q4_0: m_w = -8 d_w)
in fp32. So the result is `quantize_x(x) @ dequant(W).T` up to fp32 rounding (exact integer dots),
where quantize_x rounds each x to 8 bits of its block's largest value: NOT the product of x itself.
Q8_0 weights are int8, the signed operand: x enters as q_x + 128 (u8) and each block's dot starts
from -128 * sum(q_w), kept beside its scales. Measured for SmolLM2's tied Q8_0 LM head (49152 x 576)
but not wired in: 9.97 / 9.44 against oneDNN bf16's 11.38 / 10.63 ms at 64 rows (two runs; RESULTS.md,
nineteenth session), too little for int8 activations where the argmax is taken.
`reference` computes the same in torch; the error against `x.float() @ dequant(W).T` and what it
does to the engine's outputs: benchmarks/RESULTS.md "Int8 (VNNI) products for batches of GGUF 4-bit
weights (nineteenth session)".

Which instructions run where (`kernel_isa`; the C++ picks its form from the build's target):
- AVX512-VNNI (with AVX512F and AVX512BW): `vpdpbusd` on 16 int32 lanes, a 64-byte chunk of the
  packed weight (16 rows x 4 k) per vector.
- AVX2 (with FMA and F16C; AVX2-only CPUs, AVX512 CPUs without VNNI, and ATEN_CPU_CAPABILITY=avx2:
  utils/device.py): the same packed layout read as two 32-byte halves of 8 rows, `vpmaddubsw`
  (u8 x s8, pairs summed to int16) and `vpmaddwd` by ones (int16 pairs summed to int32): the same
  exact integer dots, and the same fp32 operations after them, so the same y bit for bit. Q4 sums
  stay in int16 for a whole block (|16 products| <= 16 x 15 x 127 < 2^15); Q8_0's signed weights
  enter as |q_w| (u8) against q_x carrying q_w's sign (`vpsignb`; the +128 offset would overflow
  vpmaddubsw's int16 pairs), widened at every chunk. About half the integer rate of vpdpbusd on Zen 4.
- Elsewhere (no AVX2, FMA or F16C): not built; `prepare` is False and the callers keep their products.
AVX-VNNI (the 256-bit vpdpbusd of Alder Lake and Zen 5, the "avx_vnni" flag) is not used: such a CPU
runs the AVX2 form.

Built like the other C++ kernels (utils/cpp_compiler.build through Inductor's C++ code cache,
-march=native, or x86-64-v3 under ATEN_CPU_CAPABILITY=avx2; OpenMP over groups of output rows), one
library per (x's dtype, GGUF type, form), kept and loaded directly in later processes.
"""
import dataclasses
import functools
from pathlib import Path

import torch

from nanovllm.utils import cpp_compiler, dequant
from nanovllm.utils.device import cpu_flags

SOURCE = Path(__file__).with_suffix(".cpp")
CPP_TYPES = {torch.float32: "float", torch.bfloat16: "at::BFloat16"}
GGUF_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}          # GGUF_TYPE of the C++
# d f16 | (m f16) | 16 bytes of nibbles (Q4), or d f16 | 32 int8 (Q8_0): 32 values
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
BLOCK = 32          # values of a GGUF block along the input, and of one x scale
GROUP = 16          # output rows of a packed group (the C++'s GROUP: int32 lanes of a 512-bit vector)
QMAX = 127          # the largest |q_x|
# The kernel's forms, the first whose CPU flags (/proc/cpuinfo's names) are all here
ISA_FLAGS = {"avx512_vnni": frozenset({"avx512_vnni", "avx512bw", "avx512f"}),
             "avx2": frozenset({"avx2", "fma", "f16c"})}
# Register tile of the C++, per form (`kernel_isa`): TILE_M rows of x by TILE_G groups of 16 output
# rows. AVX512-VNNI (2 x TILE_M x TILE_G of the 32 vector registers hold the int32 dots and fp32 sums):
# SmolLM2's 120 layers at 16 / 64 / 256 rows, bf16 x, two threads (benchmarks/bench_cpu_q4.py
# --kinds vnnibfMxG; RESULTS.md "Int8 (VNNI) products ... (nineteenth session)"): 4x2 12.1 / 32.0 /
# 121.0 ms; 6x2, 5x2 and 4x3 within 5% of it; 3x4 34.2 and 8x1 35.3 ms at 64 rows. AVX2 (16 vector
# registers: the int16 sums of a block and the unpacked nibbles fill them, the fp32 sums spill), the
# same layers, fp32 x, under ATEN_CPU_CAPABILITY=avx2 (--kinds vnniMxG; RESULTS.md "The int8 GGUF
# product on AVX2 (twentieth session)"), three runs at 16 / 64 / 256 rows: 6x1 18.6-19.9 / 61.3-66.8 /
# 211-246 ms; 8x1, 5x1 and 3x2 within the noise of it; 2x1, 4x1, 1x2, 2x2 slower (1x2 76-78 at 64).
TILES = {"avx512_vnni": (4, 2), "avx2": (6, 1)}
_ARG_TYPES = ["const {t}*", "const uint8_t*", "{t}*", "long", "long", "long", "long"]  # kernel() in the .cpp


@dataclasses.dataclass(frozen=True)
class PackedVNNI:
    """A GGUF Q4_0 / Q4_1 / Q8_0 weight [out_features, in_features] in the kernel's layout."""
    data: torch.Tensor   # [ceil(out / 16), in / 32, group block bytes] uint8
    type_name: str       # "Q4_0", "Q4_1" or "Q8_0"
    out_features: int
    in_features: int


def group_block_bytes(type_name: str) -> int:
    """Bytes of one packed (group, block): 16 rows x 16 nibble bytes, then f16 d (and m) of 16 rows;
    Q8_0: 16 rows x 32 int8, f16 d and int32 -128 * sum q of 16 rows."""
    if type_name == "Q8_0":
        return BLOCK * GROUP + (2 + 4) * GROUP
    return BLOCK * GROUP // 2 + (2 if type_name == "Q4_1" else 1) * GROUP * 2


def source_for(dtype: torch.dtype, type_name: str, tile_m: int | None = None, tile_g: int | None = None) -> str:
    """The C++ source for x's `dtype` and the weight's type, the register tile `tile_m` x `tile_g`
    (None: this CPU's form's, TILES)."""
    default_m, default_g = TILES.get(kernel_isa(), TILES["avx512_vnni"])
    macros = {"ELEMENT_TYPE": CPP_TYPES[dtype], "GGUF_TYPE": GGUF_TYPES[type_name],
              "TILE_M": default_m if tile_m is None else tile_m, "TILE_G": default_g if tile_g is None else tile_g}
    return cpp_compiler.source(SOURCE, macros)


@functools.cache
def _build(dtype: torch.dtype, type_name: str, tile_m: int | None = None, tile_g: int | None = None):
    """The built function, or None (no form for this CPU, no compiler and no library built before)."""
    if kernel_isa() is None:
        return None
    return cpp_compiler.build(source_for(dtype, type_name, tile_m, tile_g),
                              [t.format(t=CPP_TYPES[dtype]) for t in _ARG_TYPES])


def kernel_isa() -> str | None:
    """The form of the kernel this CPU builds: "avx512_vnni" (AVX512-VNNI, AVX512F, AVX512BW),
    "avx2" (AVX2, FMA, F16C), or None (neither: it does not run)."""
    flags = cpu_flags()
    for isa, needs in ISA_FLAGS.items():
        if needs <= flags:
            return isa
    return None


def runs_here() -> bool:
    """Whether the engine should run it on this CPU: either form, and no AMX (whose bf16 tiles
    oneDNN's bf16 product uses, at several times vpdpbusd's rate: not measured against it)."""
    return kernel_isa() is not None and "amx_bf16" not in cpu_flags()


def prepare(dtype: torch.dtype, type_name: str) -> bool:
    """Build the kernel for x's `dtype` and the weight's type now (engine start-up); whether it runs."""
    return (kernel_isa() is not None and dtype in CPP_TYPES and type_name in GGUF_TYPES
            and _build(dtype, type_name) is not None)


def pack(raw: torch.Tensor, type_name: str, dtype: torch.dtype | None = None) -> PackedVNNI | None:
    """GGUF rows in the kernel's layout, or None where it does not run (neither form, another type, no C++).

    Args:
        raw: [out_features, bytes_per_row] uint8, each row a run of `type_name` blocks (as the file
            holds a 2-D weight: row n is output n, its blocks along the input).
        dtype: the activations' dtype it will run with (its kernel built now); None: any.
    """
    if not any(prepare(dt, type_name) for dt in (CPP_TYPES if dtype is None else [dtype])):
        return None
    block_bytes = GGUF_BLOCK_BYTES[type_name]
    blocks = dequant.row_blocks(raw, type_name, block_bytes)                # [n, nb, block_bytes]
    n, nb = blocks.shape[:2]
    groups = -(-n // GROUP)
    pad = torch.zeros(groups * GROUP - n, nb, block_bytes, dtype=torch.uint8)  # rows of q = d = m = 0
    blocks = torch.cat([blocks, pad]).reshape(groups, GROUP, nb, block_bytes)  # [groups, 16 rows, nb, bytes]
    data = (_q8_0_groups if type_name == "Q8_0" else _q4_groups)(blocks, type_name)
    assert data.shape[-1] == group_block_bytes(type_name)
    return PackedVNNI(data, type_name, n, nb * BLOCK)


def _q4_groups(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """[groups, 16 rows, nb, GGUF block bytes] Q4 -> [groups, nb, group block bytes]."""
    groups, _, nb, _ = blocks.shape
    scales = 2 if type_name == "Q4_1" else 1
    # A GGUF block's byte j holds q[j] (low nibble) and q[16 + j] (high): the C++'s chunk c, row r,
    # byte j is that row's byte 4c + j, as stored.
    qs = blocks[..., 2 * scales:].reshape(groups, GROUP, nb, 4, 4)              # [groups, rows, nb, c, j]
    nibbles = qs.permute(0, 2, 3, 1, 4).reshape(groups, nb, -1)                 # [groups, nb, c * rows * j]
    f16s = blocks[..., :2 * scales].reshape(groups, GROUP, nb, scales, 2)        # d (m) bytes per row
    f16s = f16s.permute(0, 2, 3, 1, 4).reshape(groups, nb, -1)                  # [groups, nb, scales * rows * 2]
    return torch.cat([nibbles, f16s], -1).contiguous()


def _q8_0_groups(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """[groups, 16 rows, nb, 34] Q8_0 -> [groups, nb, group block bytes]."""
    groups, _, nb, _ = blocks.shape
    q = blocks[..., 2:].contiguous().view(torch.int8)                           # [groups, rows, nb, 32]
    values = q.reshape(groups, GROUP, nb, BLOCK // 4, 4).permute(0, 2, 3, 1, 4)  # [groups, nb, c, rows, 4]
    d = blocks[..., :2].permute(0, 2, 1, 3)                                     # [groups, nb, rows, 2] f16 bytes
    neg_sums = (-128 * q.int().sum(-1)).int().permute(0, 2, 1).contiguous()     # [groups, nb, rows] int32
    return torch.cat([values.reshape(groups, nb, -1).view(torch.uint8), d.reshape(groups, nb, -1),
                      neg_sums.view(torch.uint8).reshape(groups, nb, -1)], -1).contiguous()


def q8_0_blocks(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A Q8_0 weight as kernels/cpu_q8_0.py keeps it (values int8 [n, k], scales fp32 [n, k / 32], each
    an fp16 value) -> its GGUF rows [n, k / 32 * 34] uint8, for `pack`."""
    n = values.shape[0]
    d = scales.half().contiguous().view(torch.uint8).reshape(n, -1, 2)          # [n, nb, 2]
    assert torch.equal(d.view(torch.float16).float().reshape(n, -1), scales), "scales are not fp16 values"
    q = values.contiguous().view(torch.uint8).reshape(n, -1, BLOCK)             # [n, nb, 32]
    return torch.cat([d, q], -1).reshape(n, -1)


def vnni_linear(x: torch.Tensor, packed: PackedVNNI) -> torch.Tensor | None:
    """quantize_x(x) [m, in_features] @ dequant(W)^T -> [m, out_features] in x's dtype, fp32 sums;
    None where the kernel does not take x (not on the CPU, a dtype other than fp32 / bf16, not built)
    and the caller runs its own product."""
    if x.dim() != 2 or x.shape[1] != packed.in_features:
        raise ValueError(f"x must be [rows, {packed.in_features}], got {tuple(x.shape)}")
    fn = _build(x.dtype, packed.type_name) if x.is_cpu and x.dtype in CPP_TYPES else None
    if fn is None:
        return None
    x = x.contiguous()
    y = torch.empty(x.shape[0], packed.out_features, dtype=x.dtype)  # [m, out_features]
    if x.shape[0]:
        fn(x, packed.data, y, x.shape[0], packed.out_features, packed.in_features, torch.get_num_threads())
    return y


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (q [m, k] int8 as float, d [m, k / 32]): the kernel's quantization of x in torch,
    the same fp32 operations (q = round-half-even(x * (127 / max|x|)), d = max|x| / 127)."""
    g = x.float().reshape(x.shape[0], -1, BLOCK)                                # [m, blocks, 32]
    amax = g.abs().amax(-1, keepdim=True)                                       # [m, blocks, 1]
    # (a tensor divided, not `QMAX / amax`: torch computes that as amax.reciprocal() * QMAX)
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax.clamp_min(torch.finfo(torch.float32).tiny),
                      torch.zeros_like(amax))
    q = torch.round(g * inv)                                                    # [m, blocks, 32]
    return q.reshape(x.shape), (amax / QMAX).squeeze(-1)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in fp64: quantize_x(x) @ w.T, w [n, k] the dequantized weight."""
    q, d = quantize_x(x)
    xq = (q.double().reshape(x.shape[0], -1, BLOCK) * d.double().unsqueeze(-1)).reshape(x.shape)  # [m, k]
    return xq @ w.double().T                                                    # [m, n]
