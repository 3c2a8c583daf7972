"""Long contexts on the GPU: one 32,000-token prompt, through the public API.

Qwen3-0.6B configuration, dummy weights, max_model_len 40960, the engine's defaults
otherwise (max_num_batched_tokens 8192: the prompt prefills in chunks). Measures:

- TTFT of the 32k prompt (`max_tokens=1`; the median of a few fresh prompts: no prefix hits);
- decode tok/s of that one sequence (256 tokens after it: total time minus its TTFT),
  against the floor its bytes allow: per step the weights and the whole K/V so far, over
  the copy bandwidth measured in the same run;
- the attention kernel alone on that decode (28 layers' worth, CUDA-graph replays) at
  several split-KV factors, so the split policy can be read off (`--splits`), once per
  set of kernel constants in `--sweep-constants`;
- with `--tile-sweep`, the attention kernel alone at other tile shapes (the module's tile
  constants set for the measurement, then restored): the decode above, and the prefill of
  the prompt's last 8192-token chunk over its 23,808 cached tokens, with its TFLOP/s;
- with `--profile`, GPU time by kernel over the same decode run again (its prompt then
  comes from the prefix cache, so the table is the decode's: divide by its steps).

    python benchmarks/bench_long_context.py [--tile-sweep] [--profile]
"""
import argparse
import json
from contextlib import contextmanager
import os
import statistics
import sys
import time
from random import randint, seed

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_offline import QWEN3_0_6B, copy_bandwidth, model_dir, profile, set_kernel_constants  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.warmup import VariantCounter  # noqa: E402

PROMPT_LEN = 32000
MAX_MODEL_LEN = 40960
DECODE_TOKENS = 256
TTFT_PROMPTS = 3


def decode_floor_s(cfg: dict, context: int, tokens: int, bandwidth: float, dtype_bytes: int = 2) -> float:
    """Bytes a decode of `tokens` steps after `context` must move (weights + K/V read, per step)."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    weights = (L * (h * (q + 2 * kv) + q * h + 3 * h * i) + h * cfg["vocab_size"]) * dtype_bytes
    kv_per_token = 2 * L * kv * dtype_bytes
    return sum(weights + (context + t) * kv_per_token for t in range(tokens)) / bandwidth


def attention_split_sweep(cfg: dict, context: int, splits: list[int], constants: dict | None = None) -> dict:
    """ms of one decode's attention (all layers) at each split factor, and its bytes floor,
    with kernels/triton_attn.py's constants set to `constants` (another kernel or tile)."""
    import triton
    from nanovllm.kernels import triton_attn
    decode = _paged_inputs(cfg, context - 1, 1)
    out = {}
    with tile_constants(triton_attn, **(constants or {})):
        for n in splits:
            fn = lambda: triton_attn.paged_attention(**decode, num_splits=n or None)  # noqa: E731
            fn()
            ms = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
            out[str(n or "policy")] = round(cfg["num_hidden_layers"] * ms, 3)
    k = decode["k_cache"]
    floor_ms = cfg["num_hidden_layers"] * 2 * k.numel() * k.element_size() / copy_bandwidth() * 1e3
    return {"constants": constants or {}, "attention_ms_by_splits": out, "attention_floor_ms": round(floor_ms, 3),
            "policy_splits": triton_attn._choose_num_splits(cfg["num_key_value_heads"], context,
                                                            torch.device("cuda"))}


