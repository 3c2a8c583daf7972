"""CPU paged attention: decode steps batched in one call; everything else by the reference.

Where a C++ compiler is found (the one torch.compile uses), a decode step, and the decodes of
a mixed step, run the C++ kernel of kernels/cpu_paged_decode.py, which reads each sequence's
K/V where the paged cache holds them. On SmolLM2's shapes, two threads, caches read cold, us a
layer (bf16 and fp32; benchmarks/RESULTS.md "B2 CPU, round 12"): 1 sequence 17-21 against
80-155; 16 sequences 290-460 against 500-670 over the decode mirror (a batch that lasts) and
830-1,620 gathered afresh (a server's changing batch); 64 sequences 1,700-1,800 against
1,900-2,600 and 4,450-5,460. What follows is the torch-only path, which runs without a
compiler (and for head sizes the kernel is not built for):

`torch_ref.paged_attention` attends one sequence at a time, which is clear but
costs one small SDPA call per sequence and layer: at 64 sequences and 30 layers,
1,920 calls per decode step. Here a decode-only step (every sequence has one query
token) does, per layer:

1. each sequence's K/V as `[kv_heads, num_seqs, max_len, d]`: from the layer's decode
   mirror (kernels/cpu_decode_mirror.py: last step's K/V, one row per sequence appended)
   when this step is the last one grown by one token, else gathered from the paged
   cache with one `index_select` per cache (whole 16-token blocks: contiguous copies,
   about 4x faster than indexing by slot), padded to the widest block table;
2. one `scaled_dot_product_attention` over all sequences, with a key-length mask.
   Grouped-query heads are folded into the query length (the G query heads of a KV
   head become G queries of that head), so no K/V head is repeated and torch's CPU
   flash-attention kernel applies. In bf16 on CPUs with fast bf16 (AVX512-BF16, AMX)
   the same attention runs as two batched products (scores, then probabilities times
   values) around an fp32 softmax instead: 2-2.9x faster than torch's flash kernel there
   (SmolLM2's shapes, 64 sequences, one thread: 0.29 against 0.85 ms a layer at 64
   tokens, 0.72 against 1.67 at 128, 1.67 against 3.79 at 256; benchmarks/RESULTS.md
   "B2 CPU, round 8"); on AVX2 in fp32 the two ran alike (round 6), so SDPA stays there.
   Small decode steps (at most SDPA_MAX_KEY_ROWS sequence-key pairs, one sequence's
   whole context up to there) keep SDPA: each bf16 product has a fixed cost of ~20-40 us
   that the flash kernel does not pay (one sequence at 40-140 tokens: 28-49 against
   128-137 us a layer; round 9).
   The probabilities are rounded to bf16 before the second product: the outputs differ
   from SDPA's by bf16 rounding (at most 0.008 on unit-normal values there).

The CPU cache keeps the KV-head dimension outside the blocks (`new_kv_cache`: memory
`[kv_heads, num_blocks, block_size, d]`, handed out as the `[num_blocks, block_size,
kv_heads, d]` view every reader indexes), so the gather of step 1 is already the layout
the products read, each (sequence, head) a contiguous `[max_len, d]` matrix. On the
layout that interleaves heads (`[num_blocks, block_size, kv_heads, d]` memory, what
tests and the fp8 calibration allocate) the same code runs, its gather slower.

A mixed step (decodes beside prefill chunks: every serving step while prompts arrive)
splits: its decodes go through the batched path, its prefill chunks through
`cpu_prefill_attn` (once per prompt, not per token: bf16 products where the CPU multiplies
bf16 fast, else `torch_ref`). A step of prefills only goes to `cpu_prefill_attn` whole.
Signatures are those of `torch_ref`; tests compare the two. An fp8 cache is gathered as
bytes and dequantized before the products, as in `torch_ref`.
"""
import math
import threading

import torch
import torch.nn.functional as F

from nanovllm.kernels import cpu_decode_mirror, cpu_paged_decode, cpu_prefill_attn, kv_quant, torch_ref
from nanovllm.kernels.step_memo import once_per_step
from nanovllm.utils.device import cpu_has_fast_bf16

# Decode steps of at most this many (sequence, key position) pairs attend by SDPA even where
# the batched bf16 products are faster for larger steps: measured crossover 420-560 pairs on
# SmolLM2's shapes, one thread, AVX512-BF16 (benchmarks/RESULTS.md "B2 CPU, round 9").
SDPA_MAX_KEY_ROWS = 512

