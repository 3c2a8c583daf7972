"""Triton kernels of the GPU path: store-KV and one unified paged-attention kernel.

Same functions, arguments and semantics as `kernels/torch_ref.py` (the oracle):

- `store_kvcache` writes this step's keys and values into the paged cache
  `[num_blocks, block_size, num_kv_heads, head_dim]` through `slot_mapping`
  (slot -1 is skipped).
- `paged_attention` serves, in one launch, any mix of prefill chunks over a cached
  prefix and single-token decodes. The queries of sequence `b` are the last `q_len`
  positions of its `seq_len_k` context and attend causally.

How the attention kernel is laid out (the design vLLM's `triton_unified_attention`
and SGLang's split-KV decode describe, written anew here):

- One program owns a tile of `BLOCK_Q` consecutive query tokens of one sequence times
  all the query heads that share one KV head (GQA packing): `BLOCK_M = BLOCK_Q *
  QPK_PAD` rows. Every K/V tile is loaded once for the whole group, which is what
  makes decode read the cache once per KV head.
- Keys are gathered token by token through the block table (`slot = block_table[pos
  // block_size] * block_size + pos % block_size`), so a KV tile may span several
  cache blocks and any block size works.
- Online softmax in base 2, fp32 accumulators. KV tiles wholly visible to every row of
  the query tile run without masks; only the tiles on the causal diagonal are masked.
- Split-KV (flash-decoding): with few sequences and long contexts, `num_splits`
  programs share one (query tile, KV head) and each covers a segment of the context;
  a second kernel combines the partial results by log-sum-exp.

FP8 KV cache (`kernels/kv_quant.py`): with an fp8 cache both kernels take per-KV-head
float32 scales `k_scale` / `v_scale` (`[num_kv_heads]`). The store quantizes as it
writes (`fp8(clamp(x / scale))`); attention converts each K/V tile as it reads it and
folds the scales in where they cost nothing: a program serves one KV head, so `k_scale`
multiplies the softmax scale and `v_scale` the finished output. The products run in
fp16 for 16-bit queries (fp32 for fp32 ones): e4m3 and e5m2 values are exact in fp16
(one conversion instruction per two values; to bf16 it takes two more), and the
probabilities keep 3 more bits than in bf16; the queries are converted once per program.
In decode tiles (mma.sync) the V tile is converted in the layout it was loaded in, and only
then rearranged for the product: left alone, Triton moves that rearrangement ahead of the conversion, onto the
8-bit values, which cannot be read transposed from shared memory and were read one byte
at a time (128 byte loads per thread and tile; the fp8 kernel ran slower than bf16's).
On NVIDIA GPUs the converted V passes through an identity the compiler cannot see through
(`_opaque_identity`, DECODE_FP8_OPAQUE_V_CAST), which also keeps Triton from sizing the
products' operand fragments for 8-bit values (its `kWidth`, read from how the operands were
loaded): with 16-bit fragments q is read from shared memory without register moves and P
reaches the P V product without a pass through shared memory. Elsewhere (Triton's
interpreter) a zero the compiler cannot prove is zero is added instead.
Variants: `KV_FP8` (from the cache dtype) doubles each kernel's constexpr set, nothing
else; e4m3 and e5m2 caches are separate compilations through the pointer dtype.

Nothing in `paged_attention` reads device memory from the host: the grid comes from
tensor shapes and host-known keyword arguments, so a decode batch can be captured in a
CUDA graph. Head sizes that are not a power of two are padded and masked.

Decode-only batches over an fp8 cache run `triton_decode_fma` (the products on the CUDA
cores, no shared-memory staging: DECODE_FMA_*), which read B1's fp8 cache faster than the
tensor-core decode tile below; 16-bit caches keep the tile. With DECODE_MMA_FP8 / DECODE_MMA_16BIT
(off until timed on a GPU) decode-only batches run `gluon_decode_mma` instead (tensor cores, K and V
loaded straight into the products' register fragments).

Decode-tile options, all off by default (each replayed slower than the default tile over
B1's decode batches on an H200, or within 1% of it: benchmarks/RESULTS.md "Ninth session"),
kept as module constants so benchmarks can set them: `DECODE_*_MAXNREG` (a register cap),
and for an fp8 cache `new_kv_cache`'s layouts, `FP8_HEADS_MAJOR` and `FP8_V_KEY_MINOR` (V's
block rows adjacent per dimension, so the decode tile feeds V to the tensor cores from the fp8
bytes as it does K); the kernels read every layout through strides (V's dimension stride
included, `V_KEY_MINOR` from it). Over an e4m3 cache, `DECODE_FP8_QUERY_QUANT` runs both
decode products on the fp8 tensor cores (q and P rounded to e4m3, transposed wgmma tiles) and
`DECODE_FP8_PV_MMA` P V alone; `kernels/query_quant_ref.py` is their rounding in torch. With
either on, the e4m3 decode tiles are that option's (constexpr `FP8_MMA` / `PV_MMA`) instead of
the plain ones: the count of compiled variants below stays the same.

Compiled variants (all met while the engine starts: engine/warmup.py): per model (head
counts, head size, block size, dtype, cache dtype: an fp8 cache has its own decode tile,
DECODE_FP8_*; the prefill tile PREFILL_* or, with PREFILL_LARGE_TILE, PREFILL_LARGE_* for a
16-bit cache on Hopper or later) the attention kernel has 4, decode or prefill tiles times split or not
(`IS_SPLIT`; the split count itself is a run-time argument), the combine kernel 1, the
store kernel 1; an fp8 cache's decodes are `triton_decode_fma`'s 2 (split or not) instead, or with
DECODE_MMA_* on `gluon_decode_mma`'s 2 (the same rules: its run-time ints are `do_not_specialize`). With
DECODE_FUSED_ROPE (set before an engine starts) the decode tiles are its ROPE ones, as many.
The cache layout is fixed when the cache is allocated, so the strides Triton specializes on (a unit stride) are the same for every launch. The block-table width
and the split workspace strides vary at run time and are `do_not_specialize`.
"""
import functools

import torch
import triton
import triton.language as tl

from nanovllm.kernels import gluon_decode_mma, kv_quant, triton_decode_fma, triton_prefill_tma
from nanovllm.kernels.fused_ops import DecodeRope
from nanovllm.kernels.triton_kv_write import load_cos_sin, quantize_fp8, rope_q_rows, rope_store_new_kv
from nanovllm.kernels.triton_paged_tiles import (FP16_MAX, LOG2E, RUN_TIME_ARGS, RUNNING_MAX_INIT, load_kv_tile,
                                                 load_q_tile, split_of_last_key, split_tile_range, store_rows)
from nanovllm.kernels.triton_pdl import launch_dependents, launch_options, wait_for_prior_grid

MIN_DOT_DIM = 16            # tl.dot needs every dimension of its tiles to be >= 16
WGMMA_MIN_M = tl.constexpr(64)  # Hopper's wgmma (operands from shared memory) needs >= 64 rows


