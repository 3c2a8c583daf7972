"""FP8 on the GPU: the fp8 linear products, B1 with an fp8 KV cache, and B1 on the
Qwen3-8B shape with fp8 weights + fp8 KV against bf16, with the rooflines for the bytes
each configuration moves and the KV capacity (tokens) each engine got.

    python benchmarks/bench_fp8.py gemm            # _scaled_mm rowwise / block-wise vs bf16 (errors; host-bound times)
    python benchmarks/bench_fp8.py b1              # B1 (Qwen3-0.6B shape): bf16 KV, then fp8 KV
    python benchmarks/bench_fp8.py b1-fp8          # B1 with the fp8 KV cache only
    python benchmarks/bench_fp8.py b1-8b           # Qwen3-8B shape: bf16, then fp8 weights + fp8 KV
    python benchmarks/bench_fp8.py b1-8b --profile # each B1 then run again under torch.profiler: GPU time by kernel
    python benchmarks/bench_fp8.py b1-8b-fp8       # Qwen3-8B shape, fp8 weights + fp8 KV only
    python benchmarks/bench_fp8.py b1-8b --prefill-split  # also B1's prefills alone (fresh prompts, 1 token)

B1 runs as bench_offline.py's: dummy weights, 256 prompts (seed 0), an untimed warm-up on
other prompts (seed 1, so the timed prompts are fresh for the prefix cache) after each
engine's own start-up, then one timed generate. Each configuration's roofline counts the
bytes a decode-only schedule must move at its own element sizes: linear weights at 1 byte
with fp8 weights (embeddings, LM head and norms stay bf16), K/V at 1 byte with an fp8 cache.
Prints one JSON line per result. `gemm`'s times synchronize after each call: at decode sizes
they time the host's launch, not the GPU (benchmarks/bench_batch_gemm.py times the products
from CUDA graphs); its errors against the fp32 product are what it is for.
"""
import argparse
import gc
import json
import os
import sys
import time
from random import randint, seed

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_offline import QWEN3_0_6B, copy_bandwidth, model_dir, profile, set_kernel_constants, workload  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402

