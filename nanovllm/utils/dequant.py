"""Dequantizers for GGUF tensors, in vectorized torch.

A GGUF tensor is stored as a flat run of bytes: plain floats (F32, F16, BF16) or
blocks of a llama.cpp quantization type. `dequantize(raw, ggml_type, shape)` turns
the bytes into a float32 tensor of `shape` (torch order: the last dimension is
ggml's fastest-moving `ne[0]`, which blocks run along).

Block layouts follow ggml-common.h; every formula matches `gguf.quants`' numpy
reference (tests compare the two on random raw blocks):

- Q8_0 (32 values, 34 bytes):  d f16 | q int8[32]                      y = d * q
- Q4_0 (32 values, 18 bytes):  d f16 | nibbles[16]                     y = d * (q - 8)
- Q4_1 (32 values, 20 bytes):  d f16 | m f16 | nibbles[16]             y = d * q + m
- Q4_K (256 values, 144 bytes): d f16 | dmin f16 | 6-bit scales and mins of 8 sub-blocks[12] | nibbles[128]
- Q5_K (256 values, 176 bytes): as Q4_K, plus a fifth bit per value (qh[32]) before the nibbles
- Q6_K (256 values, 210 bytes): low nibbles[128] | high 2 bits[64] | int8 scales of 16 sub-blocks[16] | d f16

In 4-bit blocks, the low nibbles of a 32-byte (Q4_0/Q4_1: 16-byte) run hold the
first half of its values and the high nibbles the second half.
"""
from typing import Callable

import torch

QK_K = 256  # values in one K-quant super-block


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """raw: [n_blocks, 2] uint8 -> [n_blocks, 1] float32 (one little-endian fp16 per block)."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs: [..., n] uint8 -> [..., 2, n] float32: low nibbles, then high nibbles.

    Written straight into one float tensor that the callers then scale in place:
    about 2.5x faster than stacking uint8 halves and converting (the SmolLM2 file
    holds 106M 4-bit values).
    """
    out = torch.empty(*qs.shape[:-1], 2, qs.shape[-1])
    out[..., 0, :] = qs & 0x0F
    out[..., 1, :] = qs >> 4
    return out


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d, q = _f16(blocks[:, :2]), blocks[:, 2:].contiguous().view(torch.int8)
    return q.float().mul_(d)  # [n_blocks, 32]


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2]).unsqueeze(-1)
    return _nibbles(blocks[:, 2:]).sub_(8).mul_(d).flatten(1)  # [n_blocks, 32]


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, :2]).unsqueeze(-1), _f16(blocks[:, 2:4]).unsqueeze(-1)
    return _nibbles(blocks[:, 4:]).mul_(d).add_(m).flatten(1)  # [n_blocks, 32]


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a Q4_K/Q5_K block -> 6-bit scales and mins, each [n_blocks, 8].

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes
    4-7 the same for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble)
    and mins 4-7 (high nibble).
    """
    d, m, md = scales.reshape(-1, 3, 4).unbind(1)  # each [n_blocks, 4]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc.float(), mins.float()


def _k_affine(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sub-block scale and offset of a Q4_K/Q5_K block, each [n_blocks, 8, 1]."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mins = _k_scale_min(blocks[:, 4:16])
    return (d * sc).unsqueeze(-1), (dmin * mins).unsqueeze(-1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, offset = _k_affine(blocks)
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)  # [n_blocks, 8, 32]
    return q.mul_(scale).sub_(offset).reshape(-1, QK_K)


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)  # one bit of qh per Q5_K sub-block


def q5_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K blocks [n_blocks, 176] uint8 -> their 5-bit values q [n_blocks, 8, 32] (0..31, as floats)
    and each sub-block's scale and offset [n_blocks, 8, 1]: the block's values are q * scale - offset."""
    scale, offset = _k_affine(blocks)
    qh = (blocks[:, 16:48].unsqueeze(1) >> _BIT_SHIFTS.view(1, 8, 1)) & 1  # [n_blocks, 8, 32]
    q = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32).add_(qh.float() * 16)
    return q, scale, offset


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    q, scale, offset = q5_k_parts(blocks)
    return q.mul_(scale).sub_(offset).reshape(-1, QK_K)


_PAIR_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)  # 2-bit fields of Q6_K's qh


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql = _nibbles(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)  # [n_blocks, 8, 32]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> _PAIR_SHIFTS.view(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    q = ql.add_(qh.float() * 16).sub_(32)  # [n_blocks, 8, 32] in [-32, 31]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n_blocks, 16]
    d = (_f16(blocks[:, 208:210]) * scales).unsqueeze(-1)  # [n_blocks, 16, 1]
    return q.reshape(-1, 16, 16).mul_(d).reshape(-1, QK_K)


def _plain(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda raw: raw.contiguous().view(dtype).float()


# ggml type name -> (values per block, bytes per block, dequantizer of [n_blocks, bytes] uint8)
QUANT_TYPES: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "F32": (1, 4, _plain(torch.float32)),
    "F16": (1, 2, _plain(torch.float16)),
    "BF16": (1, 2, _plain(torch.bfloat16)),
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}


def num_bytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` takes in the file when stored as `type_name`."""
    block_values, block_bytes, _ = _quant_type(type_name)
    numel = 1
    for n in shape:
        numel *= n
    if shape and shape[-1] % block_values:
        raise ValueError(f"a {type_name} tensor's rows must be a multiple of {block_values} values, "
                         f"got shape {tuple(shape)}")
    return numel // block_values * block_bytes


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: [num_bytes] uint8 of one tensor -> float32 tensor of `shape`."""
    block_values, block_bytes, fn = _quant_type(type_name)
    expected = num_bytes(type_name, shape)
    if raw.numel() != expected:
        raise ValueError(f"{type_name} tensor of shape {tuple(shape)} needs {expected} bytes, got {raw.numel()}")
    return fn(raw.view(-1, block_bytes)).reshape(shape)


def row_blocks(raw: torch.Tensor, type_name: str, block_bytes: int) -> torch.Tensor:
    """raw [rows, bytes_per_row] uint8, each row a run of `type_name` blocks of `block_bytes` bytes (a
    2-D weight as the file holds it: row n is output n) -> [rows, blocks, block_bytes]; a ValueError
    naming the type and the shape where it is not that."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"{type_name} rows must be [rows, a multiple of {block_bytes}] uint8, "
                         f"got {tuple(raw.shape)} {raw.dtype}")
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _quant_type(type_name: str):
    try:
        return QUANT_TYPES[type_name]
    except KeyError:
        raise ValueError(f"GGUF tensor type {type_name} is not supported "
                         f"(supported: {', '.join(QUANT_TYPES)})") from None