# ----------------------------------------------------------------------------- tiles
# Tile shapes. Prefill tiles are large in M (queries x grouped heads) to feed the
# matrix units; decode tiles hold one query token per sequence, so M is only the
# group of query heads (padded to the 16 rows tl.dot needs). The values were chosen
# by measurement on an H200 (`benchmarks/bench_kernels.py --tune`; NOTES_kernels.md).
PREFILL_BLOCK_M = 128   # rows of a prefill tile: query tokens x heads of one group
PREFILL_BLOCK_N = 32    # keys per KV tile in prefill
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 4  # K/V tiles in flight (software pipelining)
# A larger prefill tile for 16-bit caches on Hopper and later (wgmma; ~160 KB of shared
# memory, more than GPUs before Hopper have for one program): one 32k-token prompt's TTFT
# 0.391 s against 0.434 with the tile above, B1 within 0.5% (24,739 against 24,860 tok/s), on
# an H200 (bench_long_context.py / bench_offline.py --attn-constants, RESULTS.md "Tenth
# session"). Its other rounding flips a different near-tie of a tiny Mixtral's top-2 routing
# than the tile above does (the tokens where either tile's expert set differs from HF fp32's
# had router gaps of 0.003-0.078; RESULTS.md "Eleventh session"). fp8 caches and fp32 queries
# keep the tile above; `PREFILL_LARGE_TILE = False` gives it everywhere.
PREFILL_LARGE_TILE = True
PREFILL_LARGE_BLOCK_M = 256
PREFILL_LARGE_BLOCK_N = 64
PREFILL_LARGE_NUM_WARPS = 8
PREFILL_LARGE_NUM_STAGES = 3
PREFILL_LARGE_MIN_CAPABILITY = (9, 0)
DECODE_BLOCK_N = 128    # keys per KV tile in decode
DECODE_NUM_WARPS = 4
# 2, not 3: B1's decode attention replayed took 3.73 s against 3.86 in two device calls, and
# B1 ran at 25,040 tok/s against 24,256 in one call (RESULTS.md "FP8 KV at B1");
# one 32k-token decode 1.170 ms against 1.202 ("GPU round 2")
DECODE_NUM_STAGES = 2
# Decode tiles over an fp8 cache, tuned apart (RESULTS.md "FP8 KV at B1"): 128/4/3 replayed
# fastest of 11 shapes (2 stages: 3.52 s against 3.24; 64- and 256-key tiles, 2 warps
# and 5-8 stages slower)
DECODE_FP8_BLOCK_N = 128
DECODE_FP8_NUM_WARPS = 4
DECODE_FP8_NUM_STAGES = 3
# Registers per thread the decode tiles may use (None: ptxas's choice); below it ptxas spills.
# With 128-thread programs, 168 registers fit 3 programs in a multiprocessor, 128 fit 4.
DECODE_MAXNREG = None
DECODE_FP8_MAXNREG = None
# The fp8 tile's cap where its V goes through DECODE_FP8_OPAQUE_V_CAST's identity (202 registers
# uncapped: 2 programs a multiprocessor instead of 3), as measured together below; DECODE_FP8_MAXNREG,
# where set, takes precedence.
DECODE_FP8_OPAQUE_MAXNREG = 168
# The fp8 decode tile's converted V behind an identity Triton cannot see through (module
# docstring), on NVIDIA GPUs. Offline (sm_90, Qwen3-8B's groups of 4 query heads) a 128-key tile's
# main loop went from 908 to 697 instructions a thread (no HADD2, 216 register moves -> 73); on
# an H200, B1 on the Qwen3-8B shape with fp8 weights and KV ran at 13,376.9 tok/s with it (and
# DECODE_FP8_OPAQUE_MAXNREG) against 12,996.7 without, in one call (RESULTS.md "Sixteenth session").
DECODE_FP8_OPAQUE_V_CAST = True
# The same for the converted K (its product's fragments then 16-bit too), where V's is on. Off, not
# yet timed: offline 680 instructions a tile against 697, but K's fp16 copy goes through shared
# memory (143.5 KB read and 104 KB written a tile against 106 / 71.5).
DECODE_FP8_OPAQUE_K_CAST = False
# An fp8 cache's V laid out key-minor within each block (`new_kv_cache`): the decode tile then
# feeds V to the tensor cores from the fp8 bytes as it does K (8-bit values along the product's
# reduction axis are contiguous), with no fp16 copy of the tile through shared memory.
FP8_V_KEY_MINOR = False
# An fp8 cache laid out heads-major ([blocks, kv_heads, block_size, head_dim] in memory): one
# block of one KV head is block_size * head_dim contiguous bytes (2 KiB), not rows of 128 bytes
# a KV head's width apart.
FP8_HEADS_MAJOR = False
# Decode tiles over an e4m3 cache with 16-bit queries run both products on the fp8 tensor cores
# (vLLM's query quantization, as its FlashAttention-3 path does with an fp8 cache): each query
# row is quantized to e4m3 with its own scale (its amax / FP8_E4M3_MAX, once per program);
# S^T = K q^T from the fp8 bytes of K, softmax in fp32, P^T * P_FP8_SCALE quantized to e4m3,
# O^T += V^T P^T from the fp8 bytes of V; the scales are folded into the fp32 accumulators and
# no K or V value is converted. Written transposed so that the keys (and head_dim) are the
# products' M >= 64 rows: Hopper's wgmma, operands straight from shared memory (a 16-row
# mma.sync over fp8 operands is lowered by Triton 3.6 to fp16 mma plus conversions). fp8
# wgmma needs both operands contiguous along the reduction axis, so `new_kv_cache` then lays
# V key-minor; the kernel is correct over either V layout. Off: B1's decode attention replayed
# on an H200 in 3.909 s against 3.079 with the fp16 products (245 registers: 2 programs a
# multiprocessor, its warps waiting on DRAM), 3.323 at 64-key tiles capped at 128 registers
# (RESULTS.md "Tenth session"); it also moves teacher-forced logprobs more (mean 0.083 vs 0.070).
DECODE_FP8_QUERY_QUANT = False
FP8_E4M3_MAX = tl.constexpr(448.0)
# P (in [0, 1] after the running max) times 2**8 before rounding to e4m3: 1.0 maps to 256
# (exact, a power of two), and probabilities down to 2**-14 stay normal numbers in e4m3
P_FP8_SCALE = tl.constexpr(256.0)
# The same decode tile with only P V on the fp8 tensor cores: P * P_FP8_SCALE rounded to e4m3,
# O^T += V^T P^T from the fp8 bytes of V (key-minor), S = q K^T in fp16 as without either
# option: no fp16 copy of V, q not rounded. Off: replayed 1.7-32% slower than the fp16 products
# over B1's decode batches (its best, 64-key tiles at 128 registers and 2 stages: 3.151 s against
# 3.098; RESULTS.md "Tenth session"). DECODE_FP8_QUERY_QUANT takes precedence where both are on.
DECODE_FP8_PV_MMA = False
# Decode-only batches on the CUDA cores instead (`triton_decode_fma`: no tensor cores, no
# shared-memory staging of K/V), per cache kind, with that kernel's tile and split target.
# On for an fp8 cache: B1's decode attention replayed in 2.836 s (0.619 of copy bandwidth)
# against the tensor-core tile's 3.092 (0.567), and B1 ran at 29,706 tok/s on its first call
# against 28,464 (RESULTS.md "Twelfth session"); the fp8 tensor-core options above, where one is
# set, take precedence. Off for 16-bit caches: 4.623 s against the tensor-core tile's 3.736.
# Tiles (B1's fp8 decode attention replayed, RESULTS.md "Nineteenth session"): 16 keys, 1 warp, the
# loop's loads pipelined over 3 stages (`tl.range(num_stages=...)`: cp.async into shared memory, where
# the loads had gone straight to registers, each tile waiting on its own), P V summed into
# DECODE_FMA_ACC_ROWS partial sums: 2.340 s (0.738 of copy bandwidth) against 2.801 (0.617) for the
# former 32 keys, 1 stage, one sum; 32 keys with 2 / 3 / 4 stages 2.681 / 2.682 / 2.969, 64 keys 5.094.
# 2 warps were 1.6-2.6x slower; 32 programs per multiprocessor (1-warp programs) 6% faster than 8.
DECODE_FMA_FP8 = True
DECODE_FMA_16BIT = False
DECODE_FMA_BLOCK_N = 16
DECODE_FMA_NUM_WARPS = 1
DECODE_FMA_NUM_STAGES = 3
DECODE_FMA_PROGRAMS_PER_SM = 32  # the split policy's target for this kernel (TARGET_PROGRAMS_PER_SM's)
# Its cap on splits (MAX_SPLITS's): B1 with an fp8 cache ran GPU steps of 3.724 / 3.737 ms at 32 against
# 3.831 / 3.758 at 48 (alternating, one call; RESULTS.md "Twenty-third session").
DECODE_FMA_MAX_SPLITS = 32
DECODE_FMA_ACC_2D = False  # P V summed over keys per tile (False) or once at the end (True: slower)
# P V summed per tile into DECODE_FMA_ACC_ROWS partial sums, rows r, r + ROWS, r + 2 ROWS, ... of the
# tile each (the rows one thread holds: an fp8 tile's 16-byte rows put 4 threads along the keys),
# added together once at the end, instead of summed over all keys each tile: the sum within a thread
# stays, the shuffles across threads go (32-key tile, offline for sm_90: 1,396 instructions a tile
# against 1,524; replayed 2.564 s against 2.684; 8 sums 2.767).
DECODE_FMA_ACC_ROWS = 4
# A tile's P V in fp16 (packed, two products an instruction; the fp8 values are exact in fp16,
# p rounded to fp16 as the tensor-core tile rounds it) before it joins the fp32 accumulator,
# instead of fp32 (each value converted once more). Fp8 caches only. Off: 7% fewer instructions
# a tile and 130 registers instead of 168, but B1's fp8 attention replayed in 3.126 s against
# 2.844 (2.824 with DECODE_FMA_MAXNREG = 128: within 1%), B1 28,253 tok/s (RESULTS.md "Twelfth
# session", call 5); P V in fp16 takes one partial sum.
DECODE_FMA_PV_FP16 = False
DECODE_FMA_MAXNREG = None  # a register cap (None: ptxas's choice; 128 replayed as fast, 96 slower)
# Query heads per KV head up to which decodes take the CUDA-core kernel: it computes two heads a
# program, so a larger group reads its K/V once per pair of heads. The Qwen3-8B shape (4 per KV
# head) ran B1 with fp8 weights and cache at 10,021 tok/s with it, 1.08x its bf16 run, against
# 1.22x with the tensor-core tile (RESULTS.md "Twelfth session").
DECODE_FMA_MAX_GROUP = 2
# Decode-only batches on `gluon_decode_mma` instead (tensor cores, K and V loaded straight into the
# products' register fragments): over an fp8 cache with DECODE_MMA_FP8, over a 16-bit cache of the
# queries' dtype with DECODE_MMA_16BIT; for groups of up to its MAX_GROUP query heads and power-of-two
# head sizes from DECODE_MMA_MIN_HEAD_DIM, on GPUs of DECODE_MMA_MIN_CAPABILITY (fp8 -> fp16x2 in one
# instruction). It takes precedence over the CUDA-core kernel and the decode tiles, and fuses the RoPE
# as they do (DECODE_FUSED_ROPE). Compiled for sm_90 offline (benchmarks/attn_sass.py --gluon;
# RESULTS.md "Thirty-third session"), a 16-key tile's loop is 230 instructions for the whole group
# over an fp8 cache (201 over bf16), nothing through shared memory, at 130 registers (168); decode_fma
# takes 757 for two query heads, the decode tiles ~348 (fp8) / ~324 (bf16) a warp per 16 keys plus
# ~105 KB read and 71.5 KB written to shared memory a 128-key tile. Its one variant that spills: head
# size 256 over bf16 (255 registers, 4 spill stores). Both off until the kernel has run on a GPU: its
# tests and benchmarks there are written (benchmarks/gpu_decode_mma.sh), not yet run.
DECODE_MMA_FP8 = False
DECODE_MMA_16BIT = False
DECODE_MMA_BLOCK_N = 16             # keys a tile (a tile lies in one cache block)
DECODE_MMA_PREFETCH = 1             # tiles a program's loads run ahead of its products (1 or 2)
DECODE_MMA_PROGRAMS_PER_SM = 16     # the split policy's target for this kernel (1-warp programs)
DECODE_MMA_MAX_SPLITS = 32
DECODE_MMA_MIN_HEAD_DIM = 64
DECODE_MMA_MIN_CAPABILITY = (8, 9)
# A decode step's q/k norm + RoPE and its K/V store inside the decode kernel, the tile or
# `triton_decode_fma` (`paged_attention`'s `rope`; `fuses_decode_rope`), instead of a kernel of their own
# before it: one launch fewer a layer, where a one-sequence decode step is a chain of ~7 short kernels a
# layer (0.067 ms of its 0.892 ms were that kernel's, RESULTS.md "Twenty-third session"). Every program
# normalizes and rotates its own query rows; a program of the split that holds the new key writes it, then
# reads it back in its last tile. On an H200 (RESULTS.md "Twenty-fifth session"): one 32k-token sequence
# decoded at 581.4 tok/s against 567.1 unfused, B1 bf16 25,252 against 25,085 tok/s, B1 with an fp8 cache
# 33,873 against 34,086 (within its run-to-run spread).
DECODE_FUSED_ROPE = True

