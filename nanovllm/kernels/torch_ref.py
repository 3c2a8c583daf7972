"""Reference paged attention in plain torch: the CPU backend and the oracle for GPU kernels.

The KV cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads,
head_dim]`. A sequence's token at position `p` lives in block
`block_table[p // block_size]`, row `p % block_size`; the flat slot of that token
is `block * block_size + row`.

`paged_attention` serves any mix in one call: prefill of a whole prompt, a prefill
chunk over a cached prefix, and single-token decodes. The queries of sequence `b`
are the last `q_len` positions of its `seq_len_k` context, and query `i` attends
causally to keys `0 .. seq_len_k - q_len + i`.

An fp8 cache (`kernels/kv_quant.py`) takes `k_scale` / `v_scale` ([num_kv_heads] float32):
stores quantize with them, attention dequantizes the gathered rows before SDPA.
"""
import torch
import torch.nn.functional as F

from nanovllm.kernels import kv_quant


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write this step's keys and values into their slots; slot -1 is skipped.

    key, value:       [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:     [num_tokens] int
    k_scale, v_scale: [num_kv_heads] float32, for an fp8 cache
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key, value = quantize_for_cache(key, value, k_cache.dtype, k_scale, v_scale)
    kv_quant.as_bytes(k_cache).view(-1, *k_cache.shape[2:])[slots] = kv_quant.as_bytes(key[keep])
    kv_quant.as_bytes(v_cache).view(-1, *v_cache.shape[2:])[slots] = kv_quant.as_bytes(value[keep])


def quantize_for_cache(key: torch.Tensor, value: torch.Tensor, cache_dtype: torch.dtype,
                       k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """key, value as the cache holds them: quantized with their scales for an fp8 cache."""
    if not kv_quant.is_fp8(cache_dtype):
        return key, value
    assert k_scale is not None and v_scale is not None, "an fp8 cache needs k_scale and v_scale"
    return kv_quant.quantize(key, k_scale, cache_dtype), kv_quant.quantize(value, v_scale, cache_dtype)


def read_cache(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """Cache rows `slots` in `dtype` (dequantized for an fp8 cache).  # [len(slots), kv_heads, d]"""
    rows = kv_quant.as_bytes(cache).view(-1, *cache.shape[2:])[slots]
    if not kv_quant.is_fp8(cache.dtype):
        return rows
    return kv_quant.dequantize(rows.view(cache.dtype), scale, dtype)


def context_slots(block_table: torch.Tensor, seq_len_k: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0..seq_len_k-1 of one sequence.  # [seq_len_k]"""
    positions = torch.arange(seq_len_k, device=block_table.device)
    blocks = block_table[positions // block_size].long()
    return blocks * block_size + positions % block_size


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, *, max_seqlen_q: int | None = None,
                    max_seqlen_k: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context.

    `max_seqlen_q` / `max_seqlen_k` are the host-known bounds GPU kernels size their
    grids with; the reference reads the lengths themselves and only checks the bounds.

    q:            [num_tokens, num_heads, head_dim]
    cu_seqlens_q: [num_seqs + 1] query offsets into q
    seq_lens_k:   [num_seqs] context length, including this step's tokens
    block_tables: [num_seqs, max_blocks]
    k_scale, v_scale: [num_kv_heads] float32, for an fp8 cache
    Returns:      [num_tokens, num_heads, head_dim]
    """
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    assert max_seqlen_q is None or max(b - a for a, b in zip(cu, cu[1:])) <= max_seqlen_q
    assert max_seqlen_k is None or int(seq_lens_k.max()) <= max_seqlen_k
    for b, seq_len_k in enumerate(seq_lens_k.tolist()):
        start, end = cu[b], cu[b + 1]
        slots = context_slots(block_tables[b], seq_len_k, block_size)
        k = read_cache(k_cache, slots, k_scale, q.dtype)  # [seq_len_k, num_kv_heads, head_dim]
        v = read_cache(v_cache, slots, v_scale, q.dtype)
        out[start:end] = _attend(q[start:end], k, v, scale)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, num_heads, d]; k, v: [k_len, num_kv_heads, d], queries are the last q_len keys."""
    q_len, k_len = q.shape[0], k.shape[0]
    q_pos = torch.arange(k_len - q_len, k_len, device=q.device)
    mask = torch.arange(k_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, k_len]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)
