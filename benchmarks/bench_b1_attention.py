"""B1's decode attention, replayed: where the paged-attention time of benchmark B1 goes.

B1 (bench_offline.py) spends about three quarters of its GPU time in decode attention.
This script rebuilds the decode batches B1 runs (which sequences are alive at each step,
their context lengths, and block tables allocated by the engine's own BlockManager the
way the engine allocates them: each prompt at once, then a round's slots per round), on
a KV cache as large as B1's (28 layers, most of the GPU), and times the attention of all
layers of sampled steps as CUDA graphs (captured with max_seqlen_k = max_model_len, as
the engine captures). Each sampled step stands for the steps around it; the weighted sum
predicts B1's attention time, to set against the K/V bytes at copy bandwidth.

Variants (`--variants`) change the decode tiles (shape, register cap, cache layout), the split-KV
policy, the V layout of an fp8 cache (FP8_V_KEY_MINOR), the cache layout
(`heads_major`: [blocks, kv_heads, block_size, head_dim] in memory, so one block of one
head is 4 KiB contiguous; the kernels take strides, so the same code reads it through a
permuted view) or the order of the batch (`lpt*`: longest contexts first).

`--kv-cache-dtype` times the same batches over a bf16 cache (`auto`) and/or an fp8 one (e4m3,
per-head scales; its bytes count 1 per element), and `--kernels NAME=FILE,...` times other
copies of kernels/triton_attn.py beside the engine's (an A/B of a kernel change in one run).

    python benchmarks/bench_b1_attention.py [--every 32] [--variants base,n64s4,...] [--shape 8b]
    python benchmarks/bench_b1_attention.py --kv-cache-dtype auto,fp8 --kernels old=/tmp/triton_attn_old.py
"""
import argparse
import importlib.util
import json
import time
from types import ModuleType

import torch
import triton.testing

from bench_offline import copy_bandwidth, kernel_constant, workload
from nanovllm.config import DEFAULT_GPU_SCHEDULER_STEPS
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels import kv_quant
from nanovllm.kernels import triton_attn as engine_kernels

# (layers, query heads, KV heads, head size) of the model whose attention B1 runs (`--shape`)
SHAPES = {"0.6b": (28, 16, 8, 128), "8b": (36, 32, 8, 128)}  # Qwen3-0.6B, Qwen3-8B
NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = SHAPES["0.6b"]
BLOCK_SIZE, MAX_MODEL_LEN, ROUND_STEPS = 16, 4096, DEFAULT_GPU_SCHEDULER_STEPS
REP_MS = 40

