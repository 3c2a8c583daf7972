"""Prefill attention of a 32,000-token prompt on the GPU: the gather kernel against the TMA kernel.

The engine prefills a 32k prompt in 8,192-token chunks; this times the attention of two of them
(28 layers' worth, Qwen3-0.6B's 16 query / 8 KV heads of 128), each over a shuffled paged cache:
the first chunk (causal, no prefix) and the last (over the 23,808 tokens cached before it). For
each cache page size in `--block-sizes`:

- `triton_attn`'s kernel, which gathers K/V token by token (any page size), with the TMA kernel
  switched off, per tile of `--gather-tiles`: at the split count its policy gives a prefill (`policy`)
  and unsplit (`splits1`), with `QUERY_TILES_OUTER` (`_qouter`: query tiles heaviest first across
  heads, not head by head) and `SOFTMAX_SCALE_IN_EXP` (`_scale_in_exp`) off and on (GATHER_VARIANTS);
- where pages hold whole tiles, `triton_prefill_tma`'s kernel at each tile of `--tma-tiles`
  (BLOCK_M, BLOCK_N, warps, stages, warp specialization), its output checked against the gather
  kernel's.

Prints one JSON line per (page size, kernel, tile): ms per chunk (all layers) and TFLOP/s of the
causal products.

    python benchmarks/bench_prefill_attention.py [--block-sizes 16,64,128] [--tma-tiles JSON]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_long_context import PREFILL_CHUNK, PROMPT_LEN, _paged_inputs, _time_tile, tile_constants  # noqa: E402
from bench_offline import QWEN3_0_6B  # noqa: E402

# Triton 3.6 compiled the warp-specialized loop to the same sm_90 code as the plain one (attn_sass.py
# --prefill; RESULTS.md "Twenty-fourth session"), so the default list has no warp-specialized tile.
DEFAULT_TMA_TILES = [[256, 64, 8, 3, False], [256, 64, 8, 2, False], [256, 128, 8, 2, False],
                     [128, 128, 8, 3, False], [128, 64, 4, 3, False]]


# the gather kernel's switches timed side by side (the first: the defaults)
GATHER_VARIANTS = {
    "gather": dict(QUERY_TILES_OUTER=False, SOFTMAX_SCALE_IN_EXP=False),
    "gather_qouter": dict(QUERY_TILES_OUTER=True, SOFTMAX_SCALE_IN_EXP=False),
    "gather_scale_in_exp": dict(QUERY_TILES_OUTER=False, SOFTMAX_SCALE_IN_EXP=True),
    "gather_qouter_scale_in_exp": dict(QUERY_TILES_OUTER=True, SOFTMAX_SCALE_IN_EXP=True),
}


def causal_flops(cfg: dict, cached: int, queries: int) -> float:
    """Multiply-adds x 2 of QK^T and PV, query i of the chunk seeing cached + i + 1 keys."""
    keys = queries * cached + queries * (queries + 1) // 2
    return 4 * cfg["num_attention_heads"] * cfg["head_dim"] * keys


def sdpa_rows(inputs: dict):
    """(backend, gqa, ms of the K/V gather, ms of the first call, ms a call, max abs diff against
    paged_attention's output) per torch SDPA backend on `inputs`' one sequence; ms is a failure's text."""
    import time
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from nanovllm.kernels import triton_attn
    q, k_cache, v_cache = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    queries, context, heads = q.shape[0], int(inputs["max_seqlen_k"]), q.shape[1]
    ref = triton_attn.paged_attention(**inputs)                          # [queries, heads, head_dim]
    pages = inputs["block_tables"][0].long()

    def gather(cache, repeat):  # [1, KV heads (x repeat), context, head_dim]
        kv = cache[pages].flatten(0, 1)[:context].transpose(0, 1).unsqueeze(0)
        return kv.repeat_interleave(repeat, dim=1) if repeat > 1 else kv
    gather_ms = time_chunk(lambda: gather(k_cache, 1))
    mask = causal_lower_right(queries, context)
    q4 = q.transpose(0, 1).unsqueeze(0)                                  # [1, heads, queries, head_dim]
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            repeat = 1 if gqa else heads // k_cache.shape[2]
            k, v = gather(k_cache, repeat), gather(v_cache, repeat)
            fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                q4, k, v, attn_mask=mask, scale=inputs["scale"], enable_gqa=gqa)
            try:
                with sdpa_kernel([backend]):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = fn()
                    torch.cuda.synchronize()
                    first_ms = (time.perf_counter() - start) * 1e3
                    ms = time_chunk(fn)
                err = (out[0].transpose(0, 1).float() - ref.float()).abs().max().item()
            except Exception as e:  # a backend that does not take this shape or mask: named, not fatal
                first_ms, ms, err = None, f"{type(e).__name__}: {str(e)[:160]}", None
            yield backend.name, gqa, gather_ms * repeat, first_ms, ms, err
            del k, v