# Split-KV: split only when (query tiles x sequences x KV heads) would leave the GPU
# with fewer than TARGET_PROGRAMS_PER_SM programs per multiprocessor, never into
# segments shorter than MIN_KEYS_PER_SPLIT keys, and never into more than MAX_SPLITS.
# 8 and 512: B1's own decode batches replayed (benchmarks/bench_b1_attention.py, RESULTS.md
# "B1") took 1% less attention time than with 2 and 256, the values tuned on uniform
# contexts (NOTES_kernels.md): with B1's mixed context lengths, splitting mid-size batches
# in two evens out the programs' work.
# MAX_SPLITS (the tensor-core tile's; the CUDA-core kernel has DECODE_FMA_MAX_SPLITS): one 32k-token
# sequence (8 KV heads) fills one wave of the decode tile's programs at 48 splits: 384 programs, where
# a multiprocessor holds 3 (168 registers and 74 KB of shared memory each, Nsight Compute); at 32
# splits its 256 programs ran at 12% occupancy with DRAM 68% busy, at 64 its 504 non-empty programs
# took 1.29 waves (DRAM 64% busy). Its attention alone, 28 layers on an H200: 1.125 ms at 48 splits,
# 1.418 at 32, 1.34 at 56, 1.277 at 64; its decode through the engine 568.7 / 569.4 tok/s against
# 556.0 / 556.5 at 32 (bench_long_context.py, RESULTS.md "Twenty-third session").
TARGET_PROGRAMS_PER_SM = 8
# The same target for batches of more than one query tile a sequence (None: TARGET_PROGRAMS_PER_SM); a
# batch whose queries fit one tile (short prefills beside decodes) keeps the decode target, which spreads a
# long context's keys over the GPU as in a decode step. At 8 an 8,192-token
# chunk of Qwen3-0.6B's shape (512 query tiles of 128 tokens x KV heads) splits in 3, although the large
# prefill tile holds one program a multiprocessor; a 32k prompt's TTFT was 0.383-0.400 s in 8k or 16k
# chunks (split 3 and 2) against 0.347-0.353 s in one unsplit chunk (RESULTS.md "Thirteenth session"),
# a difference the host does not explain (its work for the four chunks took 16.6-17.5 ms against 10.2-16.1
# for one on a 2-core CPU: bench_host_steps.py --long-prompt). At 1 (an 8k chunk unsplit) the 32k prompt's
# TTFT on an H200 was 0.369 s against 0.388 at 8 in one call, 0.374 s on another machine (RESULTS.md
# "Twenty-fifth session").
PREFILL_TARGET_PROGRAMS_PER_SM = 1
# Query tiles as the grid's second axis, KV heads x splits its first (Q_TILES_OUTER), so a prefill's
# programs start heaviest first across all KV heads, not head by head: programs start in grid order, and
# a causal chunk's query tiles cost from 1 to its length in KV tiles. As list scheduling on 132
# multiprocessors holding one large prefill tile each (8 KV heads, 64-key tiles), head by head an
# 8,192-token chunk with no prefix finishes at 1.24x its mean load (the last chunk of a 32k prompt at 1.06x),
# heaviest first across heads at 1.01x (1.03x) (benchmarks/sim_prefill_grid.py); on an H200 the kernel ran
# that first chunk at 317 TFLOP/s against 393 for the last (RESULTS.md "Twenty-fifth session"). Decode grids
# (one query tile) start in the same order either way. On an H200 that first chunk's 28 layers took 20.0 ms
# against 24.2 (385 against 318 TFLOP/s), the last chunk 129.9 against 133.0; the 32k prompt's TTFT 0.365 s
# against 0.369 (RESULTS.md "Twenty-sixth session").
QUERY_TILES_OUTER = True
MAX_GRID_YZ = 65535     # CUDA's limit on a grid's second and third axes
# The softmax scale inside each exponent's fused multiply-add (`_attend_kv_tile`'s SCALE_IN_EXP), as
# FlashAttention does, instead of a multiply of every score first: the large prefill tile's sm_90 loop,
# 836 instructions a warp a KV tile, has 192 FMUL, 128 of them the accumulator's rescale and 64 the
# scores' scale (benchmarks/attn_sass.py; RESULTS.md "Twenty-fifth session"). Exact up to rounding (one
# rounding of score x scale - max instead of two). Off: on an H200 it changed neither the prefill kernel
# (132.5 against 133.0 ms for the 32k prompt's last chunk) nor B1 (25,073 against 25,155 tok/s; fp8 cache
# 34,003 against 33,987) beyond the run-to-run spread (RESULTS.md "Twenty-sixth session").
SOFTMAX_SCALE_IN_EXP = False
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 48
CPU_NOMINAL_SMS = 1     # under Triton's interpreter: no multiprocessors to fill
# The split-KV combine kernel: splits read at once, and warps a program. Alone at B1's decode shapes on an
# H200 (16 heads of 128, a CUDA graph of 50 launches; RESULTS.md "Twentieth session"): 256 tokens x 3 splits
# 3.72 us with 8 splits a read and 1 warp against 6.45 us with 16 and 4 warps; 128 x 5 2.61 / 3.98;
# 64 x 8 2.13 / 2.69; 8 x 8 1.49 / 1.92 (4 splits a read: 3.55, 2.93, 2.24, 1.69).
COMBINE_SPLITS_BLOCK = 8
COMBINE_NUM_WARPS = 1


