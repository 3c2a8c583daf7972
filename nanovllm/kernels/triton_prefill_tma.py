"""Prefill attention whose K/V tiles arrive by TMA, for caches whose pages hold whole KV tiles.

`triton_attn`'s kernel gathers each K and V tile token by token through the block table: every
thread computes the addresses of the rows it copies and issues their copies, which works for any
page size. Where a page holds a whole number of KV tiles (`block_size % BLOCK_N == 0`), a tile
lies in one page, so its rows are contiguous in the cache viewed as the matrix
`[num_blocks * block_size, num_kv_heads * head_dim]`: one tensor-memory-accelerator copy (TMA, on
Hopper and later; Triton's tensor descriptors) brings the whole tile into shared memory from its
first row's coordinates, one block-table read a tile instead of one a key, and the threads that
computed addresses are left to the products and the softmax.

Same arguments and semantics as `triton_attn.paged_attention` for a batch with prefill tokens
(`max_seqlen_q > 1`; decode rows of a mixed batch are served too) and one split: queries tiled
and grouped per KV head as there (`BLOCK_Q` tokens times the query heads of one KV head), base-2
online softmax with fp32 accumulators, the tiles on the causal diagonal alone masked. Rows of a
masked tile past the context are whatever the page holds (NaN included): their scores are masked
and their values zeroed before the products.

Status: tested against the torch reference under Triton's interpreter and natively on an H200,
and off (`ENABLED = False`): on an H200 a 32k prompt's TTFT at pages of 64 was 0.370 s with it
against 0.366 s with the gather kernel (benchmarks/RESULTS.md "Twenty-fifth session"), so it gives
nothing yet at its default tile. The engine's default page size (16 tokens) holds no whole
64-key tile; pages of 64 or more (`kvcache_block_size`) do.

Applies (`applies`) to 16-bit caches of the queries' dtype whose head size is a power of two, laid
out `[num_blocks, block_size, num_kv_heads, head_dim]` contiguously (the engine's caches), on a GPU
of MIN_CAPABILITY or later. Compiled variants: one per model (head counts, head size, block size,
dtype); the tile is module constants.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.triton_paged_tiles import LOG2E, RUNNING_MAX_INIT, load_q_tile, split_tile_range, store_rows
from nanovllm.kernels.triton_pdl import launch_dependents, launch_options, wait_for_prior_grid

ENABLED = False          # module switch (off: no faster than the gather kernel, the module docstring)
MIN_CAPABILITY = (9, 0)  # TMA: sm_90 (Hopper) and later
BLOCK_M = 256            # rows of a tile: query tokens x the query heads of one KV head
BLOCK_N = 64             # keys of a KV tile (one TMA copy each of K and V)
NUM_WARPS = 8
NUM_STAGES = 3           # KV tiles in flight in the unmasked loop (software pipelining)
# Triton's automatic warp specialization of the unmasked loop. Triton 3.6 for sm_90 gave the same machine
# code with it at 8 warps and failed to compile it at 4 (benchmarks/attn_sass.py --prefill
# --check-warp-specialize; RESULTS.md "Twenty-fourth session"): off, for Triton versions to come.
WARP_SPECIALIZE = False
# The kernel has no split-KV: `triton_attn` sends it a prefill batch (without a split count of
# its own) whose grid gives every multiprocessor at least this many programs; smaller ones (a
# short chunk over a long prefix) keep the gather kernel's splits.
MIN_PROGRAMS_PER_SM = 1


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, tile, ctx_len, k_desc, v_desc, block_table_ptr, col, scale_log2,
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step of the query tile over KV tile `tile`, whose rows lie in one page."""
    first = tile * BLOCK_N
    row = tl.load(block_table_ptr + first // PAGE_SIZE) * PAGE_SIZE + first % PAGE_SIZE  # the tile's first cache row
    k = k_desc.load([row, col])                                          # [BLOCK_N, D]
    s = tl.dot(q, tl.trans(k)) * scale_log2                               # [BLOCK_M, BLOCK_N]
    positions = first + tl.arange(0, BLOCK_N)                             # [BLOCK_N]
    if MASKED:
        s = tl.where(positions[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))                                 # [BLOCK_M]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])                                       # [BLOCK_M, BLOCK_N]
    v = v_desc.load([row, col])                                          # [BLOCK_N, D]
    if MASKED:  # rows past the context: whatever the page holds, NaN included
        v = tl.where((positions < ctx_len)[:, None], v, 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_tma_kernel(out_ptr, q_ptr, k_desc, v_desc, cu_seqlens_q_ptr, seq_lens_k_ptr, block_tables_ptr,
                        scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                        QPK: tl.constexpr, QPK_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                        LOOP_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PDL: tl.constexpr):
    """Grid: (query tiles, KV heads, sequences); query tiles heaviest first."""
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_k_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // QPK_PAD                  # [BLOCK_M] query of each row
    head = kv_head * QPK + rows % QPK_PAD                         # [BLOCK_M] query head of each row
    row_ok = (q_idx < q_len) & (rows % QPK_PAD < QPK)
    q_pos = ctx_len - q_len + q_idx                               # [BLOCK_M] causal limit of each row
    q = load_q_tile(q_ptr, q_start, q_idx, head, row_ok, stride_qt, stride_qh, HEAD_DIM, HEAD_DIM)

    first_pos = ctx_len - q_len + q_block * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, ctx_len)
    tile_begin, full_end, masked_begin, tile_end = split_tile_range(kv_end, first_pos + 1, 0, 1, BLOCK_N)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    col = kv_head * HEAD_DIM
    m_i = tl.full([BLOCK_M], RUNNING_MAX_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for tile in tl.range(tile_begin, full_end, num_stages=LOOP_STAGES, warp_specialize=WARP_SPECIALIZE):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, tile, ctx_len, k_desc, v_desc, block_table_ptr,
                                     col, scale_log2, BLOCK_N, PAGE_SIZE, False)
    for tile in range(masked_begin, tile_end):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, tile, ctx_len, k_desc, v_desc, block_table_ptr,
                                     col, scale_log2, BLOCK_N, PAGE_SIZE, True)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]               # [BLOCK_M, HEAD_DIM]
    store_rows(out_ptr, q_start + q_idx, head, row_ok, o, stride_ot, stride_oh, HEAD_DIM, HEAD_DIM)