# name -> (module constants of triton_attn to set, cache layout)
VARIANTS = {
    "base": ({}, "tokens_major"),
    "heads_major": ({}, "heads_major"),
    "n64s4": (dict(DECODE_BLOCK_N=64, DECODE_NUM_STAGES=4), "tokens_major"),
    "n64s3": (dict(DECODE_BLOCK_N=64, DECODE_NUM_STAGES=3), "tokens_major"),
    "n128s2": (dict(DECODE_BLOCK_N=128, DECODE_NUM_STAGES=2), "tokens_major"),
    "n128s4": (dict(DECODE_BLOCK_N=128, DECODE_NUM_STAGES=4), "tokens_major"),
    "n256s2": (dict(DECODE_BLOCK_N=256, DECODE_NUM_STAGES=2), "tokens_major"),
    "n256s3": (dict(DECODE_BLOCK_N=256, DECODE_NUM_STAGES=3), "tokens_major"),
    "n256w8": (dict(DECODE_BLOCK_N=256, DECODE_NUM_STAGES=2, DECODE_NUM_WARPS=8), "tokens_major"),
    # decode tiles over an fp8 cache (DECODE_FP8_*): fp8 tiles hold half the bytes, and the kernel's
    # throughput followed the bytes in flight per multiprocessor (CTAs x K/V buffers x tile bytes)
    "f8n64s5": (dict(DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=5), "tokens_major"),
    "f8n64s7": (dict(DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=7), "tokens_major"),
    "f8n128s5": (dict(DECODE_FP8_BLOCK_N=128, DECODE_FP8_NUM_STAGES=5), "tokens_major"),
    "f8n64w2s5": (dict(DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_WARPS=2, DECODE_FP8_NUM_STAGES=5), "tokens_major"),
    "f8n32w2s8": (dict(DECODE_FP8_BLOCK_N=32, DECODE_FP8_NUM_WARPS=2, DECODE_FP8_NUM_STAGES=8), "tokens_major"),
    "f8n128w8": (dict(DECODE_FP8_NUM_WARPS=8), "tokens_major"),  # 122 registers: 16 warps a multiprocessor
    "n128w8": (dict(DECODE_NUM_WARPS=8), "tokens_major"),
    # V key-minor within a block (FP8_V_KEY_MINOR; fp8 only), registers capped (*_MAXNREG: 168 fits
    # 3 programs of 4 warps in a multiprocessor, 128 fits 4)
    "f8vkm": (dict(FP8_V_KEY_MINOR=True), "tokens_major"),
    "f8vkm_r168": (dict(FP8_V_KEY_MINOR=True, DECODE_FP8_MAXNREG=168), "tokens_major"),
    "f8vkm64": (dict(FP8_V_KEY_MINOR=True, DECODE_FP8_BLOCK_N=64), "tokens_major"),
    "f8vkm64_r128": (dict(FP8_V_KEY_MINOR=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_MAXNREG=128), "tokens_major"),
    "f8vkm64s2_r128": (dict(FP8_V_KEY_MINOR=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=2,
                            DECODE_FP8_MAXNREG=128), "tokens_major"),
    "f8vkm64_r96": (dict(FP8_V_KEY_MINOR=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_MAXNREG=96), "tokens_major"),
    "f8vkm128w8_r128": (dict(FP8_V_KEY_MINOR=True, DECODE_FP8_NUM_WARPS=8, DECODE_FP8_NUM_STAGES=2,
                             DECODE_FP8_MAXNREG=128), "tokens_major"),
    "f8n64_r128": (dict(DECODE_FP8_BLOCK_N=64, DECODE_FP8_MAXNREG=128), "tokens_major"),
    "n64s2_r128": (dict(DECODE_BLOCK_N=64, DECODE_NUM_STAGES=2, DECODE_MAXNREG=128), "tokens_major"),
    # 5 stages: K/V double-buffered (the pipeliner's async waits leave the next tile in flight), which
    # fits 3 programs a multiprocessor only without V's fp16 staging (key-minor V)
    "f8vkm64s5": (dict(FP8_V_KEY_MINOR=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=5), "tokens_major"),
    "f8vkm64s5_r128": (dict(FP8_V_KEY_MINOR=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=5,
                            DECODE_FP8_MAXNREG=128), "tokens_major"),
    "f8vkm64s7_r128": (dict(FP8_V_KEY_MINOR=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=7,
                            DECODE_FP8_MAXNREG=128), "tokens_major"),  # 3 K/V buffers
    "f8vkm128s5_r168": (dict(FP8_V_KEY_MINOR=True, DECODE_FP8_NUM_STAGES=5, DECODE_FP8_MAXNREG=168),
                        "tokens_major"),
    "f8hm": (dict(FP8_HEADS_MAJOR=True), "tokens_major"),  # through new_kv_cache, so B1 can run it
    "f8hm_vkm64s5": (dict(FP8_HEADS_MAJOR=True, FP8_V_KEY_MINOR=True, DECODE_FP8_BLOCK_N=64,
                          DECODE_FP8_NUM_STAGES=5), "tokens_major"),
    "f8hm_vkm64s5_r128": (dict(FP8_HEADS_MAJOR=True, FP8_V_KEY_MINOR=True, DECODE_FP8_BLOCK_N=64,
                               DECODE_FP8_NUM_STAGES=5, DECODE_FP8_MAXNREG=128), "tokens_major"),
    "n64s3_r128": (dict(DECODE_BLOCK_N=64, DECODE_NUM_STAGES=3, DECODE_MAXNREG=128), "tokens_major"),
    "split4": (dict(TARGET_PROGRAMS_PER_SM=4), "tokens_major"),
    "split8": (dict(TARGET_PROGRAMS_PER_SM=8, MIN_KEYS_PER_SPLIT=512), "tokens_major"),
    "split8_256": (dict(TARGET_PROGRAMS_PER_SM=8), "tokens_major"),
    "split16": (dict(TARGET_PROGRAMS_PER_SM=16, MIN_KEYS_PER_SPLIT=512), "tokens_major"),
    "split16_hm": (dict(TARGET_PROGRAMS_PER_SM=16, MIN_KEYS_PER_SPLIT=512), "heads_major"),
    "n64s4_hm": (dict(DECODE_BLOCK_N=64, DECODE_NUM_STAGES=4), "heads_major"),
    "lpt": ({}, "tokens_major", "longest_first"),
    "nopdl": ({"triton_pdl.ENABLED": False}, "tokens_major"),  # kernels/triton_pdl.py off
    # both products on the fp8 tensor cores (DECODE_FP8_QUERY_QUANT: q and P in e4m3, transposed
    # wgmma tiles, V key-minor), in the engine's fp8 row order (longest first); registers offline
    # (attn_sass.py --kv fp8:mma): 128/4/3 245, 64/4/3 168, 128/8/3 168 (8 warps)
    "f8qq": (dict(DECODE_FP8_QUERY_QUANT=True), "tokens_major", "longest_first"),
    "f8qq_r168": (dict(DECODE_FP8_QUERY_QUANT=True, DECODE_FP8_MAXNREG=168), "tokens_major", "longest_first"),
    "f8qq64": (dict(DECODE_FP8_QUERY_QUANT=True, DECODE_FP8_BLOCK_N=64), "tokens_major", "longest_first"),
    "f8qq64s4_r128": (dict(DECODE_FP8_QUERY_QUANT=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=4,
                           DECODE_FP8_MAXNREG=128), "tokens_major", "longest_first"),
    "f8qq64s6_r128": (dict(DECODE_FP8_QUERY_QUANT=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=6,
                           DECODE_FP8_MAXNREG=128), "tokens_major", "longest_first"),
    "f8qq_w8": (dict(DECODE_FP8_QUERY_QUANT=True, DECODE_FP8_NUM_WARPS=8), "tokens_major", "longest_first"),
    "f8qq_s2": (dict(DECODE_FP8_QUERY_QUANT=True, DECODE_FP8_NUM_STAGES=2), "tokens_major", "longest_first"),
    "f8qq_batch_order": (dict(DECODE_FP8_QUERY_QUANT=True), "tokens_major"),
    # P V alone on the fp8 tensor cores (DECODE_FP8_PV_MMA; V key-minor, S in fp16); registers
    # offline: 128/4/3 255 (spills 8 outside the loop), 64/4/3 167, 64/4/4 capped at 128
    "f8pv": (dict(DECODE_FP8_PV_MMA=True), "tokens_major", "longest_first"),
    "f8pv64": (dict(DECODE_FP8_PV_MMA=True, DECODE_FP8_BLOCK_N=64), "tokens_major", "longest_first"),
    "f8pv64s4_r128": (dict(DECODE_FP8_PV_MMA=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=4,
                           DECODE_FP8_MAXNREG=128), "tokens_major", "longest_first"),
    "f8pv64s6_r128": (dict(DECODE_FP8_PV_MMA=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=6,
                           DECODE_FP8_MAXNREG=128), "tokens_major", "longest_first"),
    "f8pv64s2_r128": (dict(DECODE_FP8_PV_MMA=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=2,
                           DECODE_FP8_MAXNREG=128), "tokens_major", "longest_first"),
    "f8pv64s3_r128": (dict(DECODE_FP8_PV_MMA=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=3,
                           DECODE_FP8_MAXNREG=128), "tokens_major", "longest_first"),
    "f8qq64s2_r128": (dict(DECODE_FP8_QUERY_QUANT=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=2,
                           DECODE_FP8_MAXNREG=128), "tokens_major", "longest_first"),
    "f8qq64s3_r128": (dict(DECODE_FP8_QUERY_QUANT=True, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=3,
                           DECODE_FP8_MAXNREG=128), "tokens_major", "longest_first"),
    "lpt_split4": (dict(TARGET_PROGRAMS_PER_SM=4), "tokens_major", "longest_first"),
    # decode on the CUDA cores (triton_decode_fma: DECODE_FMA_*), fp8 cache (in the engine's fp8 row
    # order) and 16-bit cache; tile = keys x warps x stages, and the split policy's programs per SM
    # (variants named n32 give their 32 keys: the default tile has 16 since the nineteenth session)
    "fma8": (dict(DECODE_FMA_FP8=True), "tokens_major", "longest_first"),
    "fma8_n16w1s4": (dict(DECODE_FMA_FP8=True, DECODE_FMA_BLOCK_N=16, DECODE_FMA_NUM_STAGES=4),
                     "tokens_major", "longest_first"),
    "fma8_n64w1s3": (dict(DECODE_FMA_FP8=True, DECODE_FMA_BLOCK_N=64), "tokens_major", "longest_first"),
    "fma8_n32w2s3": (dict(DECODE_FMA_FP8=True, DECODE_FMA_BLOCK_N=32, DECODE_FMA_NUM_WARPS=2),
                     "tokens_major", "longest_first"),
    "fma8_n64w2s3": (dict(DECODE_FMA_FP8=True, DECODE_FMA_BLOCK_N=64, DECODE_FMA_NUM_WARPS=2),
                     "tokens_major", "longest_first"),
    "fma8_split8": (dict(DECODE_FMA_FP8=True, DECODE_FMA_PROGRAMS_PER_SM=8), "tokens_major", "longest_first"),
    "fma8_split64": (dict(DECODE_FMA_FP8=True, DECODE_FMA_PROGRAMS_PER_SM=64), "tokens_major", "longest_first"),
    "fma8_split32_k256": (dict(DECODE_FMA_FP8=True, MIN_KEYS_PER_SPLIT=256), "tokens_major", "longest_first"),
    "fma8_n32w1s2": (dict(DECODE_FMA_FP8=True, DECODE_FMA_BLOCK_N=32, DECODE_FMA_NUM_STAGES=2),
                     "tokens_major", "longest_first"),
    "fma8_n32w1s4": (dict(DECODE_FMA_FP8=True, DECODE_FMA_BLOCK_N=32, DECODE_FMA_NUM_STAGES=4),
                     "tokens_major", "longest_first"),
    "fma8_n16w1s3": (dict(DECODE_FMA_FP8=True, DECODE_FMA_BLOCK_N=16, DECODE_FMA_NUM_STAGES=3),
                     "tokens_major", "longest_first"),
    # P V summed over keys once at the end (DECODE_FMA_ACC_2D): [BLOCK_N, D] accumulators per head
    "fma8_a2_n16w1s4": (dict(DECODE_FMA_FP8=True, DECODE_FMA_ACC_2D=True, DECODE_FMA_BLOCK_N=16,
                             DECODE_FMA_NUM_STAGES=4), "tokens_major", "longest_first"),
    "fma8_a2_n32w2s3": (dict(DECODE_FMA_FP8=True, DECODE_FMA_ACC_2D=True, DECODE_FMA_BLOCK_N=32,
                             DECODE_FMA_NUM_WARPS=2), "tokens_major", "longest_first"),
    "fma8_a2_n16w2s4": (dict(DECODE_FMA_FP8=True, DECODE_FMA_ACC_2D=True, DECODE_FMA_BLOCK_N=16,
                             DECODE_FMA_NUM_WARPS=2, DECODE_FMA_NUM_STAGES=4), "tokens_major", "longest_first"),
    # P V in fp16 before the fp32 accumulator (DECODE_FMA_PV_FP16: 130 registers, 1,319 instructions a
    # tile against 168 and 1,424, compiled offline for sm_90), register caps (DECODE_FMA_MAXNREG)
    "fma8_pv16": (dict(DECODE_FMA_FP8=True, DECODE_FMA_PV_FP16=True), "tokens_major", "longest_first"),
    "fma8_pv16_r128": (dict(DECODE_FMA_FP8=True, DECODE_FMA_PV_FP16=True, DECODE_FMA_MAXNREG=128),
                       "tokens_major", "longest_first"),
    "fma8_pv16_r96": (dict(DECODE_FMA_FP8=True, DECODE_FMA_PV_FP16=True, DECODE_FMA_MAXNREG=96),
                      "tokens_major", "longest_first"),
    "fma8_r128": (dict(DECODE_FMA_FP8=True, DECODE_FMA_MAXNREG=128), "tokens_major", "longest_first"),
    "fma8_pv32": (dict(DECODE_FMA_FP8=True, DECODE_FMA_PV_FP16=False), "tokens_major", "longest_first"),
    "fma8_pv32_r128": (dict(DECODE_FMA_FP8=True, DECODE_FMA_PV_FP16=False, DECODE_FMA_MAXNREG=128),
                       "tokens_major", "longest_first"),
    "fma8_pv16_split64": (dict(DECODE_FMA_FP8=True, DECODE_FMA_PV_FP16=True, DECODE_FMA_PROGRAMS_PER_SM=64),
                          "tokens_major", "longest_first"),
    "fma16": (dict(DECODE_FMA_16BIT=True), "tokens_major"),
    "fma16_n64w2s3": (dict(DECODE_FMA_16BIT=True, DECODE_FMA_BLOCK_N=64, DECODE_FMA_NUM_WARPS=2), "tokens_major"),
    "fma16_a2_n16w1s4": (dict(DECODE_FMA_16BIT=True, DECODE_FMA_ACC_2D=True, DECODE_FMA_BLOCK_N=16,
                              DECODE_FMA_NUM_STAGES=4), "tokens_major"),
}