def fp8_max(cache: torch.Tensor) -> float:
    """The largest finite value of an fp8 cache's dtype (0.0, unused, for other caches)."""
    return torch.finfo(cache.dtype).max if kv_quant.is_fp8(cache.dtype) else 0.0


@triton.jit
def _store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          k_scale_ptr, v_scale_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_kcb, stride_kcr, stride_kch,
                          stride_vcb, stride_vcr, stride_vch, stride_vcd,
                          NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
                          PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """One program per token: copy its [num_kv_heads, head_dim] key and value (KV_FP8:
    quantized with each head's scale)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    row = slot % PAGE_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if KV_FP8:
        head_ok = heads < NUM_KV_HEADS
        k = quantize_fp8(k, tl.load(k_scale_ptr + heads, mask=head_ok, other=1.0),
                         k_cache_ptr.dtype.element_ty, FP8_MAX)
        v = quantize_fp8(v, tl.load(v_scale_ptr + heads, mask=head_ok, other=1.0),
                         v_cache_ptr.dtype.element_ty, FP8_MAX)
    tl.store(k_cache_ptr + block * stride_kcb + row * stride_kcr + heads * stride_kch + dims,
             k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + row * stride_vcr + heads * stride_vch
             + dims * stride_vcd, v, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write this step's keys and values into their slots; slot -1 is skipped.

    key, value:       [num_tokens, num_kv_heads, head_dim] (last dim contiguous)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:     [num_tokens] int
    k_scale, v_scale: [num_kv_heads] float32, for an fp8 cache
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_last_dim_contiguous(key=key, value=value, k_cache=k_cache)
    _check_v_layout(v_cache)
    kv_fp8 = _check_scales(k_cache, k_scale, v_scale)
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if kv_fp8 else slot_mapping, v_scale if kv_fp8 else slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim), PAGE_SIZE=k_cache.shape[1],
        KV_FP8=kv_fp8, FP8_MAX=fp8_max(k_cache))


# ------------------------------------------------------------------ attention kernel
@triton.jit
def _opaque_identity(x):
    """x unchanged (16-bit values, two to a register), through an op with side effects, so the
    compiler neither moves work across it nor looks through it at how x was made."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit
def _attend_kv_tile(acc, m_i, l_i, q, q_pos, tile, ctx_len, kv_head,
                    k_cache_ptr, v_cache_ptr, block_table_ptr, scale_log2,
                    stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_vd,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, V_KEY_MINOR: tl.constexpr,
                    PV_MMA: tl.constexpr, OPAQUE_K_CAST: tl.constexpr, OPAQUE_V_CAST: tl.constexpr,
                    SCALE_IN_EXP: tl.constexpr):
    """One online-softmax step of the query tile over KV tile `tile`. The tiles are cast to
    q's dtype, the products' (fp16 for an fp8 cache and 16-bit queries). SCALE_IN_EXP
    (SOFTMAX_SCALE_IN_EXP): the scores stay unscaled, their row maxima are scaled, and the scale
    goes into each exponent's argument (one fused multiply-add a score instead of a multiply and
    a subtraction)."""
    positions = tile * BLOCK_N + tl.arange(0, BLOCK_N)                    # [BLOCK_N]
    k = load_kv_tile(k_cache_ptr, block_table_ptr, positions, ctx_len, kv_head,
                     stride_kb, stride_kr, stride_kh, 1, HEAD_DIM, HEAD_DIM_PAD,
                     PAGE_SIZE, MASKED)                                   # [BLOCK_N, D]
    k = k.to(q.dtype)  # an fp8 cache's tile: its scale is in scale_log2
    if KV_FP8 and OPAQUE_K_CAST and q.shape[0] < WGMMA_MIN_M:
        k = _opaque_identity(k)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)             # [BLOCK_M, BLOCK_N]
    if not SCALE_IN_EXP:
        s = s * scale_log2
    if MASKED:
        s = tl.where(positions[None, :] <= q_pos[:, None], s, float("-inf"))
    if SCALE_IN_EXP:
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)                # [BLOCK_M]
        p = tl.exp2(s * scale_log2 - m_new[:, None])                      # [BLOCK_M, BLOCK_N]
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))                             # [BLOCK_M]
        p = tl.exp2(s - m_new[:, None])                                   # [BLOCK_M, BLOCK_N]
    alpha = tl.exp2(m_i - m_new)
    v = load_kv_tile(v_cache_ptr, block_table_ptr, positions, ctx_len, kv_head,
                     stride_vb, stride_vr, stride_vh, stride_vd, HEAD_DIM, HEAD_DIM_PAD,
                     PAGE_SIZE, MASKED)                                   # [BLOCK_N, D]
    l_i = l_i * alpha + tl.sum(p, 1)
    if PV_MMA:  # acc is O^T [HEAD_DIM_PAD, BLOCK_M]: V^T P^T on the fp8 tensor cores
        p8 = (p * P_FP8_SCALE).to(v.dtype)                                 # [BLOCK_M, BLOCK_N] e4m3
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), tl.trans(p8))
    else:
        v = v.to(q.dtype)
        if KV_FP8 and not V_KEY_MINOR and q.shape[0] < WGMMA_MIN_M:  # mma.sync tiles (decode):
            # the conversion stays before the tile's rearrangement for the product (module docstring)
            if OPAQUE_V_CAST:
                v = _opaque_identity(v)
            else:  # a zero the compiler cannot prove is zero (0.0 since ctx_len >= 1)
                v = v + (ctx_len < 0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_kv_tile_fp8_mma(acc_t, m_i, l_i, q_t, q_pos, tile, ctx_len, kv_head,
                            k_cache_ptr, v_cache_ptr, block_table_ptr, scale_log2,
                            stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_vd,
                            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                            PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """`_attend_kv_tile` with DECODE_FP8_QUERY_QUANT, transposed: acc_t [HEAD_DIM_PAD, BLOCK_M]
    (O^T times P_FP8_SCALE), q_t [HEAD_DIM_PAD, BLOCK_M] e4m3, scale_log2 [1, BLOCK_M] (the
    softmax, key and query row scales). K and V stay e4m3."""
    positions = tile * BLOCK_N + tl.arange(0, BLOCK_N)                    # [BLOCK_N]
    k = load_kv_tile(k_cache_ptr, block_table_ptr, positions, ctx_len, kv_head,
                     stride_kb, stride_kr, stride_kh, 1, HEAD_DIM, HEAD_DIM_PAD,
                     PAGE_SIZE, MASKED)                                   # [BLOCK_N, D] e4m3
    s_t = tl.dot(k, q_t) * scale_log2                                     # [BLOCK_N, BLOCK_M] fp32
    if MASKED:
        s_t = tl.where(positions[:, None] <= q_pos[None, :], s_t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_t, 0))                               # [BLOCK_M]
    alpha = tl.exp2(m_i - m_new)
    p_t = tl.exp2(s_t - m_new[None, :])                                   # [BLOCK_N, BLOCK_M]
    l_i = l_i * alpha + tl.sum(p_t, 0)
    v = load_kv_tile(v_cache_ptr, block_table_ptr, positions, ctx_len, kv_head,
                     stride_vb, stride_vr, stride_vh, stride_vd, HEAD_DIM, HEAD_DIM_PAD,
                     PAGE_SIZE, MASKED)                                   # [BLOCK_N, D] e4m3
    pv_t = tl.dot(tl.trans(v), (p_t * P_FP8_SCALE).to(q_t.dtype))        # [D, BLOCK_M] fp32
    return acc_t * alpha[None, :] + pv_t, m_new, l_i


@triton.jit
def _quantize_rows_e4m3(x):
    """Each row of x in e4m3 with its own scale (a row of zeros: scale 1).
    # x [BLOCK_M, D] -> ([BLOCK_M, D] e4m3, [BLOCK_M] float32)"""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0.0, amax / FP8_E4M3_MAX, 1.0)
    y = tl.minimum(tl.maximum(x / scale[:, None], -FP8_E4M3_MAX), FP8_E4M3_MAX)
    return y.to(tl.float8e4nv), scale


