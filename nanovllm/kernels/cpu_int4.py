"""CPU weight-only int4: GGUF 4-bit blocks repacked for torch's int4 CPU kernel.

`torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)`
computes `x @ w.T` with w = (q - 8) * scale + zero, q a 4-bit integer, one (scale, zero)
per output channel and group of `group_size` input features. llama.cpp's 4-bit types map
onto that form exactly, in groups of 32 (ggml-common.h's block layouts, utils/dequant.py):

- Q4_0  y = d * (q - 8)                   scale d,        zero 0
- Q4_1  y = d * q + m                     scale d,        zero m + 8d
- Q4_K  y = (d * sc) * q - dmin * mn      scale d * sc,   zero 8 * d * sc - dmin * mn
        (per 32-value sub-block of a 256-value super-block; sc, mn its 6-bit scale and min)

With fp32 scales and fp32 activations the product equals the dequantized one to fp32
rounding, but the kernel is fast only with bf16 activations (and bf16 scales): then each
weight is off by its scale's bf16 rounding (about 2e-3 relative) and the product by about
3e-3 relative (tests/test_cpu_quant.py measures both). The kernel needs the output size
divisible by 16 and the input size by the group size.
"""
import torch

GROUP_SIZE = 32           # values per (scale, zero) group: every GGUF 4-bit type's (sub-)block
OUT_MULTIPLE = 16         # the packing kernel's requirement on the output size
INT4_GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}  # values, bytes per block


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """raw: [..., 2] uint8 -> [...] float32 (little-endian fp16)."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs: [..., n] uint8 -> [..., 2 * n] int32: the low nibbles, then the high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], -1).to(torch.int32)


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _f16(blocks[:, :2])                                  # [n_blocks]
    return _nibbles(blocks[:, 2:]), d.unsqueeze(-1), torch.zeros_like(d).unsqueeze(-1)


def _q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])         # [n_blocks]
    return _nibbles(blocks[:, 4:]), d.unsqueeze(-1), (m + 8 * d).unsqueeze(-1)


def _q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, dmin = _f16(blocks[:, :2]).unsqueeze(-1), _f16(blocks[:, 2:4]).unsqueeze(-1)  # [n_blocks, 1]
    d_, m_, md = blocks[:, 4:16].reshape(-1, 3, 4).unbind(1)                           # each [n_blocks, 4]
    sc = torch.cat([d_ & 0x3F, (md & 0x0F) | ((d_ >> 2) & 0x30)], -1).float()          # [n_blocks, 8]
    mn = torch.cat([m_ & 0x3F, (md >> 4) | ((m_ >> 2) & 0x30)], -1).float()
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32))                                    # [n_blocks, 4, 64]
    scale = d * sc
    return q.reshape(-1, 256), scale, 8 * scale - dmin * mn


_AFFINE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


def gguf_int4_affine(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-bit values and per-group affine of GGUF rows, in the int4 kernel's form.

    Args:
        raw: [rows, bytes_per_row] uint8, each row a run of `type_name` blocks.
    Returns:
        q [rows, cols] int32 in [0, 15]; scale and zero [rows, cols // 32] float32, so that
        the row's values are (q - 8) * scale + zero group by group.
    """
    values, nbytes = _BLOCK[type_name]
    rows = raw.shape[0]
    q, scale, zero = _AFFINE[type_name](raw.reshape(-1, nbytes))
    return q.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1)


def dequantize_affine(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q - 8) * scale + zero per group: the values the int4 kernel multiplies by. # [rows, cols]"""
    groups = lambda t: t.repeat_interleave(GROUP_SIZE, dim=1)  # noqa: E731
    return (q.float() - 8) * groups(scale) + groups(zero)


def quantize_affine(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization of a float weight [rows, cols], per group of 32 (for HF
    checkpoints quantized at load): returns q, scale, zero as `gguf_int4_affine` does."""
    g = w.float().reshape(w.shape[0], -1, GROUP_SIZE)             # [rows, groups, 32]
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.int32)
    return q.reshape(w.shape), scale, lo + 8 * scale


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 kernel's operands: (packed weight, scales_and_zeros [cols // 32, rows, 2] in
    `dtype`, which must be the activations' dtype)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    scales_and_zeros = torch.stack([scale.t(), zero.t()], -1).to(dtype).contiguous()
    return packed, scales_and_zeros


def can_pack(output_size: int, input_size: int) -> bool:
    return output_size % OUT_MULTIPLE == 0 and input_size % GROUP_SIZE == 0


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, in] -> [num_tokens, out] in x's dtype; the product runs in the dtype of
    `scales_and_zeros` (bf16: the fast one)."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(scales_and_zeros.dtype), packed, GROUP_SIZE,
                                                   scales_and_zeros)
    return y.to(x.dtype)