# (BLOCK_N, num_warps, num_stages) of decode tiles; (BLOCK_M, BLOCK_N, num_warps, num_stages) of prefill
DECODE_TILES = [(128, 4, 3), (128, 4, 2), (64, 4, 3), (64, 4, 2), (128, 8, 3), (256, 8, 2)]
PREFILL_TILES = [(128, 32, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                 (128, 128, 8, 3), (256, 64, 8, 3)]
PREFILL_CHUNK = 8192


@contextmanager
def tile_constants(module, **values):
    """The module's tile constants set to `values` inside the block."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _paged_inputs(cfg: dict, cached: int, queries: int, bs: int = 16):
    """One sequence's attention inputs over a shuffled cache of `bs`-token pages."""
    h, kvh, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    context = cached + queries
    blocks = -(-context // bs)
    k = torch.randn(blocks, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    return dict(q=torch.randn(queries, h, d, device="cuda", dtype=torch.bfloat16), k_cache=k,
                v_cache=torch.randn_like(k), cu_seqlens_q=torch.tensor([0, queries], dtype=torch.int32, device="cuda"),
                seq_lens_k=torch.tensor([context], dtype=torch.int32, device="cuda"),
                block_tables=torch.randperm(blocks, device="cuda", dtype=torch.int32).view(1, -1),
                scale=d ** -0.5, max_seqlen_q=queries, max_seqlen_k=context)


def _time_tile(module, inputs: dict, bench, **constants):
    """ms of one `paged_attention` call on `inputs` with the tile constants set, or why it failed."""
    try:
        with tile_constants(module, **constants):
            fn = lambda: module.paged_attention(**inputs)  # noqa: E731
            fn()
            return bench(fn, rep=200, return_mode="median")
    except Exception as e:  # a shape this GPU cannot compile (shared memory): named, not fatal
        return f"failed: {type(e).__name__}"


def tile_sweep(cfg: dict, context: int) -> dict:
    """ms of the decode (all layers) and of one prefill chunk (all layers) per tile shape."""
    import triton
    from nanovllm.kernels import triton_attn
    L = cfg["num_hidden_layers"]
    out = {"decode_ms_by_tile": {}, "prefill_ms_by_tile": {}, "prefill_tflops_by_tile": {}}
    decode = _paged_inputs(cfg, context - 1, 1)
    for block_n, warps, stages in DECODE_TILES:
        ms = _time_tile(triton_attn, decode, triton.testing.do_bench_cudagraph, DECODE_BLOCK_N=block_n,
                        DECODE_NUM_WARPS=warps, DECODE_NUM_STAGES=stages)
        out["decode_ms_by_tile"][f"n{block_n}_w{warps}_s{stages}"] = ms if isinstance(ms, str) else round(L * ms, 3)
    cached = PROMPT_LEN - PREFILL_CHUNK
    prefill = _paged_inputs(cfg, cached, PREFILL_CHUNK)
    # causal: query i of the chunk sees cached + i + 1 keys
    flops = 4 * cfg["num_attention_heads"] * cfg["head_dim"] * (PREFILL_CHUNK * cached
                                                                 + PREFILL_CHUNK * (PREFILL_CHUNK + 1) // 2)
    for block_m, block_n, warps, stages in PREFILL_TILES:
        name = f"m{block_m}_n{block_n}_w{warps}_s{stages}"
        ms = _time_tile(triton_attn, prefill, triton.testing.do_bench, PREFILL_BLOCK_M=block_m,
                        PREFILL_BLOCK_N=block_n, PREFILL_NUM_WARPS=warps, PREFILL_NUM_STAGES=stages)
        out["prefill_ms_by_tile"][name] = ms if isinstance(ms, str) else round(L * ms, 3)
        if not isinstance(ms, str):
            out["prefill_tflops_by_tile"][name] = round(flops / (ms * 1e-3) / 1e12, 1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="32,48,64,96,128,0", help="split factors of the kernel sweep (0: policy)")
    ap.add_argument("--sweep-constants", metavar="JSON", default="[{}]",
                    help="a list of triton_attn constant sets; the split sweep runs once with each, e.g. "
                         "'[{}, {\"DECODE_FMA_16BIT\": true}]'")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kvcache-block-size", type=int, default=None, help="the engine's cache page size")
    ap.add_argument("--tile-sweep", action="store_true", help="also time the attention kernel at other tile shapes")
    ap.add_argument("--profile", action="store_true",
                    help="GPU time by kernel over the decode run, repeated (prefix-cache hit)")
    ap.add_argument("--attn-constants", metavar="JSON", default="{}",
                    help="kernels/triton_attn.py tile constants to set first, e.g. "
                         "'{\"PREFILL_BLOCK_N\": 64}' (an A/B of a tile against the default)")
    args = ap.parse_args()
    set_kernel_constants(json.loads(args.attn_constants))
    cfg = QWEN3_0_6B
    t0 = time.perf_counter()
    kwargs = {} if args.max_num_batched_tokens is None else dict(max_num_batched_tokens=args.max_num_batched_tokens)
    if args.kvcache_block_size is not None:
        kwargs["kvcache_block_size"] = args.kvcache_block_size
    llm = LLM(model_dir(cfg), load_format="dummy", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, **kwargs)
    load_s = time.perf_counter() - t0
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(PROMPT_LEN)] for _ in range(TTFT_PROMPTS + 1)]
    with VariantCounter() as variants:
        ttfts = []
        for prompt in prompts[:TTFT_PROMPTS]:
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            ttfts.append(time.perf_counter() - start)
        start = time.perf_counter()
        llm.generate([prompts[-1]], SamplingParams(max_tokens=DECODE_TOKENS + 1, ignore_eos=True), use_tqdm=False)
        decode_s = time.perf_counter() - start - statistics.median(ttfts)
    floor_s = decode_floor_s(cfg, PROMPT_LEN, DECODE_TOKENS, copy_bandwidth())
    result = {"bench": "long_context", "prompt_len": PROMPT_LEN, "load_s": round(load_s, 2),
              "max_num_batched_tokens": llm.llm_engine.config.max_num_batched_tokens,
              "kvcache_block_size": llm.llm_engine.config.kvcache_block_size,
              "attn_constants": json.loads(args.attn_constants),
              "ttft_s": [round(t, 3) for t in ttfts], "ttft_median_s": round(statistics.median(ttfts), 3),
              "decode_tok_per_s": round(DECODE_TOKENS / decode_s, 1),
              "decode_floor_tok_per_s": round(DECODE_TOKENS / floor_s, 1),
              "decode_floor_fraction": round(floor_s / decode_s, 3),
              "kernel_variants_after_startup": variants.names if variants.available else None}
    print(f"32k prompt: TTFT median {result['ttft_median_s']} s; decode {result['decode_tok_per_s']} tok/s "
          f"({result['decode_floor_fraction']:.0%} of the {result['decode_floor_tok_per_s']} tok/s floor)")
    print(json.dumps(result), flush=True)
    if args.profile:
        profile(llm, [prompts[-1]], SamplingParams(max_tokens=DECODE_TOKENS + 1, ignore_eos=True))
    del llm
    torch.cuda.empty_cache()
    context = PROMPT_LEN + DECODE_TOKENS // 2
    if args.splits:
        for constants in json.loads(args.sweep_constants):
            print(json.dumps(attention_split_sweep(cfg, context, [int(s) for s in args.splits.split(",")],
                                                   constants)), flush=True)
    if args.tile_sweep:
        print(json.dumps(tile_sweep(cfg, context)), flush=True)


if __name__ == "__main__":
    main()