# Per-thread state (two engines stepping in two threads must not share it): the buffers
# the gathered K/V are written into, reused by every layer and step instead of allocated
# afresh (about 30% of the gather's time). Once-per-step plans: kernels/step_memo.py.
_local = threading.local()


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """As `torch_ref.store_kvcache`; when no slot is -1 (every CPU step so far), two
    `index_copy_` calls instead of boolean-mask indexing (7 small ops fewer per layer).

    key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64
    k_scale, v_scale: [num_kv_heads] float32, for an fp8 cache
    """
    if not _all_slots_valid(slot_mapping):
        return torch_ref.store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    key, value = torch_ref.quantize_for_cache(key, value, k_cache.dtype, k_scale, v_scale)
    kv_quant.as_bytes(k_cache).view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, kv_quant.as_bytes(key))
    kv_quant.as_bytes(v_cache).view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, kv_quant.as_bytes(value))


def _all_slots_valid(slot_mapping: torch.Tensor) -> bool:
    """No slot is -1 (and there is one): checked once per step, as every layer gets the same tensor."""
    return once_per_step("slots_valid", (slot_mapping,),
                         lambda: slot_mapping.numel() > 0 and int(slot_mapping.min()) >= 0)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, *, max_seqlen_q: int | None = None,
                    max_seqlen_k: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context (see torch_ref).

    q:            [num_tokens, num_heads, head_dim]
    k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: [num_seqs + 1]; seq_lens_k: [num_seqs]; block_tables: [num_seqs, max_blocks]
    Returns:      [num_tokens, num_heads, head_dim]
    """
    if q.shape[0] == seq_lens_k.shape[0]:  # one query per sequence: decode-only
        return decode_attention(q, k_cache, v_cache, seq_lens_k, block_tables, scale, max_seqlen_k,
                                k_scale, v_scale)
    split = _mixed_split(cu_seqlens_q, seq_lens_k, block_tables)
    if split is None:  # fewer than two decodes: nothing to batch
        cpu_decode_mirror.invalidate(k_cache)  # (this step may have stored into blocks the mirror held)
        return cpu_prefill_attn.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables,
                                                  scale, k_scale, v_scale)
    decode_rows, decode_lens, decode_tables, prefill_rows, prefill_cu, prefill_lens, prefill_tables = split
    out = torch.empty_like(q)
    out[decode_rows] = decode_attention(q[decode_rows], k_cache, v_cache, decode_lens, decode_tables, scale,
                                        max_seqlen_k, k_scale, v_scale)
    out[prefill_rows] = cpu_prefill_attn.prefill_attention(q[prefill_rows], k_cache, v_cache, prefill_cu,
                                                           prefill_lens, prefill_tables, scale, k_scale, v_scale)
    return out


def _mixed_split(cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_tables: torch.Tensor):
    """A mixed step's decodes and prefill chunks, apart; None when it has fewer than two decodes.

    Returns (decode query rows [d], their seq_lens_k [d] and block tables [d, max_blocks],
    prefill query rows [p_tokens], their cu_seqlens_q [p + 1], seq_lens_k [p], block tables).
    Built once per step (every layer gets the same Context tensors), like `_decode_plan`; the
    decode part's tensors stay the same objects, so that plan is built once per step too.
    """
    return once_per_step("mixed_split", (cu_seqlens_q, seq_lens_k, block_tables),
                         lambda: _build_mixed_split(cu_seqlens_q, seq_lens_k, block_tables))


def _build_mixed_split(cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_tables: torch.Tensor):
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [num_seqs]
    is_decode = q_lens == 1
    if int(is_decode.sum()) < 2:
        return None
    decodes, prefills = is_decode.nonzero().squeeze(1), (~is_decode).nonzero().squeeze(1)
    starts = cu_seqlens_q[:-1].long()
    prefill_q_lens = q_lens[prefills]
    prefill_cu = torch.cat([prefill_q_lens.new_zeros(1), prefill_q_lens.cumsum(0)]).to(cu_seqlens_q.dtype)
    # each prefill token's row: its sequence's first row + its offset in the chunk
    offsets = torch.arange(int(prefill_cu[-1])) - torch.repeat_interleave(prefill_cu[:-1].long(), prefill_q_lens)
    prefill_rows = torch.repeat_interleave(starts[prefills], prefill_q_lens) + offsets
    return (starts[decodes], seq_lens_k[decodes], block_tables[decodes],
            prefill_rows, prefill_cu, seq_lens_k[prefills], block_tables[prefills])


def new_kv_cache(shape: tuple[int, int, int, int], dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches, each [num_blocks, block_size, num_kv_heads, head_dim], as
    permuted views of [num_kv_heads, num_blocks, block_size, head_dim] memory.

    Code that indexes the cache by (block, row, head) reads the same values as on the
    contiguous layout (`torch_ref`, the stores, prefix caching's block ids are unchanged);
    merging the block and row dimensions (`view(-1, kv_heads, d)`, a flat slot index) is
    still a view. The decode gather gets each (sequence, head) as one [len, d] matrix.
    """
    num_blocks, block_size, num_kv_heads, head_dim = shape
    memory = (num_kv_heads, num_blocks, block_size, head_dim)
    return tuple(torch.empty(memory, dtype=dtype, device=device).permute(1, 2, 0, 3) for _ in range(2))