# The fp8 tensor-core tile's variants (DECODE_FP8_*, FP8_* layouts) measure that tile: the CUDA-core
# kernel, an fp8 cache's default decode, is off in them ("lpt" and "fma8*" are the engine's default).
for _constants, *_ in VARIANTS.values():
    if any(k.startswith(("DECODE_FP8_", "FP8_")) for k in _constants):
        _constants.setdefault("DECODE_FMA_FP8", False)
VARIANTS["f8mma"] = (dict(DECODE_FMA_FP8=False), "tokens_major", "longest_first")  # the tensor-core tile
# the same before DECODE_FP8_OPAQUE_V_CAST (the added zero, no register cap)
VARIANTS["f8mma_zero"] = (dict(DECODE_FMA_FP8=False, DECODE_FP8_OPAQUE_V_CAST=False, DECODE_FP8_MAXNREG=None),
                          "tokens_major", "longest_first")
# the tile's fp8 tensor-core options: q rounded to e4m3 for both products, or only P V in fp8
VARIANTS["f8qq"] = (dict(DECODE_FMA_FP8=False, DECODE_FP8_QUERY_QUANT=True), "tokens_major", "longest_first")
VARIANTS["f8pv"] = (dict(DECODE_FMA_FP8=False, DECODE_FP8_PV_MMA=True), "tokens_major", "longest_first")
VARIANTS["f8mma_opaque_k"] = (dict(DECODE_FMA_FP8=False, DECODE_FP8_OPAQUE_K_CAST=True), "tokens_major", "longest_first")