def pages_fit(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: pages of whole BLOCK_N-key tiles, a contiguous 16-bit
    cache of q's dtype, a power-of-two head size of at least 16."""
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    return (block_size % BLOCK_N == 0 and head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16
            and q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == v_cache.dtype == q.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `triton_attn.paged_attention` may send a prefill batch here: module ENABLED,
    `pages_fit`, on an NVIDIA GPU of MIN_CAPABILITY or later (Triton's interpreter runs the kernel
    when called directly, but the engine keeps the gather kernel there)."""
    return (ENABLED and pages_fit(q, k_cache, v_cache) and q.is_cuda and torch.version.hip is None
            and not triton.knobs.runtime.interpret
            and torch.cuda.get_device_capability(q.device) >= MIN_CAPABILITY)


def _tile_rows(qpk: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows of a tile, and the query tokens they hold (times the padded group)."""
    qpk_pad = triton.next_power_of_2(qpk)
    block_m = max(BLOCK_M, qpk_pad)
    return block_m, block_m // qpk_pad


def num_programs(max_seqlen_q: int, qpk: int, num_kv_heads: int, num_seqs: int) -> int:
    """The kernel's grid size for a batch."""
    return triton.cdiv(max_seqlen_q, _tile_rows(qpk)[1]) * num_kv_heads * num_seqs


def _cache_descriptor(cache: torch.Tensor) -> TensorDescriptor:
    """The cache [num_blocks, block_size, num_kv_heads, head_dim] as rows of all KV heads, copied
    a [BLOCK_N, head_dim] tile (one KV head) at a time."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return TensorDescriptor.from_tensor(cache.view(num_blocks * block_size, num_kv_heads * head_dim),
                                        [BLOCK_N, head_dim])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, max_seqlen_q: int, out: torch.Tensor) -> torch.Tensor:
    """`triton_attn.paged_attention` of a batch with prefill tokens, one split, where `pages_fit`.

    q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]; cu_seqlens_q [num_seqs + 1], seq_lens_k [num_seqs], block_tables [num_seqs, max_blocks]
    int32; out [num_tokens, num_heads, head_dim], returned."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs, num_kv_heads = seq_lens_k.shape[0], k_cache.shape[2]
    qpk = num_heads // num_kv_heads
    block_m, block_q = _tile_rows(qpk)
    _prefill_tma_kernel[(triton.cdiv(max_seqlen_q, block_q), num_kv_heads, num_seqs)](
        out, q, _cache_descriptor(k_cache), _cache_descriptor(v_cache), cu_seqlens_q, seq_lens_k, block_tables,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        QPK=qpk, QPK_PAD=triton.next_power_of_2(qpk), BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], LOOP_STAGES=NUM_STAGES, WARP_SPECIALIZE=WARP_SPECIALIZE,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **launch_options(q.device))
    return out