def prepare_decode_kernel(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Build the C++ decode kernel now (engine start-up), not at the first decode step; whether
    decode steps will run it (False: no C++ compiler, or dtypes / head size it is not built for)."""
    return cpu_paged_decode.prepare(q_dtype, cache_dtype, head_dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens_k: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, max_seqlen_k: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence, all sequences in one batch of products, the K/V from the
    layer's decode mirror when this step is its last one grown by one (cpu_decode_mirror.py),
    else gathered from the paged cache (and mirrored for the next step if the batch lasts).

    q: [num_seqs, num_heads, d] -> [num_seqs, num_heads, d]
    """
    kernel = cpu_paged_decode.kernel_for(q.dtype, k_cache.dtype, q.shape[2])
    if kernel is not None:  # the C++ kernel over the paged cache as it lies (not for an fp8 cache)
        return cpu_paged_decode.decode_attention(kernel, q, k_cache, v_cache, seq_lens_k, block_tables, scale,
                                                 cpu_decode_mirror.longest(seq_lens_k))
    mirror = cpu_decode_mirror.lookup(k_cache, block_tables, seq_lens_k)
    if mirror is not None:
        cpu_decode_mirror.append(mirror, k_cache, v_cache, block_tables, seq_lens_k, (k_scale, v_scale))
    else:
        num_seqs = q.shape[0]
        blocks, unowned = _decode_plan(block_tables, seq_lens_k, k_cache.shape[1], max_seqlen_k)
        k = _gather(k_cache, blocks, unowned, k_scale, q.dtype, "k").unflatten(1, (num_seqs, -1))
        v = _gather(v_cache, blocks, unowned, v_scale, q.dtype, "v").unflatten(1, (num_seqs, -1))
        mirror = cpu_decode_mirror.remember(k_cache, v_cache, k, v, block_tables, seq_lens_k)
        if mirror is None:  # not mirrored (yet): attend over the gather
            by_products = _by_products(q.dtype, num_seqs * k.shape[2])
            return _attend(q, k, v, _key_mask(seq_lens_k, k.shape[2]), scale, by_products)
    max_len = cpu_decode_mirror.longest(seq_lens_k)
    if _by_products(q.dtype, q.shape[0] * max_len):
        # the whole buffers, their zero tail masked: a slice's gap between sequences made the
        # batched products copy K (transposed) and V first, ~2x the products' own time (a
        # profile of 16-row steps at ~130 tokens: 0.30 + 0.09 ms of copies a layer against 0.19 +
        # 0.12 of products), more than the masked tail's slack (MIRROR_SLACK_TOKENS at most) costs
        return _attend(q, mirror.k, mirror.v, _key_mask(seq_lens_k, mirror.k.shape[2]), scale, True)
    return _attend(q, mirror.k[:, :, :max_len], mirror.v[:, :, :max_len], _key_mask(seq_lens_k, max_len), scale,
                   False)


def _by_products(dtype: torch.dtype, key_rows: int) -> bool:
    """Whether a decode step of `key_rows` (sequence, key position) pairs attends by two
    batched products (bf16 where the CPU multiplies bf16 fast, above SDPA_MAX_KEY_ROWS:
    module docstring) rather than SDPA."""
    return dtype == torch.bfloat16 and key_rows > SDPA_MAX_KEY_ROWS and cpu_has_fast_bf16()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            by_products: bool) -> torch.Tensor:
    """q: [num_seqs, num_heads, d]; k, v: [kv_heads, num_seqs, max_len, d], each [max_len, d] matrix
    contiguous; mask: additive, [1, num_seqs, 1, max_len] -> [num_seqs, num_heads, d].
    `by_products`: two batched products around an fp32 softmax instead of SDPA."""
    num_seqs, num_heads, d = q.shape
    num_kv_heads, _, max_len, _ = k.shape
    group = num_heads // num_kv_heads
    q = q.view(num_seqs, num_kv_heads, group, d).transpose(0, 1)  # [kv_heads, num_seqs, group, d]
    if by_products:
        # two batched bf16 products (oneDNN's, native bf16 dot products) around an fp32 softmax
        scores = torch.matmul(q, k.transpose(-1, -2)).float()      # [kv_heads, num_seqs, group, max_len]
        probs = torch.softmax(scores.mul_(scale).add_(mask), -1).to(v.dtype)
        o = torch.matmul(probs, v)                                 # [kv_heads, num_seqs, group, d]
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=scale)
    return o.transpose(0, 1).reshape(num_seqs, num_heads, d)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, unowned: torch.Tensor, scale: torch.Tensor | None,
            dtype: torch.dtype, name: str) -> torch.Tensor:
    """The blocks `blocks` of every KV head, `[kv_heads, len(blocks) * block_size, d]` in `dtype`
    (dequantized from an fp8 cache), in this thread's reused buffer, with the rows no sequence
    owns zeroed.

    Those rows (past a sequence's length: the tail of its last block, -1 padding) hold
    whatever the cache had, NaN bit patterns included: the mask gives them weight 0, but
    0 * NaN is NaN. Only they are filled (`unowned`: their row numbers), not the whole copy.
    """
    cache_dtype = cache.dtype
    heads_major = kv_quant.as_bytes(cache).permute(2, 0, 1, 3)  # [kv_heads, num_blocks, block_size, d]
    shape = (heads_major.shape[0], len(blocks), *heads_major.shape[2:])
    out = torch.index_select(heads_major, 1, blocks, out=_buffer(name, shape, heads_major))
    out = out.flatten(1, 2)  # [kv_heads, len(blocks) * block_size, d]
    out.index_fill_(1, unowned, 0)  # (fp8: 0 bytes are 0.0)
    if kv_quant.is_fp8(cache_dtype):
        return (out.view(cache_dtype).float() * scale.view(-1, 1, 1)).to(dtype)
    return out