@triton.jit(do_not_specialize=RUN_TIME_ARGS)
def _unified_attention_kernel(
        out_ptr, part_out_ptr, part_lse_ptr,
        q_ptr, k_cache_ptr, v_cache_ptr,
        cu_seqlens_q_ptr, seq_lens_k_ptr, block_tables_ptr, scale_log2, k_scale_ptr, v_scale_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_vd, stride_bt,
        stride_pt, stride_ph, stride_lt, stride_lh, num_splits,
        k_new_ptr, v_new_ptr, pos_ptr, slot_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, rope_eps,
        stride_knt, stride_knh, stride_vnt, stride_vnh,
        QPK: tl.constexpr, QPK_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
        IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
        FP16_PRODUCTS: tl.constexpr, V_KEY_MINOR: tl.constexpr, FP8_MMA: tl.constexpr,
        PV_MMA: tl.constexpr, OPAQUE_K_CAST: tl.constexpr, OPAQUE_V_CAST: tl.constexpr,
        ROPE: tl.constexpr, QK_NORM: tl.constexpr, OPAQUE_Q: tl.constexpr, FP8_MAX: tl.constexpr,
        Q_TILES_OUTER: tl.constexpr, SCALE_IN_EXP: tl.constexpr, PDL: tl.constexpr):
    """Grid: (query tiles, KV heads x splits, sequences), or with Q_TILES_OUTER (QUERY_TILES_OUTER)
    (KV heads x splits, query tiles, sequences); query tiles heaviest first.

    ROPE (decode tiles, DECODE_FUSED_ROPE): q, and the new key and value at `k_new_ptr` /
    `v_new_ptr`, are this step's before q/k norm (QK_NORM) and RoPE; the program whose split holds
    the new key stores it into the cache first.

    Programs start in grid order, so all heads and splits of one sequence run side by
    side: they share its block-table rows, and the cache rows they read lie together
    (a token's heads are adjacent in the cache). Sequence-major order was 2.7% slower
    over B1's decode batches (RESULTS.md "B1")."""
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    if Q_TILES_OUTER:
        q_block = tl.num_programs(1) - 1 - tl.program_id(1)
        head_split = tl.program_id(0)
    else:
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)
        head_split = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head_split // num_splits
    split = head_split % num_splits
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_k_ptr + seq)
    if KV_FP8:  # the KV head's key scale joins the softmax scale
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // QPK_PAD                  # [BLOCK_M] query of each row
    head = kv_head * QPK + rows % QPK_PAD                         # [BLOCK_M] query head of each row
    row_ok = (q_idx < q_len) & (rows % QPK_PAD < QPK)
    q_pos = ctx_len - q_len + q_idx                               # [BLOCK_M] causal limit of each row
    if ROPE:  # a decode step: one query token, at q_start
        half_dims = tl.arange(0, HEAD_DIM // 2)[None, :]
        cos, sin = load_cos_sin(cos_sin_ptr, tl.load(pos_ptr + q_start), half_dims)
        q = rope_q_rows(q_ptr, q_start + q_idx, head, row_ok, stride_qt, stride_qh, q_w_ptr, cos, sin,
                        rope_eps, half_dims, QK_NORM)            # [BLOCK_M, HEAD_DIM]
        if OPAQUE_Q:  # as if loaded: K then reaches the product through ldmatrix again (bf16 tile's loop: 650
            q = _opaque_identity(q)  # instructions, 648 unfused, 789 without this; triton 3.6: attn_sass.py)
        if split == split_of_last_key(ctx_len, num_splits, BLOCK_N):  # this split's tiles hold the new key
            rope_store_new_kv(k_new_ptr, v_new_ptr, q_start, kv_head, slot_ptr, k_cache_ptr, v_cache_ptr,
                              k_scale_ptr, v_scale_ptr, k_w_ptr, cos, sin, rope_eps, stride_knt, stride_knh,
                              stride_vnt, stride_vnh, stride_kb, stride_kr, stride_kh, stride_vb, stride_vr,
                              stride_vh, stride_vd, half_dims, PAGE_SIZE, QK_NORM, KV_FP8, FP8_MAX)
            tl.debug_barrier()  # the key and value written are visible to the program's loads below
    else:
        q = load_q_tile(q_ptr, q_start, q_idx, head, row_ok, stride_qt, stride_qh,
                        HEAD_DIM, HEAD_DIM_PAD)                  # [BLOCK_M, HEAD_DIM_PAD]
    if FP16_PRODUCTS:  # an fp8 cache with 16-bit queries
        q = tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)

    # KV tiles this program covers, and how many of them every row sees whole.
    first_pos = ctx_len - q_len + q_block * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, ctx_len)
    tile_begin, full_end, masked_begin, tile_end = split_tile_range(kv_end, first_pos + 1, split, num_splits,
                                                                    BLOCK_N)

    m_i = tl.full([BLOCK_M], RUNNING_MAX_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if FP8_MMA:  # transposed products on the fp8 tensor cores (DECODE_FP8_QUERY_QUANT)
        q8, q_scale = _quantize_rows_e4m3(q)                      # [BLOCK_M, D] e4m3, [BLOCK_M]
        q_t = tl.trans(q8)                                        # [HEAD_DIM_PAD, BLOCK_M]
        s_scale = (scale_log2 * q_scale)[None, :]                 # [1, BLOCK_M]
        acc_t = tl.zeros([HEAD_DIM_PAD, BLOCK_M], dtype=tl.float32)
        for tile in range(tile_begin, full_end):
            acc_t, m_i, l_i = _attend_kv_tile_fp8_mma(
                acc_t, m_i, l_i, q_t, q_pos, tile, ctx_len, kv_head, k_cache_ptr, v_cache_ptr,
                block_table_ptr, s_scale, stride_kb, stride_kr, stride_kh,
                stride_vb, stride_vr, stride_vh, stride_vd, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE,
                False)
        for tile in range(masked_begin, tile_end):
            acc_t, m_i, l_i = _attend_kv_tile_fp8_mma(
                acc_t, m_i, l_i, q_t, q_pos, tile, ctx_len, kv_head, k_cache_ptr, v_cache_ptr,
                block_table_ptr, s_scale, stride_kb, stride_kr, stride_kh,
                stride_vb, stride_vr, stride_vh, stride_vd, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE,
                True)
        acc = tl.trans(acc_t) * (1.0 / P_FP8_SCALE)              # [BLOCK_M, HEAD_DIM_PAD]
    else:
        if PV_MMA:
            acc = tl.zeros([HEAD_DIM_PAD, BLOCK_M], dtype=tl.float32)  # O^T
        else:
            acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        for tile in range(tile_begin, full_end):
            acc, m_i, l_i = _attend_kv_tile(
                acc, m_i, l_i, q, q_pos, tile, ctx_len, kv_head, k_cache_ptr, v_cache_ptr,
                block_table_ptr, scale_log2, stride_kb, stride_kr, stride_kh,
                stride_vb, stride_vr, stride_vh, stride_vd, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE,
                False, DOT_PRECISION, KV_FP8, V_KEY_MINOR, PV_MMA, OPAQUE_K_CAST, OPAQUE_V_CAST, SCALE_IN_EXP)
        for tile in range(masked_begin, tile_end):
            acc, m_i, l_i = _attend_kv_tile(
                acc, m_i, l_i, q, q_pos, tile, ctx_len, kv_head, k_cache_ptr, v_cache_ptr,
                block_table_ptr, scale_log2, stride_kb, stride_kr, stride_kh,
                stride_vb, stride_vr, stride_vh, stride_vd, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE,
                True, DOT_PRECISION, KV_FP8, V_KEY_MINOR, PV_MMA, OPAQUE_K_CAST, OPAQUE_V_CAST, SCALE_IN_EXP)
        if PV_MMA:
            acc = tl.trans(acc) * (1.0 / P_FP8_SCALE)             # [BLOCK_M, HEAD_DIM_PAD]

    tokens = q_start + q_idx
    has_keys = l_i > 0.0  # false only for a split whose segment no row of it can see
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]              # [BLOCK_M, HEAD_DIM_PAD]
    if KV_FP8:  # every value row of this KV head had the same scale
        o = o * tl.load(v_scale_ptr + kv_head)
    if not IS_SPLIT:
        store_rows(out_ptr, tokens, head, row_ok, o, stride_ot, stride_oh,
                   HEAD_DIM, HEAD_DIM_PAD)
    else:
        store_rows(part_out_ptr + split * HEAD_DIM_PAD, tokens, head, row_ok, o,
                   stride_pt, stride_ph, HEAD_DIM_PAD, HEAD_DIM_PAD)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + tokens * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["stride_pt", "stride_ph", "stride_lt", "stride_lh", "num_splits"])
