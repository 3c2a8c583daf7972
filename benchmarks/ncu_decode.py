"""One B1-sized decode batch's paged attention, to read under Nsight Compute.

B1's largest decode batches (256 sequences, contexts of several hundred tokens, 16 query and
8 KV heads of 128, block size 16) over a bf16 or fp8 cache, with the blocks of each sequence
scattered over the cache as the engine's allocator leaves them. Launches the engine's decode
kernel `--iters` times (no split-KV at this batch size), so a profiler can skip the first
(compiling) launch and read one warm one. Other batches: `--seqs 1 --min-context 32000
--max-context 32000 --max-model-len 40960` is one long sequence split as the engine splits it
(the split count from the policy and `--max-model-len`, as a CUDA graph captures it, or
`--num-splits`); `--num-heads 32` is the Qwen3-8B shape's groups of 4.

    ncu --clock-control none -k regex:_unified_attention_kernel --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section Occupancy python3 benchmarks/ncu_decode.py --kv-cache-dtype fp8

`--attn-constants` sets triton_attn constants first (another tile), as bench_offline.py's does.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels import kv_quant  # noqa: E402
from nanovllm.kernels import triton_attn  # noqa: E402

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16  # Qwen3-0.6B and -8B


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16), fp8, fp8_e5m2")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--min-context", type=int, default=300)
    ap.add_argument("--max-context", type=int, default=1500)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--num-heads", type=int, default=16, help="query heads (16: Qwen3-0.6B, 32: Qwen3-8B)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="the max_seqlen_k the split policy sees")
    ap.add_argument("--num-splits", type=int, default=None, help="split-KV factor (default: the policy's)")
    ap.add_argument("--attn-constants", metavar="JSON", default="{}")
    args = ap.parse_args()
    for name, value in json.loads(args.attn_constants).items():
        if not hasattr(triton_attn, name):
            raise ValueError(f"kernels/triton_attn.py has no constant {name!r}")
        setattr(triton_attn, name, value)
    dtype = kv_quant.resolve_kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(args.min_context, args.max_context + 1, (args.seqs,), generator=gen)
    per_seq = [-(-int(c) // BLOCK_SIZE) for c in ctx]
    num_blocks = sum(per_seq) * 4  # the tables' blocks spread over a larger cache
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(args.seqs, max(per_seq), dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[start:start + n]
        start += n
    k_cache, v_cache = triton_attn.new_kv_cache((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype,
                                                torch.device("cuda"))
    for cache in (k_cache, v_cache):  # values of the engine's magnitude; fp8 through bytes
        kv_quant.as_bytes(cache).copy_(kv_quant.as_bytes(
            (torch.randn(cache.shape, device="cuda") * (20 if kv_quant.is_fp8(dtype) else 1)).to(dtype)))
    scales = {}
    if kv_quant.is_fp8(dtype):
        scales = dict(k_scale=torch.full((NUM_KV_HEADS,), 0.02, device="cuda"),
                      v_scale=torch.full((NUM_KV_HEADS,), 0.01, device="cuda"))
    q = torch.randn(args.seqs, args.num_heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    cu = torch.arange(args.seqs + 1, dtype=torch.int32, device="cuda")
    seq_lens, tables = ctx.to(torch.int32).cuda(), tables.cuda()
    out = torch.empty_like(q)
    for _ in range(args.iters):
        triton_attn.paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, HEAD_DIM ** -0.5, max_seqlen_q=1,
                                    max_seqlen_k=args.max_model_len, num_splits=args.num_splits, out=out,
                                    **scales)
    torch.cuda.synchronize()
    kv_bytes = int(ctx.sum()) * NUM_KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
    print(json.dumps({"kv_cache_dtype": str(dtype).removeprefix("torch."), "seqs": args.seqs,
                      "context_tokens": int(ctx.sum()), "kv_bytes": kv_bytes}))


if __name__ == "__main__":
    main()
