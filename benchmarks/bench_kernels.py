"""B4 kernels: the Triton attention kernels against their anchors, on the GPU.

In one run:
1. the device-to-device copy bandwidth (bytes read + written over time);
2. prefill against torch's FlashAttention (`torch.nn.attention.varlen.varlen_attn`:
   no GQA and no paging there, so it gets contiguous K/V with repeated heads);
3. decode as a fraction of the copy bandwidth (bytes of K/V read over kernel time).
Correctness on shapes like these and many others is tests/test_triton_attn.py's
(`test_paged_attention_real_shapes`, on a GPU).

`--tune` first sweeps tile shapes, warps, pipeline stages and the split-KV target,
and runs the rest with the best of each (printed, to be made the defaults). Timings are medians of CUDA-graph replays
(`triton.testing.do_bench_cudagraph`). Prints a short table last, then one JSON line.

Usage: python benchmarks/bench_kernels.py [--tune]
"""
import argparse
import inspect
import json
import math
import time

import torch
import triton
import triton.testing

from nanovllm.kernels import triton_attn as ta

DEVICE = torch.device("cuda")
COPY_BYTES = 2 << 30          # 2 GiB: far past the 60 MB L2
REP_MS = 100                  # do_bench repetition budget per measurement (ms)
PREFILL_GOAL = 1.2            # ours / FlashAttention time, at most
DECODE_GOAL = 0.8             # fraction of copy bandwidth, at least
# The anchor shapes: Qwen3-0.6B attention (the model of B1).
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
PREFILL_SHAPES = [(16, 1024), (16, 2048)]    # (sequences, tokens each)
DECODE_SHAPES = [(256, 1024), (8, 8192)]     # (batch, context)