def time_chunk(fn) -> float:
    """ms of one call of `fn` (a compiled kernel's launch), the median of do_bench's repeats."""
    import triton
    fn()
    return triton.testing.do_bench(fn, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-sizes", default="16,64")
    ap.add_argument("--gather-tiles", metavar="JSON", default="[[256, 64, 8, 3], [128, 128, 8, 3]]",
                    help="the gather kernel's large prefill tiles, [[BLOCK_M, BLOCK_N, warps, stages], ...] (first: "
                         "the reference output)")
    ap.add_argument("--tma-tiles", metavar="JSON", default=json.dumps(DEFAULT_TMA_TILES),
                    help="[[BLOCK_M, BLOCK_N, warps, stages, warp_specialize], ...]")
    ap.add_argument("--sdpa", action="store_true", help="also torch SDPA's backends (pages of the first size)")
    args = ap.parse_args()
    import triton
    from nanovllm.kernels import triton_attn, triton_prefill_tma
    cfg = QWEN3_0_6B
    layers = cfg["num_hidden_layers"]
    chunks = {"first_chunk": 0, "last_chunk": PROMPT_LEN - PREFILL_CHUNK}
    for bs in [int(b) for b in args.block_sizes.split(",")]:
        for name, cached in chunks.items():
            inputs = _paged_inputs(cfg, cached, PREFILL_CHUNK, bs)
            flops = causal_flops(cfg, cached, PREFILL_CHUNK)

            def report(kernel, tile, ms, err=None):
                row = {"block_size": bs, "chunk": name, "kernel": kernel, "tile": tile}
                if isinstance(ms, str):
                    row["failed"] = ms
                else:
                    row.update(ms=round(layers * ms, 3), tflops=round(flops / (ms * 1e-3) / 1e12, 1))
                if err is not None:
                    row["max_abs_diff_vs_gather"] = err
                print(json.dumps(row), flush=True)

            if args.sdpa and bs == int(args.block_sizes.split(",")[0]):
                for backend, gqa, gather_ms, first_ms, ms, err in sdpa_rows(inputs):
                    report(f"sdpa_{backend.lower()}", "gqa" if gqa else "kv_repeated", ms, err)
                    if first_ms is not None:
                        print(json.dumps({"chunk": name, "sdpa": backend, "gqa": gqa, "first_call_ms": round(
                            first_ms, 1), "kv_gather_ms": round(layers * 2 * gather_ms, 3)}), flush=True)
            with tile_constants(triton_prefill_tma, ENABLED=False):
                ref = triton_attn.paged_attention(**inputs)
                for block_m, block_n, warps, stages in json.loads(args.gather_tiles):
                    tile = f"m{block_m}_n{block_n}_w{warps}_s{stages}"
                    constants = dict(PREFILL_LARGE_BLOCK_M=block_m, PREFILL_LARGE_BLOCK_N=block_n,
                                     PREFILL_LARGE_NUM_WARPS=warps, PREFILL_LARGE_NUM_STAGES=stages)
                    for splits, kwargs in (("policy", {}), ("splits1", {"num_splits": 1})):
                        for kernel, switches in GATHER_VARIANTS.items():
                            report(kernel, f"{tile}_{splits}", _time_tile(
                                triton_attn, dict(inputs, **kwargs), triton.testing.do_bench,
                                **switches, **constants))
            if not triton_prefill_tma.pages_fit(inputs["q"], inputs["k_cache"], inputs["v_cache"]):
                continue
            for block_m, block_n, warps, stages, ws in json.loads(args.tma_tiles):
                if bs % block_n:
                    continue
                tile = f"m{block_m}_n{block_n}_w{warps}_s{stages}" + ("_ws" if ws else "")
                try:
                    with tile_constants(triton_prefill_tma, BLOCK_M=block_m, BLOCK_N=block_n, NUM_WARPS=warps,
                                        NUM_STAGES=stages, WARP_SPECIALIZE=ws):
                        fn = lambda: triton_prefill_tma.prefill_attention(  # noqa: E731
                            **{k: v for k, v in inputs.items() if k != "max_seqlen_k"}, out=torch.empty_like(ref))
                        err = (fn().float() - ref.float()).abs().max().item()
                        ms = time_chunk(fn)
                except Exception as e:  # a tile this GPU or Triton cannot compile: named, not fatal
                    ms, err = f"{type(e).__name__}: {str(e)[:200]}", None
                report("tma", tile, ms, err)
            del inputs, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