def _combine_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr,
                           stride_ot, stride_oh, stride_pt, stride_ph, stride_lt, stride_lh, num_splits,
                           SPLITS_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                           PDL: tl.constexpr):
    """One program per (token, head): weight each split's output by its softmax mass, over
    the splits SPLITS_BLOCK at a time (online rescaling), so one compile serves any count."""
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse_row = part_lse_ptr + token * stride_lt + head * stride_lh
    part_row = part_out_ptr + token * stride_pt + head * stride_ph
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    for first in range(0, num_splits, SPLITS_BLOCK):
        splits = first + tl.arange(0, SPLITS_BLOCK)
        split_ok = splits < num_splits
        lse = tl.load(lse_row + splits, mask=split_ok, other=float("-inf"))     # [SPLITS_BLOCK]
        m_new = tl.maximum(m, tl.max(lse, 0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys so far: weights 0, not NaN
        alpha = tl.exp2(m - safe)
        weight = tl.exp2(lse - safe)                                           # [SPLITS_BLOCK]
        part = tl.load(part_row + splits[:, None] * HEAD_DIM_PAD + dims[None, :],
                       mask=split_ok[:, None], other=0.0)                      # [SPLITS_BLOCK, D]
        acc = acc * alpha + tl.sum(part * weight[:, None], 0)
        total = total * alpha + tl.sum(weight, 0)
        m = m_new
    o = acc / total                                                            # [HEAD_DIM_PAD]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


# ------------------------------------------------------------------------ host side
def new_kv_cache(shape: tuple[int, int, int, int], dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches, each [num_blocks, block_size, num_kv_heads, head_dim].

    Both are contiguous, except for an fp8 cache with FP8_HEADS_MAJOR (memory [num_blocks,
    num_kv_heads, block_size, head_dim]) or FP8_V_KEY_MINOR (V's memory [num_blocks,
    num_kv_heads, head_dim, block_size]: a block's keys adjacent for each dimension). The
    tensors are then permuted views of that memory, so code that indexes the cache by (block,
    row, head) reads the same values in every layout; the kernels take strides."""
    fp8 = kv_quant.is_fp8(dtype)
    num_blocks, block_size, num_kv_heads, head_dim = shape
    if fp8 and FP8_HEADS_MAJOR:
        k_cache = torch.empty((num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype,
                              device=device).permute(0, 2, 1, 3)
    else:
        k_cache = torch.empty(shape, dtype=dtype, device=device)
    if fp8 and (FP8_V_KEY_MINOR or ((DECODE_FP8_QUERY_QUANT or DECODE_FP8_PV_MMA) and dtype == torch.float8_e4m3fn)):
        v_cache = torch.empty((num_blocks, num_kv_heads, head_dim, block_size), dtype=dtype, device=device)
        return k_cache, v_cache.permute(0, 3, 1, 2)
    return k_cache, torch.empty_like(k_cache)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Workspace allocation (one place, so tests can poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether the cache is fp8; an fp8 cache must come with both scales, [num_kv_heads] float32."""
    if not kv_quant.is_fp8(cache.dtype):
        return False
    assert k_scale is not None and v_scale is not None, "an fp8 cache needs k_scale and v_scale"
    assert k_scale.shape == v_scale.shape == cache.shape[2:3] and k_scale.dtype == torch.float32
    return True


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, "
                             f"got strides {tuple(t.stride())}")


def _check_v_layout(v_cache: torch.Tensor) -> bool:
    """Whether V is laid out key-minor within a block (`new_kv_cache` with FP8_V_KEY_MINOR);
    else its last dimension must be contiguous."""
    if v_cache.stride(-1) == 1:
        return False
    if v_cache.stride(1) != 1:
        raise ValueError("v_cache must be contiguous in its last dimension or key-minor within a "
                         f"block (stride 1 over block rows), got strides {tuple(v_cache.stride())}")
    return True


def _fp8_mma(cache_dtype: torch.dtype, q_dtype: torch.dtype, max_seqlen_q: int, option: bool) -> bool:
    """Whether an fp8 tensor-core option (DECODE_FP8_QUERY_QUANT, DECODE_FP8_PV_MMA) applies:
    decode tiles over an e4m3 cache with 16-bit queries."""
    return (option and max_seqlen_q == 1 and cache_dtype == torch.float8_e4m3fn
            and q_dtype in (torch.float16, torch.bfloat16))


def num_sms(device: torch.device) -> int:
    """Multiprocessors of `device` (CPU_NOMINAL_SMS under Triton's interpreter), looked up once."""
    if device.type != "cuda":
        return CPU_NOMINAL_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _choose_num_splits(programs: int, max_seqlen_k: int | None, device: torch.device,
                       programs_per_sm: int | None = None, max_splits: int | None = None) -> int:
    """Split-KV factor that fills the GPU (`programs_per_sm` programs a multiprocessor, default
    TARGET_PROGRAMS_PER_SM) without making segments too short, nor more than `max_splits`
    (default MAX_SPLITS)."""
    target = (programs_per_sm or TARGET_PROGRAMS_PER_SM) * num_sms(device)
    if programs >= target:
        return 1
    max_splits = max_splits or MAX_SPLITS
    by_length = max_splits if max_seqlen_k is None else max_seqlen_k // MIN_KEYS_PER_SPLIT
    return max(1, min(triton.cdiv(target, programs), by_length, max_splits))


def _large_prefill_tile(device: torch.device, q_dtype: torch.dtype, kv_fp8: bool) -> bool:
    return (PREFILL_LARGE_TILE and device.type == "cuda" and q_dtype in (torch.float16, torch.bfloat16)
            and not kv_fp8 and torch.cuda.get_device_capability(device) >= PREFILL_LARGE_MIN_CAPABILITY)


def _tile_config(max_seqlen_q: int, qpk_pad: int, kv_fp8: bool = False, on_gpu: bool = True,
                 large_prefill: bool = False, opaque_v_cast: bool = False) -> dict:
    """Tile shape and launch settings: decode tiles when no sequence has > 1 query."""
    if max_seqlen_q == 1:
        block_m = max(MIN_DOT_DIM, qpk_pad)
        if kv_fp8:
            cfg = dict(BLOCK_Q=block_m // qpk_pad, BLOCK_M=block_m, BLOCK_N=DECODE_FP8_BLOCK_N,
                       num_warps=DECODE_FP8_NUM_WARPS, num_stages=DECODE_FP8_NUM_STAGES)
            maxnreg = DECODE_FP8_MAXNREG or (DECODE_FP8_OPAQUE_MAXNREG if opaque_v_cast else None)
        else:
            cfg = dict(BLOCK_Q=block_m // qpk_pad, BLOCK_M=block_m, BLOCK_N=DECODE_BLOCK_N,
                       num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES)
            maxnreg = DECODE_MAXNREG
        if maxnreg is not None and on_gpu:  # a compile option; Triton's interpreter takes none
            cfg["maxnreg"] = maxnreg
        return cfg
    if large_prefill:
        rows, keys, warps, stages = (PREFILL_LARGE_BLOCK_M, PREFILL_LARGE_BLOCK_N,
                                     PREFILL_LARGE_NUM_WARPS, PREFILL_LARGE_NUM_STAGES)
    else:
        rows, keys, warps, stages = PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_NUM_WARPS, PREFILL_NUM_STAGES
    block_m = max(rows, qpk_pad)
    return dict(BLOCK_Q=block_m // qpk_pad, BLOCK_M=block_m, BLOCK_N=keys, num_warps=warps, num_stages=stages)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, *,
                    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                    num_splits: int | None = None, out: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, rope: DecodeRope | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context.

    q:            [num_tokens, num_heads, head_dim] (last dim contiguous)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: [num_seqs + 1] int32 query offsets into q
    seq_lens_k:   [num_seqs] int32 context length, including this step's tokens
    block_tables: [num_seqs, max_blocks] int32, -1 padded
    Keyword-only, host-known facts (none is read from the device):
      max_seqlen_q: longest query run in the batch; 1 means a decode-only batch (decode
                    tiles). Default: the bound num_tokens - num_seqs + 1.
      max_seqlen_k: longest context; only sizes the split-KV choice. Default: unknown,
                    treated as long.
      num_splits:   split-KV factor; default chosen from the grid size and max_seqlen_k.
                    Any value is correct for any context length, so a CUDA graph may
                    bake the one chosen at capture.
      out:          [num_tokens, num_heads, head_dim] buffer to write into.
      k_scale, v_scale: [num_kv_heads] float32, for an fp8 cache.
      rope:         where `fuses_decode_rope`: q and rope.k are this step's before q/k norm and RoPE,
                    and this step's K/V are not yet in the cache; the decode tile does both.
    Returns:      out, [num_tokens, num_heads, head_dim]
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens_k.shape[0], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    _check_last_dim_contiguous(q=q, k_cache=k_cache)
    v_key_minor = _check_v_layout(v_cache)
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = num_tokens - num_seqs + 1
    qpk = num_heads // num_kv_heads
    kv_fp8 = _check_scales(k_cache, k_scale, v_scale)
    assert rope is None or fuses_decode_rope(q, k_cache, max_seqlen_q), "the caller checks fuses_decode_rope"
    if max_seqlen_q == 1 and _use_decode_mma(q, k_cache, v_cache, kv_fp8):
        return _decode_mma(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, out,
                           k_scale, v_scale, kv_fp8, max_seqlen_k, num_splits, rope)
    if max_seqlen_q == 1 and _use_decode_fma(kv_fp8, k_cache.dtype, q.dtype, qpk):
        return _decode_fma(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, out,
                           k_scale, v_scale, kv_fp8, max_seqlen_k, num_splits, rope)
    if max_seqlen_q > 1 and num_splits in (None, 1) and triton_prefill_tma.applies(q, k_cache, v_cache):
        programs = triton_prefill_tma.num_programs(max_seqlen_q, qpk, num_kv_heads, num_seqs)
        if num_splits == 1 or programs >= triton_prefill_tma.MIN_PROGRAMS_PER_SM * num_sms(q.device):
            return triton_prefill_tma.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k,
                                                        block_tables, scale, max_seqlen_q, out)
    fp8_mma = _fp8_mma(k_cache.dtype, q.dtype, max_seqlen_q, DECODE_FP8_QUERY_QUANT)
    pv_mma = _fp8_mma(k_cache.dtype, q.dtype, max_seqlen_q, DECODE_FP8_PV_MMA and not DECODE_FP8_QUERY_QUANT)
    opaque = _opaque_casts(kv_fp8 and not (v_key_minor or fp8_mma or pv_mma), q)
    cfg = _tile_config(max_seqlen_q, triton.next_power_of_2(qpk), kv_fp8, q.device.type == "cuda",
                       _large_prefill_tile(q.device, q.dtype, kv_fp8), opaque["OPAQUE_V_CAST"])
    num_q_blocks = triton.cdiv(max_seqlen_q, cfg["BLOCK_Q"])
    if num_splits is None:
        num_splits = _choose_num_splits(num_q_blocks * num_seqs * num_kv_heads, max_seqlen_k, q.device,
                                        PREFILL_TARGET_PROGRAMS_PER_SM if num_q_blocks > 1 else None)
    head_dim_pad = max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    part_out, part_lse = _split_workspace(num_tokens, num_heads, num_splits, head_dim_pad,
                                          q.device)
    grid, q_tiles_outer = _attention_grid(num_q_blocks, num_kv_heads * num_splits, num_seqs)
    _unified_attention_kernel[grid](
        *_launch_args(out, part_out, part_lse, q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables,
                      scale, k_scale if kv_fp8 else None, v_scale if kv_fp8 else None, num_splits),
        QPK=qpk, QPK_PAD=triton.next_power_of_2(qpk), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=k_cache.shape[1], IS_SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=kv_fp8,
        FP16_PRODUCTS=kv_fp8 and q.dtype != torch.float32, V_KEY_MINOR=v_key_minor,
        FP8_MMA=fp8_mma, PV_MMA=pv_mma, **_rope_args(rope, q, k_cache, seq_lens_k), **opaque, **cfg,
        Q_TILES_OUTER=q_tiles_outer, SCALE_IN_EXP=SOFTMAX_SCALE_IN_EXP, **launch_options(q.device))
    if num_splits > 1:
        _combine(out, part_out, part_lse, num_splits, head_dim, head_dim_pad)
    return out


def _attention_grid(num_q_blocks: int, heads_splits: int, num_seqs: int) -> tuple[tuple[int, int, int], bool]:
    """The unified kernel's grid and its Q_TILES_OUTER: query tiles on the second axis where
    QUERY_TILES_OUTER holds and they fit there, else on the first."""
    if QUERY_TILES_OUTER and num_q_blocks <= MAX_GRID_YZ:
        return (heads_splits, num_q_blocks, num_seqs), True
    return (num_q_blocks, heads_splits, num_seqs), False


def fuses_decode_rope(q: torch.Tensor, k_cache: torch.Tensor, max_seqlen_q: int) -> bool:
    """Whether `paged_attention` takes a batch's q/k norm + RoPE and K/V store (`rope`): with
    DECODE_FUSED_ROPE, a decode-only batch on the decode tile, `triton_decode_fma` or `gluon_decode_mma`
    (not an fp8 tensor-core tile), heads of a power-of-two size."""
    if not DECODE_FUSED_ROPE or max_seqlen_q != 1:
        return False
    head_dim = q.shape[-1]
    if _fp8_mma(k_cache.dtype, q.dtype, 1, DECODE_FP8_QUERY_QUANT or DECODE_FP8_PV_MMA):
        return False
    return head_dim >= MIN_DOT_DIM and head_dim & (head_dim - 1) == 0


def _rope_args(rope: DecodeRope | None, q: torch.Tensor, k_cache: torch.Tensor, seq_lens_k: torch.Tensor,
               opaque_q: bool = True) -> dict:
    """A decode kernel's RoPE arguments: `rope`'s tensors, or (no rope) any tensors of the same
    kinds, which the kernel leaves unread; `opaque_q`: the kernel takes OPAQUE_Q (the decode tile;
    `triton_decode_fma` computes on fp32 copies of q)."""
    if rope is None:
        args = dict(k_new_ptr=q, v_new_ptr=q, pos_ptr=seq_lens_k, slot_ptr=seq_lens_k, cos_sin_ptr=q,
                    q_w_ptr=q, k_w_ptr=q, rope_eps=0.0, stride_knt=q.stride(0), stride_knh=q.stride(1),
                    stride_vnt=q.stride(0), stride_vnh=q.stride(1), ROPE=False, QK_NORM=False, FP8_MAX=0.0)
        return dict(args, OPAQUE_Q=False) if opaque_q else args
    k, v = rope.k, rope.kv_store.value
    assert rope.kv_store.k_cache is k_cache and k.stride(2) == 1 and v.stride(2) == 1
    args = dict(k_new_ptr=k, v_new_ptr=v, pos_ptr=rope.positions, slot_ptr=rope.kv_store.slot_mapping,
                cos_sin_ptr=rope.cos_sin_cache, q_w_ptr=q if rope.q_weight is None else rope.q_weight,
                k_w_ptr=q if rope.k_weight is None else rope.k_weight, rope_eps=rope.eps,
                stride_knt=k.stride(0), stride_knh=k.stride(1), stride_vnt=v.stride(0), stride_vnh=v.stride(1),
                ROPE=True, QK_NORM=rope.q_weight is not None, FP8_MAX=fp8_max(k_cache))
    return dict(args, OPAQUE_Q=_opaque_identity_runs(q)) if opaque_q else args


def _launch_args(out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, q: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 seq_lens_k: torch.Tensor, block_tables: torch.Tensor, scale: float,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, num_splits: int) -> tuple:
    """The run-time arguments both attention kernels take, in their order (a cache without
    scales passes any int32 tensor for the unused scale pointers)."""
    return (out, part_out, part_lse, q, k_cache, v_cache,
            cu_seqlens_q, seq_lens_k, block_tables, scale * LOG2E,
            seq_lens_k if k_scale is None else k_scale, seq_lens_k if v_scale is None else v_scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3), block_tables.stride(0),
            part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1), num_splits)