def b1_steps(every: int) -> tuple[list[tuple[int, list[list[int]], list[int]]], int]:
    """(weight, block tables, context lengths) of every `every`-th decode step of B1, and
    the number of KV blocks those tables reach."""
    prompts, params = workload(256, 1024, 1024)
    bm = BlockManager(1 << 20, BLOCK_SIZE, enable_prefix_caching=False)
    seqs = [Sequence(p, block_size=BLOCK_SIZE) for p in prompts]
    max_tokens = [p.max_tokens for p in params]
    for seq in seqs:
        assert bm.allocate_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1  # the prompt is in the cache; its last token decodes
    samples, top = [], 0
    for step in range(max(max_tokens)):
        alive = [(s, m) for s, m in zip(seqs, max_tokens) if m > step and s.block_table]
        if step % ROUND_STEPS == 0:
            for seq, _ in alive:
                assert bm.allocate_slots(seq, ROUND_STEPS)
            top = max(top, max(b for s, _ in alive for b in s.block_table) + 1)
        if step % every == 0:
            samples.append((every, [list(s.block_table) for s, _ in alive],
                            [s.num_computed_tokens + 1 for s, _ in alive]))
        for seq, m in alive:
            seq.num_computed_tokens += 1
            if step + 1 == m:
                bm.free(seq)
    return samples, top