QWEN3_8B = dict(QWEN3_0_6B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
WARMUP_PROMPTS, WARMUP_TOKENS = 32, 40
# (tokens, in, out): the Qwen3-8B layer's products at B1's 256 rows, and one row
GEMM_SHAPES = [(256, 4096, 4096 + 2 * 1024), (256, 4096, 4096), (256, 4096, 2 * 12288), (256, 12288, 4096),
               (1, 4096, 12288)]


def timed_cuda(fn, iters: int = 50) -> float:
    """Median seconds of one call (CUDA events) after warm-up."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def gemm() -> None:
    from nanovllm.layers.quantization import fp8
    for m, k, n in GEMM_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = fp8.quantize_rows(w)
        ws = ws.reshape(1, -1).contiguous()
        bf16_s = timed_cuda(lambda: x @ w.t())
        def fp8_mm():
            xq, xs = fp8.quantize_rows(x)
            return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16,
                                    use_fast_accum=fp8.FAST_ACCUM)
        xq, xs = fp8.quantize_rows(x)
        mm_s = timed_cuda(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16))
        full_s = timed_cuda(fp8_mm)
        quant_s = timed_cuda(lambda: fp8.quantize_rows(x))
        exact = x.float() @ w.float().t()
        rel = ((fp8_mm().float() - exact).norm() / exact.norm()).item()
        slow = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, use_fast_accum=False)
        slow_rel = ((slow.float() - exact).norm() / exact.norm()).item()
        floor_s = (n * k + m * k * 2 + m * n * 2) / 4.3e12  # fp8 weight + bf16 in/out at copy bandwidth
        print(json.dumps(dict(bench="fp8_gemm", shape=[m, k, n], bf16_us=round(bf16_s * 1e6, 1),
                              scaled_mm_us=round(mm_s * 1e6, 1), quant_us=round(quant_s * 1e6, 1),
                              fp8_total_us=round(full_s * 1e6, 1), fp8_floor_us=round(floor_s * 1e6, 1),
                              rel_err_vs_fp32=round(rel, 5), without_fast_accum_rel_err=round(slow_rel, 5))))
    # Does this torch's _scaled_mm take block-wise scales (1x128 activations, 128x128 weights)?
    m, k, n = 256, 4096, 4096
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(m, k // 128, device="cuda")
    sb = torch.ones(n // 128, k // 128, device="cuda")
    for name, scales in {"a[M,K/128] b[N/128,K/128]": (sa, sb),
                         "a[M,K/128] b[K/128,N/128]": (sa, sb.t().contiguous()),
                         "a^T-major": (sa.t().contiguous().t(), sb.t().contiguous().t())}.items():
        try:
            y = torch._scaled_mm(a, b.t(), scale_a=scales[0], scale_b=scales[1], out_dtype=torch.bfloat16)
            ok = torch.allclose(y.float(), a.float() @ b.float().t(), rtol=2e-2, atol=1.0)
            print(json.dumps(dict(bench="scaled_mm_blockwise", layout=name, ran=True, correct=bool(ok))))
        except Exception as e:  # noqa: BLE001  (the probe reports whatever torch says)
            print(json.dumps(dict(bench="scaled_mm_blockwise", layout=name, ran=False, error=str(e)[:300])))


def roofline_bytes(cfg: dict, prompts, params, weight_bytes: int, kv_bytes: int) -> int:
    """bench_offline.roofline_bytes with linear weights and K/V at their own element sizes."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    linear = L * (h * (q + 2 * kv) + q * h + 3 * h * i)
    # norms and the LM head, read every step (an untied embedding is only gathered: not counted)
    other = L * (2 * h + 2 * cfg["head_dim"]) + h * cfg["vocab_size"] + h
    weights = linear * weight_bytes + other * 2
    steps = max(p.max_tokens for p in params)
    reads = sum(m * len(pr) + m * (m - 1) // 2 for pr, m in zip(prompts, (p.max_tokens for p in params)))
    writes = sum(len(pr) + p.max_tokens for pr, p in zip(prompts, params))
    return steps * weights + (reads + writes) * 2 * L * kv * kv_bytes


def prefill_seconds(llm, prompts) -> float:
    """Seconds to prefill prompts of B1's lengths with fresh token ids (no prefix-cache hit), one
    output token each: the share of a B1 run that is prefill, since B1 prefills every prompt once."""
    seed(2)
    fresh = [[randint(10001, 20000) for _ in p] for p in prompts]
    t0 = time.perf_counter()
    llm.generate(fresh, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t0


def run_b1(cfg: dict, name: str, bandwidth: float, profiled: bool = False, prefill_split: bool = False,
           **engine) -> dict:
    prompts, params = workload(256, 1024, 1024)
    seed(1)  # fresh prompts for the warm-up: the timed ones must not hit the prefix cache
    warm_prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(WARMUP_PROMPTS)]
    t0 = time.perf_counter()
    llm = LLM(model_dir(cfg), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              max_num_batched_tokens=16384, **engine)
    start_s = time.perf_counter() - t0
    llm.generate(warm_prompts, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=WARMUP_TOKENS),
                 use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    runner = llm.llm_engine.model_runner
    fp8_weights = engine.get("quantization") == "fp8"
    kv_bytes = runner.kv_cache_dtype.itemsize
    floor_s = roofline_bytes(cfg, prompts, params, 1 if fp8_weights else 2, kv_bytes) / bandwidth
    result = dict(bench="B1-fp8", config=name, output_tokens=tokens, seconds=round(elapsed, 3),
                  tok_per_s=round(tokens / elapsed, 1), start_s=round(start_s, 1),
                  roofline_s=round(floor_s, 3), roofline_tok_per_s=round(tokens / floor_s, 1),
                  roofline_fraction=round(floor_s / elapsed, 3), kv_cache_dtype=str(runner.kv_cache_dtype),
                  kv_blocks=runner.num_kvcache_blocks, kv_tokens=runner.num_kvcache_blocks * runner.block_size,
                  gpu_memory_utilization=0.9, device=torch.cuda.get_device_name())
    if prefill_split:
        result["prefill_s"] = round(prefill_seconds(llm, prompts), 3)
        result["decode_s"] = round(elapsed - result["prefill_s"], 3)
    print(json.dumps(result), flush=True)
    if profiled:  # the same prompts again: their prefills are prefix-cache hits, the decodes as timed
        profile(llm, prompts, params)
    del llm, runner, outs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["gemm", "b1", "b1-fp8", "b1-8b", "b1-8b-fp8"])
    ap.add_argument("--profile", action="store_true", help="GPU time by kernel of each B1, run again")
    ap.add_argument("--prefill-split", action="store_true",
                    help="also time B1's prefills alone (fresh prompts of the same lengths, one token each)")
    ap.add_argument("--attn-constants", metavar="JSON", default="{}",
                    help="kernel module constants to set first, as bench_offline.py's option")
    args = ap.parse_args()
    set_kernel_constants(json.loads(args.attn_constants))
    part, profiled = args.part, args.profile
    split = dict(prefill_split=args.prefill_split)
    if part == "gemm":
        return gemm()
    bandwidth = copy_bandwidth()
    print(json.dumps(dict(bench="copy_bandwidth", tb_per_s=round(bandwidth / 1e12, 3))), flush=True)
    if part in ("b1", "b1-fp8"):
        if part == "b1":
            run_b1(QWEN3_0_6B, "qwen3-0.6b bf16 kv", bandwidth, profiled, **split)
        run_b1(QWEN3_0_6B, "qwen3-0.6b fp8 kv", bandwidth, profiled, kv_cache_dtype="fp8", **split)
    elif part == "b1-8b-fp8":
        run_b1(QWEN3_8B, "qwen3-8b fp8 weights + fp8 kv", bandwidth, profiled, quantization="fp8", kv_cache_dtype="fp8",
               **split)
    elif part == "b1-8b":
        bf16 = run_b1(QWEN3_8B, "qwen3-8b bf16", bandwidth, profiled, **split)
        fp8 = run_b1(QWEN3_8B, "qwen3-8b fp8 weights + fp8 kv", bandwidth, profiled, quantization="fp8",
                     kv_cache_dtype="fp8", **split)
        print(json.dumps(dict(bench="B1-8b-speedup", speedup=round(fp8["tok_per_s"] / bf16["tok_per_s"], 3))))


if __name__ == "__main__":
    main()
