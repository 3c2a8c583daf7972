"""B5: mixture of experts on one GPU: the fused kernel checked and tuned, then B1's workload
on the Qwen3-30B-A3B configuration.

Four parts, each printing JSON lines (all four by default; one call of the device does them):

- `check`: the fused kernel (kernels/fused_moe.py) in bf16 against the torch path
  (kernels/moe_torch.py) at the real shapes, over random routings, experts that get no
  token and one expert that gets every token; the routing kernel against torch's.
- `sweep`: every candidate tile config at 1 .. 8192 tokens (random routing), timed in CUDA
  graphs; the fastest per size become TILE_CONFIGS for the later parts (printed: the table
  kernels/fused_moe.py holds was set from it).
- `kernel`: the fused kernel alone (route + align + both GEMMs + sum) at batch 1, 16, 64
  and 256 against the bytes it must read: the distinct experts its tokens route to (counted
  from the routing), each 3 * H * I weights, plus the activations.
- `b5`: B1's workload (bench_offline.py) through the public API with dummy bf16 weights:
  48 layers, hidden 2048, 32 heads / 4 KV heads, head_dim 128, 128 experts, top-8,
  moe_intermediate_size 768, vocab 151936. Its memory roofline is B1's (weights once per
  decode step, every context's K/V read each step, K/V written once), with the expert
  weights of a step counted as the distinct experts its tokens touch: with dummy weights the
  routing is near uniform, so a step of n sequences touches E * (1 - (1 - k/E)^n) experts
  per layer in expectation (the `kernel` part prints the count measured against it).

    python benchmarks/bench_moe.py                    # all four, on a GPU
    python benchmarks/bench_moe.py --parts check,kernel
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_offline import WARMUP_PROMPTS, WARMUP_TOKENS, copy_bandwidth, model_dir, workload  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels import fused_moe, moe_torch  # noqa: E402
from nanovllm.kernels.fused_moe import TileConfig  # noqa: E402

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0, rms_norm_eps=1e-6,
    max_position_embeddings=40960, tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu",
    eos_token_id=151645)
H, I, E, K = 2048, 768, 128, 8
CANDIDATES = [TileConfig(bm, bn, bk, g, w, s) for bm, bn, bk, g, w, s in (
    (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 64, 64, 1, 4, 5), (16, 128, 128, 1, 4, 3),
    (32, 64, 128, 8, 4, 4), (32, 128, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (64, 128, 64, 8, 8, 4),
    (128, 128, 64, 8, 8, 3), (64, 256, 64, 8, 8, 3))]
SWEEP_TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
KERNEL_TOKENS = (1, 16, 64, 256)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def moe_inputs(num_tokens: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, H, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * I ** -0.5).bfloat16()
    logits = torch.randn(num_tokens, E, device="cuda", generator=gen)
    return x, w13, w2, logits


# ---- check ---------------------------------------------------------------------------

def check() -> None:
    x, w13, w2, logits = moe_inputs(256)
    weights, ids = fused_moe.route(logits, K, True)
    ref_w, ref_ids = moe_torch.route(logits, K, True)
    emit({"part": "check", "what": "route", "ids_equal": bool(torch.equal(ids.long(), ref_ids)),
          "max_weight_diff": (weights - ref_w).abs().max().item()})
    cases = {"random": ids,
             "half-the-experts-idle": ids % (E // 2),  # ids may repeat within a token: still valid pairs
             "one-expert-takes-all": torch.full_like(ids, 7)}
    for name, case_ids in cases.items():
        for num_tokens in (1, 64, 256):
            args = (x[:num_tokens], w13, w2, weights[:num_tokens], case_ids[:num_tokens])
            ref = moe_torch.fused_experts(*args[:4], args[4].long())
            got = fused_moe.fused_experts(*args)
            rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            emit({"part": "check", "what": "fused_experts", "routing": name, "tokens": num_tokens,
                  "rel_l2_err": round(rel, 5), "ok": rel < 1.5e-2})


# ---- sweep and kernel ------------------------------------------------------------------

def time_ms(fn, reps: int = 20) -> float:
    """GPU time of `fn`, captured in a CUDA graph as decode steps run it (no launch overhead):
    the median of `reps` timed replays after two warm-up calls."""
    fn(), fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); graph.replay(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[2:])[reps // 2]


def must_read_bytes(num_tokens: int, ids: torch.Tensor) -> int:
    """Distinct experts' weights (3 * H * I bf16 each) + x read + output written."""
    distinct = ids.unique().numel()
    return distinct * 3 * H * I * 2 + 2 * num_tokens * H * 2