def kv_caches(num_blocks: int, layout: str, dtype: torch.dtype,
              ta: ModuleType = engine_kernels) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if layout == "tokens_major" and hasattr(ta, "new_kv_cache"):  # the engine's own layout (FP8_V_KEY_MINOR)
        return [ta.new_kv_cache(shape, dtype, torch.device("cuda")) for _ in range(NUM_LAYERS)]
    caches = []
    for _ in range(NUM_LAYERS):
        pair = []
        for _ in range(2):
            if layout == "heads_major":
                t = torch.empty(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=dtype,
                                device="cuda").permute(0, 2, 1, 3)
            else:
                t = torch.empty(shape, dtype=dtype, device="cuda")
            pair.append(t)
        caches.append(tuple(pair))
    return caches


def load_kernels(name: str, path: str) -> ModuleType:
    """Another copy of kernels/triton_attn.py, imported from `path` under its own name."""
    spec = importlib.util.spec_from_file_location(f"bench_kernels_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_step(tables: list[list[int]], ctx: list[int], caches, ta: ModuleType) -> float:
    """Seconds for the attention of every layer of one decode step (CUDA-graph replay)."""
    n = len(ctx)
    width = max(len(t) for t in tables)
    bt = torch.zeros(n, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    bt, seq_lens = bt.cuda(), torch.tensor(ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(n, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    scales = {}
    if kv_quant.is_fp8(caches[0][0].dtype):  # per-head scales, as the engine's
        scales = dict(k_scale=torch.full((NUM_KV_HEADS,), 0.02, device="cuda"),
                      v_scale=torch.full((NUM_KV_HEADS,), 0.01, device="cuda"))

    def step():
        for k_cache, v_cache in caches:
            ta.paged_attention(q, k_cache, v_cache, cu, seq_lens, bt, HEAD_DIM ** -0.5, max_seqlen_q=1,
                               max_seqlen_k=MAX_MODEL_LEN, out=out, **scales)
    step()
    return triton.testing.do_bench_cudagraph(step, rep=REP_MS) / 1e3


def _target(ta: ModuleType, key: str) -> tuple[ModuleType, str]:
    """(module, name) a variant's constant `key` sets: `ta`'s (the engine's triton_attn or a copy
    of it), or "module.NAME" of another kernels module (bench_offline.kernel_constant)."""
    return kernel_constant(key) if "." in key else (ta, key)


def run_variant(name: str, samples, num_blocks: int, bandwidth: float, dtype: torch.dtype = torch.bfloat16,
                ta: ModuleType = engine_kernels) -> dict:
    constants, layout, *order = VARIANTS[name]
    saved = {k: getattr(*_target(ta, k)) for k in constants}
    for k, v in constants.items():
        setattr(*_target(ta, k), v)
    try:
        caches = kv_caches(num_blocks, layout, dtype, ta)
        total_s, total_bytes, by_batch = 0.0, 0, {}
        for weight, tables, ctx in samples:
            if order:  # the batch's sequences longest first
                rows = sorted(range(len(ctx)), key=lambda i: -ctx[i])
                tables, ctx = [tables[i] for i in rows], [ctx[i] for i in rows]
            seconds = time_step(tables, ctx, caches, ta)
            nbytes = sum(ctx) * NUM_KV_HEADS * HEAD_DIM * 2 * dtype.itemsize * NUM_LAYERS
            total_s += weight * seconds
            total_bytes += weight * nbytes
            bucket = 1 << (len(ctx) - 1).bit_length()
            acc = by_batch.setdefault(bucket, [0.0, 0])
            acc[0] += weight * seconds
            acc[1] += weight * nbytes
        del caches
        torch.cuda.empty_cache()
    finally:
        for k, v in saved.items():
            setattr(*_target(ta, k), v)
    return {"variant": name, "kv_cache_dtype": str(dtype).removeprefix("torch."), "attention_s": round(total_s, 3),
            "fraction_of_copy_bw": round(total_bytes / bandwidth / total_s, 3),
            "by_batch": {b: [round(s, 3), round(nb / bandwidth / s, 3)] for b, (s, nb) in sorted(by_batch.items())}}


def print_best(log: str, kv_cache_dtype: str) -> None:
    """The constants of the fastest engine-kernel variant in a log of this script (JSON lines)."""
    dtype = str(kv_quant.resolve_kv_cache_dtype(kv_cache_dtype, torch.bfloat16)).removeprefix("torch.")
    with open(log) as f:
        rows = [json.loads(line) for line in f if line.startswith("{")]
    rows = [r for r in rows if r["kernels"] == "engine" and r["kv_cache_dtype"] == dtype]
    best = min(rows, key=lambda r: r["attention_s"])
    print(json.dumps(VARIANTS[best["variant"]][0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=int, default=32, help="sample every N-th decode step")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--shape", choices=SHAPES, default="0.6b", help="the model's attention shape (Qwen3 size)")
    ap.add_argument("--extra-variants", metavar="JSON", default="{}",
                    help='more variants: {"name": {triton_attn constant: value, ...}, ...} (the engine\'s '
                         'layout, longest contexts first); name them in --variants')
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks per layer (default: what 85%% of free GPU memory holds, as B1's engine)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="comma list of the engine's kv_cache_dtype values: auto (bf16), fp8, fp8_e5m2, ...")
    ap.add_argument("--kernels", default="",
                    help="comma list of NAME=FILE: copies of kernels/triton_attn.py timed beside the engine's")
    ap.add_argument("--best", metavar="LOG",
                    help="print the triton_attn constants (JSON) of the variant with the least attention "
                         "time among LOG's results for --kv-cache-dtype, then exit")
    args = ap.parse_args()
    for name, constants in json.loads(args.extra_variants).items():
        VARIANTS[name] = (constants, "tokens_major", "longest_first")
    if args.best:  # (give --extra-variants too where the log has some)
        return print_best(args.best, args.kv_cache_dtype)
    global NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = SHAPES[args.shape]
    t0 = time.perf_counter()
    samples, top = b1_steps(args.every)
    bandwidth = copy_bandwidth()
    kernels = {"engine": engine_kernels}
    kernels.update((name, load_kernels(name, path)) for name, path in
                   (item.split("=", 1) for item in args.kernels.split(",") if item))
    print(f"{len(samples)} sampled steps; tables reach block {top}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s ({time.perf_counter() - t0:.0f} s to set up)")
    for dtype_name in args.kv_cache_dtype.split(","):
        dtype = kv_quant.resolve_kv_cache_dtype(dtype_name, torch.bfloat16)
        free, _ = torch.cuda.mem_get_info()
        per_block = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
        num_blocks = args.num_blocks or int(free * 0.85 // per_block)
        assert num_blocks >= top, f"the cache must hold the {top} blocks B1's tables reach"
        for kernel_name, ta in kernels.items():
            for name in args.variants.split(","):
                try:
                    result = run_variant(name, samples, num_blocks, bandwidth, dtype, ta)
                except Exception as e:  # a variant that fails to compile or launch: the others still run
                    print(f"variant {name} ({kernel_name}, {dtype}) failed: {type(e).__name__}: {e}", flush=True)
                    continue
                print(json.dumps({"kernels": kernel_name, "cache_blocks": num_blocks, **result}), flush=True)


if __name__ == "__main__":
    main()
