"""CPU prefill attention: a step's prompt chunks, those of one shape together, by bf16 products.

`torch_ref.paged_attention` attends each chunk with SDPA on 3-D tensors and a boolean causal
mask, which torch's CPU dispatch runs on its math backend. In bf16 on CPUs that multiply bf16
fast (AVX512-BF16, AMX) a chunk here is two batched bf16 products (scores, then probabilities
times values) around an fp32 softmax, as the decode steps of kernels/cpu_attn.py are, with the
G query heads of a KV head folded into the query rows (no K/V head is repeated): on SmolLM2's
9 query / 3 KV heads, one thread, AVX512-BF16, 0.65 against 1.2 ms a layer for a 128-token
prompt and 8.7 against 22 ms for a 512-token one (benchmarks/RESULTS.md "B2 CPU, round 9").
The probabilities are rounded to bf16 before the second product: the outputs differ from the
reference's by bf16 rounding. Elsewhere (fp32; CPUs without fast bf16) `torch_ref` runs.

Chunks of the same shape (query and key lengths: a burst of equal-length prompts, as a serving
benchmark's waves are) attend together, the sequences one more batch dimension of the same two
products: a chunk's ~20 small ops a layer are then paid once per shape, not once per sequence
(16 x 128-token prompts on two threads: the step's attention layers, stores included, 335-387 -> 238-253
ms of a 1.6-1.8 s step; benchmarks/RESULTS.md "B2 CPU, round 10"). Each sequence's values are those it
gets alone (the same products per batch entry).

A batch's scores are `[kv_heads * seqs, group * rows, k_len]` in fp32; its queries are taken in
slices of rows that keep them under MAX_SCORES values, so a long prompt does not hold a whole
`[q_len, k_len]` matrix per head at once. Arguments as `torch_ref.paged_attention`'s, without its
host-known bounds.
"""
from collections import defaultdict

import torch

from nanovllm.kernels import torch_ref
from nanovllm.utils.device import cpu_has_fast_bf16

MAX_SCORES = 1 << 22  # fp32 scores per slice of query rows (16 MiB)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context (see torch_ref).

    q: [num_tokens, num_heads, d]; cu_seqlens_q: [num_seqs + 1]; seq_lens_k: [num_seqs]
    Returns: [num_tokens, num_heads, d]
    """
    if not (q.dtype == torch.bfloat16 and cpu_has_fast_bf16()):
        return torch_ref.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale,
                                         k_scale=k_scale, v_scale=v_scale)
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for (q_len, k_len), seqs in _by_shape(cu, seq_lens_k.tolist()).items():
        slots = torch.cat([torch_ref.context_slots(block_tables[b], k_len, block_size) for b in seqs])
        k = torch_ref.read_cache(k_cache, slots, k_scale, q.dtype)  # [seqs * k_len, kv_heads, d]
        v = torch_ref.read_cache(v_cache, slots, v_scale, q.dtype)
        rows = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in seqs])  # [seqs * q_len]
        o = causal_by_products(q[rows].unflatten(0, (len(seqs), q_len)), k.unflatten(0, (len(seqs), k_len)),
                               v.unflatten(0, (len(seqs), k_len)), scale)
        out[rows] = o.flatten(0, 1)
    return out


def _by_shape(cu: list[int], seq_lens_k: list[int]) -> dict[tuple[int, int], list[int]]:
    """The sequences of each (query length, key length), in step order."""
    shapes = defaultdict(list)
    for b, k_len in enumerate(seq_lens_k):
        shapes[(cu[b + 1] - cu[b], k_len)].append(b)
    return shapes


def causal_by_products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [seqs, q_len, num_heads, d]; k, v: [seqs, k_len, kv_heads, d], each sequence's queries being
    the last q_len keys' positions -> [seqs, q_len, num_heads, d]."""
    seqs, q_len, num_heads, d = q.shape
    _, k_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    batch = num_kv_heads * seqs
    q = q.view(seqs, q_len, num_kv_heads, group, d).permute(2, 0, 3, 1, 4)  # [kv_heads, seqs, group, q_len, d]
    k = k.permute(2, 0, 3, 1).reshape(batch, d, k_len)                       # [kv_heads * seqs, d, k_len]
    v = v.permute(2, 0, 1, 3).reshape(batch, k_len, d)                       # [kv_heads * seqs, k_len, d]
    out = torch.empty(num_kv_heads, seqs, group, q_len, d, dtype=q.dtype)
    rows = max(1, MAX_SCORES // (num_heads * seqs * k_len))
    for start in range(0, q_len, rows):
        end = min(start + rows, q_len)
        scores = torch.bmm(q[..., start:end, :].reshape(batch, -1, d), k).float()  # [batch, group*n, k_len]
        scores = scores.view(batch, group, end - start, k_len).mul_(scale)
        scores.add_(_causal_mask(start, end, q_len, k_len))
        probs = torch.softmax(scores, -1).to(v.dtype).view(batch, -1, k_len)
        out[..., start:end, :] = torch.bmm(probs, v).view(num_kv_heads, seqs, group, end - start, d)
    return out.permute(1, 3, 0, 2, 4).reshape(seqs, q_len, num_heads, d)


def _causal_mask(start: int, end: int, q_len: int, k_len: int) -> torch.Tensor:
    """Additive mask of query rows [start, end) of a chunk whose q_len queries are the last of
    k_len keys: -inf on the keys after each query's own position.  # [end - start, k_len]"""
    first = k_len - q_len + start  # the position of query row `start`
    return torch.full((end - start, k_len), float("-inf")).triu_(first + 1)