# ------------------------------------------------------------------------- inputs
def make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """(num_cached, q_len) per sequence -> paged_attention inputs over a shuffled cache."""
    ctx = torch.tensor([c + q for c, q in seqs])
    blocks_per_seq = (ctx + block_size - 1) // block_size
    num_blocks = int(blocks_per_seq.sum()) + 1
    order = torch.randperm(num_blocks)
    width = int(blocks_per_seq.max())
    block_tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    starts = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
    cols = torch.arange(width)
    owned = cols[None, :] < blocks_per_seq[:, None]
    block_tables[owned] = order[(starts[:, None] + cols[None, :])[owned]].to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(shape, device=DEVICE, dtype=dtype)
    q_lens = torch.tensor([q for _, q in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn(int(q_lens.sum()), num_heads, head_dim, device=DEVICE, dtype=dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu.to(DEVICE),
                seq_lens_k=ctx.to(torch.int32).to(DEVICE), block_tables=block_tables.to(DEVICE))


def host_facts(seqs):
    return dict(max_seqlen_q=max(q for _, q in seqs), max_seqlen_k=max(c + q for c, q in seqs))


# ------------------------------------------------------------------------ timing
def bench_ms(fn):
    """Median time of fn in ms, from CUDA-graph replays (no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")


def copy_bandwidth():
    """Device-to-device copy, bytes read + written per second: the faster of an eager
    copy (timed with events) and a graph-replayed one (a memcpy node, seen slower)."""
    src = torch.randn(COPY_BYTES // 2, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)
    eager_ms = triton.testing.do_bench(copy, rep=REP_MS, return_mode="median")
    graph_ms = bench_ms(copy)
    print(f"copy 2 GiB: eager {eager_ms:.3f} ms, graph {graph_ms:.3f} ms", flush=True)
    return 2 * COPY_BYTES / (min(eager_ms, graph_ms) * 1e-3)


def varlen_causal_kwargs():
    """torch 2.9/2.10 take is_causal; later versions take window_size=(-1, 0)."""
    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    return dict(is_causal=True) if "is_causal" in params else dict(window_size=(-1, 0))


def prefill_case(num_seqs, seq_len, dtype=torch.bfloat16):
    """Ours on the paged cache vs FlashAttention on contiguous repeated-head K/V."""
    from torch.nn.attention.varlen import varlen_attn
    seqs = [(0, seq_len)] * num_seqs
    batch = make_batch(seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype)
    scale = HEAD_DIM ** -0.5
    out = torch.empty_like(batch["q"])
    ours = lambda: ta.paged_attention(**batch, scale=scale, out=out, **host_facts(seqs))
    group = NUM_HEADS // NUM_KV_HEADS
    k = torch.randn(num_seqs * seq_len, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    k, v = k[:, ::group].repeat_interleave(group, 1), v[:, ::group].repeat_interleave(group, 1)
    cu = batch["cu_seqlens_q"]
    fa_kwargs = varlen_causal_kwargs()
    fa = lambda: varlen_attn(batch["q"], k, v, cu, cu, seq_len, seq_len, **fa_kwargs)
    flops = 4 * HEAD_DIM * NUM_HEADS * num_seqs * seq_len * (seq_len + 1) / 2
    return ours, fa, flops


def run_prefill():
    rows = []
    for num_seqs, seq_len in PREFILL_SHAPES:
        ours, fa, flops = prefill_case(num_seqs, seq_len)
        ours_ms, fa_ms = bench_ms(ours), bench_ms(fa)
        rows.append(dict(seqs=num_seqs, len=seq_len, ours_ms=ours_ms, fa_ms=fa_ms,
                         ratio=ours_ms / fa_ms, ours_tflops=flops / ours_ms / 1e9,
                         fa_tflops=flops / fa_ms / 1e9))
        print(f"prefill {num_seqs}x{seq_len}: ours {ours_ms:.3f} ms, FA {fa_ms:.3f} ms, "
              f"ratio {ours_ms / fa_ms:.2f}", flush=True)
    return rows


def decode_case(batch_size, ctx, dtype=torch.bfloat16, num_splits=None):
    seqs = [(ctx - 1, 1)] * batch_size
    batch = make_batch(seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype)
    out = torch.empty_like(batch["q"])
    fn = lambda: ta.paged_attention(**batch, scale=HEAD_DIM ** -0.5, out=out,
                                    num_splits=num_splits, **host_facts(seqs))
    kv_bytes = 2 * batch_size * ctx * NUM_KV_HEADS * HEAD_DIM * batch["k_cache"].element_size()
    return fn, kv_bytes


def run_decode(copy_bw):
    rows = []
    for batch_size, ctx in DECODE_SHAPES:
        fn, kv_bytes = decode_case(batch_size, ctx)
        ms = bench_ms(fn)
        bw = kv_bytes / (ms * 1e-3)
        rows.append(dict(batch=batch_size, ctx=ctx, ms=ms, TBps=bw / 1e12, frac=bw / copy_bw))
        print(f"decode {batch_size}x{ctx}: {ms:.3f} ms, {bw / 1e12:.2f} TB/s, "
              f"{bw / copy_bw:.2f} of copy", flush=True)
    return rows


# ------------------------------------------------------------------------ tuning
PREFILL_VARIANTS = [  # BLOCK_M, BLOCK_N, num_warps, num_stages
    (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3), (128, 32, 8, 4),
    (64, 32, 4, 4)]
DECODE_VARIANTS = [  # BLOCK_N, num_warps, num_stages
    (64, 4, 3), (128, 4, 3), (128, 8, 2), (32, 4, 4), (128, 4, 4)]
SPLIT_TARGETS = [2, 3, 4, 6, 8]            # TARGET_PROGRAMS_PER_SM values
SPLIT_SHAPES = [(8, 8192), (32, 2048)]     # decode shapes that need split-KV
TUNE_REP_MS = 50


def prefill_config():
    return (ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N, ta.PREFILL_NUM_WARPS, ta.PREFILL_NUM_STAGES)


def set_prefill_config(block_m, block_n, warps, stages):
    ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N = block_m, block_n
    ta.PREFILL_NUM_WARPS, ta.PREFILL_NUM_STAGES = warps, stages


def decode_config():
    return (ta.DECODE_BLOCK_N, ta.DECODE_NUM_WARPS, ta.DECODE_NUM_STAGES, ta.TARGET_PROGRAMS_PER_SM)


def set_decode_config(block_n, warps, stages, target):
    ta.DECODE_BLOCK_N, ta.DECODE_NUM_WARPS, ta.DECODE_NUM_STAGES = block_n, warps, stages
    ta.TARGET_PROGRAMS_PER_SM = target


def _timed_or_inf(fn):
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=TUNE_REP_MS, return_mode="median")
    except Exception as e:  # a variant may not fit (shared memory): report, go on
        print(f"  variant failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return math.inf


def tune_prefill():
    """Best prefill tile by mean time ratio to FlashAttention over PREFILL_SHAPES."""
    cases = [prefill_case(*shape) for shape in PREFILL_SHAPES]
    fa_ms = [bench_ms(fa) for _, fa, _ in cases]
    results = []
    for variant in PREFILL_VARIANTS:
        set_prefill_config(*variant)
        ratios = [_timed_or_inf(ours) / f for (ours, _, _), f in zip(cases, fa_ms)]
        results.append(dict(variant=variant, ratios=ratios, score=sum(ratios) / len(ratios)))
        print(f"tune prefill {variant}: x FA {[round(r, 3) for r in ratios]}", flush=True)
    return min(results, key=lambda r: r["score"]), results


def _decode_frac(shape, copy_bw):
    fn, kv_bytes = decode_case(*shape)
    return kv_bytes / (_timed_or_inf(fn) * 1e-3) / copy_bw


def tune_decode(copy_bw):
    """Best decode tile and split target by mean fraction of copy bandwidth."""
    results = []
    for variant in DECODE_VARIANTS:
        set_decode_config(*variant, ta.TARGET_PROGRAMS_PER_SM)
        big = _decode_frac(DECODE_SHAPES[0], copy_bw)  # enough programs: never split
        for target in SPLIT_TARGETS:
            set_decode_config(*variant, target)
            fracs = [big] + [_decode_frac(shape, copy_bw) for shape in SPLIT_SHAPES]
            results.append(dict(variant=(*variant, target), fracs=fracs,
                                score=sum(fracs) / len(fracs)))
            print(f"tune decode {variant} target={target}: of copy "
                  f"{[round(f, 3) for f in fracs]}", flush=True)
    return max(results, key=lambda r: r["score"]), results


def run_tuning(copy_bw):
    """Sweep, then leave the best configurations in effect for the rest of the run."""
    best_prefill, prefill = tune_prefill()
    best_decode, decode = tune_decode(copy_bw)
    set_prefill_config(*best_prefill["variant"])
    set_decode_config(*best_decode["variant"])
    print(f"best prefill {best_prefill['variant']}, best decode {best_decode['variant']}", flush=True)
    return dict(prefill=prefill, decode=decode)


# ------------------------------------------------------------------------ report
def print_table(copy_bw, prefill, decode):
    print("\n=== B4 kernels ===")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print(f"copy bandwidth (read+write): {copy_bw / 1e12:.2f} TB/s")
    print(f"config: prefill (BLOCK_M, BLOCK_N, warps, stages) = {prefill_config()}, "
          f"decode (BLOCK_N, warps, stages, programs/SM) = {decode_config()}")
    print(f"{'prefill (16q/8kv heads, d128, bf16)':<38}{'ours ms':>9}{'FA ms':>9}{'ratio':>7}"
          f"{'ours TF/s':>11}{'FA TF/s':>9}")
    for r in prefill:
        print(f"  {r['seqs']} seqs x {r['len']:<27}{r['ours_ms']:>9.3f}{r['fa_ms']:>9.3f}"
              f"{r['ratio']:>7.2f}{r['ours_tflops']:>11.0f}{r['fa_tflops']:>9.0f}")
    print(f"{'decode (16q/8kv heads, d128, bf16)':<38}{'ms':>9}{'TB/s':>9}{'frac':>7}")
    for r in decode:
        print(f"  batch {r['batch']} x ctx {r['ctx']:<23}{r['ms']:>9.3f}{r['TBps']:>9.2f}"
              f"{r['frac']:>7.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true",
                        help="first sweep kernel configurations and keep the best for the run")
    args = parser.parse_args()
    torch.manual_seed(int(time.time()))
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s", flush=True)
    tuning = run_tuning(copy_bw) if args.tune else {}
    prefill, decode = run_prefill(), run_decode(copy_bw)
    print_table(copy_bw, prefill, decode)
    goals = dict(prefill_within_1_2x_fa=all(r["ratio"] <= PREFILL_GOAL for r in prefill),
                 decode_at_least_0_8_bw=all(r["frac"] >= DECODE_GOAL for r in decode))
    print(json.dumps(dict(bench="B4", device=torch.cuda.get_device_name(),
                          copy_TBps=copy_bw / 1e12, prefill=prefill, decode=decode,
                          config=dict(prefill=prefill_config(), decode=decode_config()),
                          goals=goals, tuning=tuning)))


if __name__ == "__main__":
    main()