def _buffer(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A `shape` tensor of `like`'s dtype from this thread's buffer `name`, grown when too small."""
    numel = math.prod(shape)
    buf = getattr(_local, name, None)
    if (buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device
            or buf.is_inference() != torch.is_inference_mode_enabled()):  # (written in place by the caller)
        buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        setattr(_local, name, buf)
    return buf[:numel].view(shape)


def _decode_plan(block_tables: torch.Tensor, seq_lens_k: torch.Tensor, block_size: int,
                 max_seqlen_k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids to gather [num_seqs * max_blocks] and the row numbers of the gathered slots no
    sequence owns [num_unowned].

    Every layer of a step gets the same `block_tables` and `seq_lens_k` tensors (from
    one Context), so the plan is built once per step, not per layer (step_memo).
    """
    return once_per_step("decode_plan", (block_tables, seq_lens_k, block_size, max_seqlen_k),
                         lambda: _build_decode_plan(block_tables, seq_lens_k, block_size, max_seqlen_k))


def _build_decode_plan(block_tables: torch.Tensor, seq_lens_k: torch.Tensor, block_size: int,
                       max_seqlen_k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if max_seqlen_k is not None:  # the host-known bound trims table columns no sequence uses
        block_tables = block_tables[:, :-(-max_seqlen_k // block_size)]
    blocks = block_tables.clamp_min(0).flatten().long()  # -1 padding reads block 0, masked below
    positions = torch.arange(block_tables.shape[1] * block_size, device=seq_lens_k.device)
    unowned = positions >= seq_lens_k[:, None]  # [num_seqs, max_len]
    return blocks, unowned.flatten().nonzero().squeeze(1)


def _key_mask(seq_lens_k: torch.Tensor, width: int) -> torch.Tensor:
    """The additive mask of `width` key positions, -inf past each sequence's length.  # [1, num_seqs, 1, width]"""
    def compute():
        unowned = torch.arange(width, device=seq_lens_k.device) >= seq_lens_k[:, None]  # [num_seqs, width]
        return torch.zeros(1, *unowned.shape[:1], 1, width, device=seq_lens_k.device).masked_fill_(
            unowned[None, :, None, :], float("-inf"))
    return once_per_step("key_mask", (seq_lens_k, width), compute)