def sweep() -> None:
    """Time every candidate at each size; set TILE_CONFIGS to the fastest ones (the table the
    later parts run with, printed so that kernels/fused_moe.py can hold it)."""
    x_all, w13, w2, logits = moe_inputs(max(SWEEP_TOKENS))
    weights, ids = fused_moe.route(logits, K, True)
    table = []
    for n in SWEEP_TOKENS:
        results = []
        for cfg in CANDIDATES:
            ms = time_ms(lambda: fused_moe.fused_experts(x_all[:n], w13, w2, weights[:n], ids[:n], config=cfg))
            results.append((ms, cfg))
        best_ms, best = min(results, key=lambda r: r[0])
        old = fused_moe.tile_config(n)
        old_ms = next((ms for ms, cfg in results if cfg == old), None)
        emit({"part": "sweep", "tokens": n, "best_ms": round(best_ms, 4), "best": best.__dict__,
              "old_table_ms": old_ms and round(old_ms, 4), "all_ms": [round(ms, 4) for ms, _ in results]})
        table.append((n if n != SWEEP_TOKENS[-1] else 1 << 62, best))
    fused_moe.TILE_CONFIGS = tuple(table)
    emit({"part": "sweep", "table": [[bound, list(cfg.__dict__.values())] for bound, cfg in table]})


def kernel(bandwidth: float) -> None:
    x_all, w13, w2, logits = moe_inputs(max(KERNEL_TOKENS), seed=1)
    for n in KERNEL_TOKENS:
        x, lg = x_all[:n], logits[:n]

        def step():
            w, i = fused_moe.route(lg, K, True)
            return fused_moe.fused_experts(x, w13, w2, w, i)
        ms = time_ms(step)
        _, ids = fused_moe.route(lg, K, True)
        config = fused_moe.tile_config(n)
        distinct = ids.unique().numel()
        nbytes = must_read_bytes(n, ids)
        emit({"part": "kernel", "tokens": n, "ms": round(ms, 4), "distinct_experts": distinct,
              "expected_distinct": round(E * (1 - (1 - K / E) ** n), 1), "must_read_MB": round(nbytes / 1e6, 1),
              "achieved_TB_per_s": round(nbytes / ms / 1e9, 3),
              "fraction_of_copy_bandwidth": round(nbytes / (ms / 1e3) / bandwidth, 3), "config": config.__dict__})


# ---- B5 ----------------------------------------------------------------------------

def roofline_bytes(cfg: dict, prompts, params, dtype_bytes: int = 2) -> int:
    """B1's decode-only schedule (all sequences start together; step s runs those with
    max_tokens > s): dense weights once a step, the experts its n sequences touch (uniform
    routing: E * (1 - (1 - k/E)^n) per layer), every context's K/V read, new K/V written."""
    h, L, e, k = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    attn = h * (q + 2 * kv) + q * h + 2 * h + 2 * cfg["head_dim"] + e * h  # + norms, q/k norms, router
    dense = (L * attn + h * cfg["vocab_size"] + h) * dtype_bytes  # + the LM head (embedding: a few rows)
    expert = 3 * h * cfg["moe_intermediate_size"] * dtype_bytes
    lengths = sorted(p.max_tokens for p in params)
    total, running = 0, len(lengths)
    for step in range(lengths[-1]):
        while lengths[len(lengths) - running] <= step:
            running -= 1
        total += dense + L * e * (1 - (1 - k / e) ** running) * expert
    kv_per_token = 2 * L * kv * dtype_bytes
    reads = sum(m * len(pr) + m * (m - 1) // 2 for pr, m in zip(prompts, (p.max_tokens for p in params)))
    writes = sum(len(pr) + p.max_tokens for pr, p in zip(prompts, params))
    return int(total) + (reads + writes) * kv_per_token


def b5(bandwidth: float, num_seqs: int) -> None:
    prompts, params = workload(num_seqs, 1024, 1024)
    t0 = time.perf_counter()
    llm = LLM(model_dir(QWEN3_30B_A3B), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              max_num_batched_tokens=16384)
    load_s = time.perf_counter() - t0
    llm.generate(prompts[:WARMUP_PROMPTS], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=WARMUP_TOKENS),
                 use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(p.max_tokens for p in params), "ignore_eos: every request runs to max_tokens"
    floor_s = roofline_bytes(QWEN3_30B_A3B, prompts, params) / bandwidth
    emit({"part": "b5", "bench": "B5", "output_tokens": tokens, "seconds": round(elapsed, 3),
          "tok_per_s": round(tokens / elapsed, 1), "load_s": round(load_s, 1),
          "num_kvcache_blocks": llm.llm_engine.block_manager.num_blocks,
          "roofline_s": round(floor_s, 3), "roofline_tok_per_s": round(tokens / floor_s, 1),
          "roofline_fraction": round(floor_s / elapsed, 3), "device": torch.cuda.get_device_name()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="check,sweep,kernel,b5")
    ap.add_argument("--num-seqs", type=int, default=256)
    args = ap.parse_args()
    parts = args.parts.split(",")
    bandwidth = copy_bandwidth()
    emit({"part": "bandwidth", "copy_TB_per_s": round(bandwidth / 1e12, 3)})
    for name, fn in (("check", check), ("sweep", sweep), ("kernel", lambda: kernel(bandwidth)),
                     ("b5", lambda: b5(bandwidth, args.num_seqs))):
        if name in parts:
            t0 = time.perf_counter()
            fn()
            emit({"part": name, "done_s": round(time.perf_counter() - t0, 1)})


if __name__ == "__main__":
    main()
