"""Torch reference of the fp8 tensor-core decode tiles (`triton_attn.DECODE_FP8_QUERY_QUANT`,
and `DECODE_FP8_PV_MMA` with `q_scales="none"`): the same rounding as the kernel, so its
accuracy can be measured on CPU and the kernel checked against it on the GPU.

Over an e4m3 cache the kernel rounds two more things than the plain fp8 path does (which
dequantizes K and V and keeps q and P in 16 bits):

- each query row (one token of one head) to e4m3 with its own scale, its amax / 448
  (DECODE_FP8_QUERY_QUANT only);
- the probabilities of each KV tile, `exp2(s - m)` with `m` the running row maximum after that
  tile, times 256, to e4m3; the row sums `l` stay fp32 (unrounded p).

Everything else is fp32: S from the fp8 values times (softmax scale x k_scale x q row scale),
the online rescaling by exp2(m_old - m_new), O / l / 256 x v_scale. The rescaling is emulated in
closed form (a tile's contribution times exp2(its running max - the final max)), equal to the
kernel's running product in exact arithmetic; only fp32 summation order differs.

`paged_attention` has `torch_ref.paged_attention`'s signature and treats every query as a
decode of its own (the kernel's decode tile, one query per row; split-KV not emulated), so
running a whole prompt through it gives teacher-forced decodes in one prefill.
"""
import math

import torch

from nanovllm.kernels import kv_quant, torch_ref

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0     # triton_attn.FP8_E4M3_MAX
P_SCALE = 256.0     # triton_attn.P_FP8_SCALE
RUNNING_MAX_INIT = -1.0e30  # triton_paged_tiles.RUNNING_MAX_INIT
LOG2E = 1.4426950408889634


# the kernel's; one per token (all its heads); 1.0; "none": q not rounded (DECODE_FP8_PV_MMA)
Q_SCALES = ("row", "token", "unit", "none")


def quantize_rows(x: torch.Tensor, q_scales: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """Each row (last dim) in e4m3 with scale amax / 448 (1 for a row of zeros), as float32 values.
    q_scales "token": one amax over all rows of a token (x's last two dims); "unit": scale 1.
    # x [..., d] -> ([..., d] float32 holding e4m3 values, [..., 1] float32 scales)"""
    if q_scales not in Q_SCALES:
        raise ValueError(f"q_scales must be one of {Q_SCALES}, got {q_scales!r}")
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    if q_scales == "none":
        return x, torch.ones_like(amax)
    if q_scales == "token":
        amax = amax.amax(-2, keepdim=True).expand_as(amax)
    elif q_scales == "unit":
        amax = torch.full_like(amax, FP8_MAX)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float(), scale


def attend(q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, k_scale: torch.Tensor,
           v_scale: torch.Tensor, scale: float, block_n: int, q_scales: str = "row") -> torch.Tensor:
    """The decode tile's math for queries that are the last q_len positions of the context.

    q:  [q_len, heads, d] (any float dtype)
    k8, v8: [k_len, kv_heads, d] e4m3 cache values; k_scale, v_scale: [kv_heads] float32
    Returns: [q_len, heads, d] float32
    """
    q_len, heads, d = q.shape
    k_len, kv_heads = k8.shape[:2]
    group = heads // kv_heads
    q8, q_scale = quantize_rows(q, q_scales)                              # [q, h, d], [q, h, 1]
    k = k8.float().repeat_interleave(group, 1)                            # [k, h, d]
    v = v8.float().repeat_interleave(group, 1)
    row_scale = (scale * LOG2E) * k_scale.repeat_interleave(group)[None, :] * q_scale[..., 0]  # [q, h]
    s = torch.einsum("qhd,khd->hqk", q8, k) * row_scale.t()[:, :, None]  # [h, q, k]
    q_pos = torch.arange(k_len - q_len, k_len)
    visible = torch.arange(k_len)[None, :] <= q_pos[:, None]              # [q, k]
    tiles = -(-k_len // block_n)
    pad = tiles * block_n - k_len
    s = torch.nn.functional.pad(s.masked_fill(~visible, -math.inf), (0, pad), value=-math.inf)
    s = s.view(heads, q_len, tiles, block_n)
    run_max = s.amax(-1).cummax(-1).values.clamp_min(RUNNING_MAX_INIT)   # [h, q, tiles]
    p = torch.exp2(s - run_max[..., None])                                # [h, q, tiles, n]
    weight = torch.exp2(run_max - run_max[..., -1:])                      # [h, q, tiles]
    l = (p.sum(-1) * weight).sum(-1)                                       # [h, q]
    p8 = (p * P_SCALE).to(FP8).float()
    v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(tiles, block_n, heads, d)
    acc = torch.einsum("hqtn,tnhd,hqt->hqd", p8, v, weight)              # [h, q, d]
    o = acc / l[..., None] / P_SCALE * v_scale.repeat_interleave(group)[:, None, None]
    return o.transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, *, max_seqlen_q: int | None = None,
                    max_seqlen_k: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, block_n: int = 128,
                    q_scales: str = "row") -> torch.Tensor:
    """`torch_ref.paged_attention` with the decode tile's rounding over an e4m3 cache (`attend`);
    block_n: keys per KV tile (the kernel's DECODE_FP8_BLOCK_N); q_scales: `quantize_rows`'.
    # [num_tokens, heads, d], q's dtype"""
    assert k_cache.dtype == FP8 and k_scale is not None and v_scale is not None
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, seq_len_k in enumerate(seq_lens_k.tolist()):
        slots = torch_ref.context_slots(block_tables[b], seq_len_k, block_size)
        k8, v8 = [kv_quant.as_bytes(c).view(-1, *c.shape[2:])[slots].view(FP8) for c in (k_cache, v_cache)]
        out[cu[b]:cu[b + 1]] = attend(q[cu[b]:cu[b + 1]], k8, v8, k_scale, v_scale, scale, block_n,
                                        q_scales).to(q.dtype)
    return out