def _opaque_casts(casts_fp8: bool, q: torch.Tensor) -> dict:
    """Whether the fp8 decode tile's converted K and V go through `_opaque_identity` (PTX inline
    assembly): per DECODE_FP8_OPAQUE_K_CAST / _V_CAST, where the tile casts an fp8 cache to 16 bits
    (`casts_fp8`: an fp8 cache whose tiles are converted, not fed to the fp8 tensor cores) on an
    NVIDIA GPU, not under Triton's interpreter (which runs no assembly)."""
    applies = casts_fp8 and _opaque_identity_runs(q)
    v_cast = applies and DECODE_FP8_OPAQUE_V_CAST
    return dict(OPAQUE_K_CAST=v_cast and DECODE_FP8_OPAQUE_K_CAST, OPAQUE_V_CAST=v_cast)


def _opaque_identity_runs(q: torch.Tensor) -> bool:
    """Whether `_opaque_identity`'s inline assembly (two 16-bit values a register) can take q's
    dtype and tiles cast to it: 16-bit queries, run as NVIDIA PTX (not under Triton's interpreter,
    not on ROCm)."""
    return (q.element_size() == 2 and q.is_cuda and torch.version.hip is None
            and not triton.knobs.runtime.interpret)


def _use_decode_fma(kv_fp8: bool, cache_dtype: torch.dtype, q_dtype: torch.dtype, qpk: int) -> bool:
    """Whether a decode-only batch runs on the CUDA cores (DECODE_FMA_*): per cache kind, for
    groups of up to DECODE_FMA_MAX_GROUP query heads, unless an fp8 tensor-core option applies."""
    if qpk > DECODE_FMA_MAX_GROUP:
        return False
    if not kv_fp8:
        return DECODE_FMA_16BIT
    tensor_core_option = _fp8_mma(cache_dtype, q_dtype, 1, DECODE_FP8_QUERY_QUANT or DECODE_FP8_PV_MMA)
    return DECODE_FMA_FP8 and not tensor_core_option


def _use_decode_mma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, kv_fp8: bool) -> bool:
    """Whether a decode-only batch runs on `gluon_decode_mma` (DECODE_MMA_*): an fp8 cache, or a 16-bit
    one of q's dtype, whose rows are contiguous (V's too, where given), blocks of whole tiles, a
    group of at most its MAX_GROUP query heads, 16-bit queries, on an NVIDIA GPU of
    DECODE_MMA_MIN_CAPABILITY, not under Triton's interpreter (which runs no Gluon)."""
    switch = DECODE_MMA_FP8 if kv_fp8 else DECODE_MMA_16BIT and k_cache.dtype == q.dtype
    if not (switch and q.is_cuda and torch.version.hip is None) or triton.knobs.runtime.interpret:
        return False
    head_dim, qpk = q.shape[-1], q.shape[1] // k_cache.shape[2]
    return (q.element_size() == 2 and qpk <= gluon_decode_mma.MAX_GROUP.value
            and head_dim >= DECODE_MMA_MIN_HEAD_DIM and head_dim & (head_dim - 1) == 0
            and k_cache.shape[1] % DECODE_MMA_BLOCK_N == 0 and k_cache.stride(3) == 1
            and (v_cache is None or v_cache.stride(3) == 1) and _capability(q.device) >= DECODE_MMA_MIN_CAPABILITY)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _decode_mma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_tables: torch.Tensor,
                scale: float, out: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                kv_fp8: bool, max_seqlen_k: int | None, num_splits: int | None,
                rope: DecodeRope | None = None) -> torch.Tensor:
    """`paged_attention` of a decode-only batch through `gluon_decode_mma`."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens_k.shape[0], k_cache.shape[2]
    if num_splits is None:
        num_splits = _choose_num_splits(num_seqs * num_kv_heads, max_seqlen_k, q.device,
                                        DECODE_MMA_PROGRAMS_PER_SM, DECODE_MMA_MAX_SPLITS)
    part_out, part_lse = _split_workspace(num_tokens, num_heads, num_splits, head_dim, q.device)
    k_words, v_words = k_cache.view(torch.int32), v_cache.view(torch.int32)  # 4 fp8 or 2 16-bit values a word
    gluon_decode_mma.decode_mma_kernel[(num_kv_heads * num_splits, num_seqs)](
        out, part_out, part_lse, q, k_words, v_words, cu_seqlens_q, seq_lens_k, block_tables, scale * LOG2E,
        k_scale if kv_fp8 else seq_lens_k, v_scale if kv_fp8 else seq_lens_k,  # (unread for a 16-bit cache)
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_words.stride(0), k_words.stride(1), k_words.stride(2), v_words.stride(0), v_words.stride(1),
        v_words.stride(2), block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1), num_splits,
        **_rope_args(rope, q, k_cache, seq_lens_k, opaque_q=False),
        QPK=num_heads // num_kv_heads, BLOCK_N=DECODE_MMA_BLOCK_N, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        PREFETCH=DECODE_MMA_PREFETCH, KV_FP8=kv_fp8, E5M2=k_cache.dtype == torch.float8_e5m2,
        IS_SPLIT=num_splits > 1,
        num_warps=1, **launch_options(q.device))
    if num_splits > 1:
        _combine(out, part_out, part_lse, num_splits, head_dim, head_dim)
    return out


def _decode_fma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_tables: torch.Tensor,
                scale: float, out: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                kv_fp8: bool, max_seqlen_k: int | None, num_splits: int | None,
                rope: DecodeRope | None = None) -> torch.Tensor:
    """`paged_attention` of a decode-only batch through `triton_decode_fma`."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens_k.shape[0], k_cache.shape[2]
    qpk = num_heads // num_kv_heads
    pairs = triton.cdiv(qpk, triton_decode_fma.HEADS_PER_PROGRAM.value)
    if num_splits is None:
        num_splits = _choose_num_splits(num_seqs * num_kv_heads * pairs, max_seqlen_k, q.device,
                                        DECODE_FMA_PROGRAMS_PER_SM, DECODE_FMA_MAX_SPLITS)
    head_dim_pad = max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    part_out, part_lse = _split_workspace(num_tokens, num_heads, num_splits, head_dim_pad, q.device)
    pv_fp16 = DECODE_FMA_PV_FP16 and kv_fp8 and not DECODE_FMA_ACC_2D
    acc_rows = 1 if pv_fp16 or DECODE_FMA_ACC_2D else DECODE_FMA_ACC_ROWS
    assert acc_rows & (acc_rows - 1) == 0 and DECODE_FMA_BLOCK_N % acc_rows == 0, \
        "the partial sums are a power of two that divides the tile's rows (tl.reshape)"
    triton_decode_fma.decode_fma_kernel[(num_kv_heads * pairs * num_splits, num_seqs)](
        *_launch_args(out, part_out, part_lse, q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables,
                      scale, k_scale if kv_fp8 else None, v_scale if kv_fp8 else None, num_splits),
        QPK=qpk, BLOCK_N=DECODE_FMA_BLOCK_N,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=k_cache.shape[1],
        IS_SPLIT=num_splits > 1, KV_FP8=kv_fp8, ACC_2D=DECODE_FMA_ACC_2D,
        PV_FP16=pv_fp16, LOOP_STAGES=DECODE_FMA_NUM_STAGES, ACC_ROWS=acc_rows,
        **_rope_args(rope, q, k_cache, seq_lens_k, opaque_q=False),
        num_warps=DECODE_FMA_NUM_WARPS, num_stages=DECODE_FMA_NUM_STAGES,
        **({"maxnreg": DECODE_FMA_MAXNREG} if DECODE_FMA_MAXNREG and q.is_cuda else {}), **launch_options(q.device))
    if num_splits > 1:
        _combine(out, part_out, part_lse, num_splits, head_dim, head_dim_pad)
    return out


def _combine(out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, num_splits: int,
             head_dim: int, head_dim_pad: int) -> None:
    """Merge the splits' partial outputs into `out` (one program per token and head)."""
    num_tokens, num_heads = out.shape[0], out.shape[1]
    _combine_splits_kernel[(num_tokens, num_heads)](
        out, part_out, part_lse, out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1), num_splits,
        SPLITS_BLOCK=COMBINE_SPLITS_BLOCK, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        num_warps=COMBINE_NUM_WARPS, **launch_options(out.device))


def _split_workspace(num_tokens: int, num_heads: int, num_splits: int, head_dim_pad: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs [T, H, splits, D_pad] and log2-sum-exps [T, H, splits]."""
    if num_splits == 1:  # unused by the kernel; any tensor stands in for the pointers
        empty = _empty((1, 1, 1), torch.float32, device)
        return empty, empty
    return (_empty((num_tokens, num_heads, num_splits * head_dim_pad), torch.float32, device),
            _empty((num_tokens, num_heads, num_splits), torch.float32, device))
