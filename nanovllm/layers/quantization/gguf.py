"""GGUF weights on the CPU: 4-bit, Q8_0, Q6_K and Q5_K blocks kept quantized for their kernels.

A GGUF file's model config names this method ("gguf"). Each linear layer loads its weight
dequantized, exactly as the dense path does, and also keeps the raw blocks of every
checkpoint tensor it was loaded from, with where each checkpoint row went (packed q/k/v
and gate/up rows, this rank's shard). After loading, on the CPU, a layer whose rows are all
Q4_0 or all Q4_1 is repacked for our C++ Q4 kernel (kernels/cpu_gguf_q4.py: fp32 arithmetic on
the file's exact values) where it was measured faster (MAX_Q4_ROWS), and, where the CPU has
AVX512-VNNI or AVX2, for the int8 "VNNI" kernel (vpdpbusd, or AVX2's vpmaddubsw and vpmaddwd) that
runs the decode batches above those rows (on AVX2 every decode batch: MIN_VNNI_DECODE_ROWS; kernels/cpu_gguf_vnni.py:
MAX_VNNI_ROWS); otherwise a layer whose
rows are all Q4_0, Q4_1 or Q4_K is repacked for `_weight_int4pack_mm_for_cpu` (kernels/cpu_int4.py), and
a layer whose rows are all Q8_0, all Q6_K or all Q5_K keeps them as int8 values and fp32 scales (one
per 32 values; per 16 for Q6_K), with, for Q5_K, an fp32 offset per 32 values too (exactly the
file's values), for the Q8_0 kernel (kernels/cpu_q8_0.py); everything else (F16, F32 tensors,
layers of mixed types, shapes the kernels cannot take, the GPU) stays on the dense path,
dequantized. The token embedding and the LM head are not linear layers: one of those three types
keeps its blocks too (layers/embed_head.py): the embedding reads its rows from them and the head
runs batches of up to `max_q8_0_head_rows` rows (Q6_K, Q5_K: their own measured counts) by the Q8_0
kernel (`process_model_after_loading`; a tied head shares the embedding's blocks). Other types stay
dense.

Where it runs: the int4 product runs in bf16 (fast; in fp32 it is 30-60x slower), so it
is used when the engine's dtype is "auto" or "bfloat16"; the Q8_0 kernel takes fp32 or bf16
activations (accumulating in fp32) and is used under the same options, so that
`dtype="float32"` still asks for fp32 products and gets every weight dequantized (exact), as
does `quantization="gguf_dequant"`. Batches of more than `max_q4_rows` / `max_int4_rows` /
`max_q8_0_rows` / `max_q5_k_rows` tokens run the dense product (oneDNN's packed copy of the
dequantized weight: kernels/cpu_gemm.py), which is faster there; in decode steps a layer with the
VNNI pack runs the VNNI kernel instead (prefill steps too only with VNNI_PREFILL). The crossovers are
measured per CPU kind: MAX_Q4_ROWS, MAX_INT4_ROWS, MAX_VNNI_ROWS, MAX_Q8_0_ROWS, MAX_Q8_0_HEAD_ROWS,
MAX_Q6_K_HEAD_ROWS, MAX_Q5_K_ROWS, MAX_Q5_K_HEAD_ROWS.

Which products are exact: `dtype="float32"` and `quantization="gguf_dequant"` (the dequantized
weight, fp32 or the dtype asked for); the Q4 kernel and the Q8_0 kernel (the file's values
times x in fp32, in another summation order; for Q5_K the scaled values and the offsets times the
block sums of x, apart, which skips dequantization's rounding of their sum: half an fp32 ulp a
weight at most; the dense bf16 weight rounds them to bf16). Not
exact: the int4 kernel (bf16 scales and activations) and the VNNI kernel, which rounds x to
8 bits per 32 values (kernels/cpu_gguf_vnni.py has its error; VNNI_PRODUCTS = False turns it off
and those batches run the dense bf16 product again).
"""
import functools
import math

import torch
from torch import nn

from nanovllm.kernels import cpu_gguf_q4, cpu_gguf_vnni, cpu_int4, cpu_q8_0
from nanovllm.layers.quantization import register_quantization
from nanovllm.layers.quantization.base import (LinearMethod, QuantizationConfig, UnquantizedLinearMethod,
                                               set_shard_tags)
from nanovllm.utils.context import in_decode_step
from nanovllm.utils.device import cpu_kind

# Token counts up to which the int4 kernel beats the dense product, per CPU kind, measured
# on SmolLM2-135M's layer shapes (benchmarks/RESULTS.md "B2 CPU, round 3"): on AVX2 against
# the oneDNN-packed fp32 product (kernels/cpu_gemm.py; benchmarks/bench_cpu_gemm.py, one
# thread) int4 was faster up to 12 tokens (90 vs 139 ms for the 120 layers) and slower from
# 16 (151 vs 119 ms); against the plain column-major product (round 2) it had been up to 16.
# On AVX512-BF16 against oneDNN's packed bf16 product (RESULTS "B2 CPU, round 8", the same bench
# with --kinds dnnbf int4bf, two runs): int4 7.4 / 9.4 against 21.8 / 22.3 ms at 1 row, 11.9
# against 16.6 at 4, 20.6 against 16.1 at 6, 24.8 / 22.5 against 26.1 / 19.8 at 8, 46.8 against
# 31.1 at 16.
MAX_INT4_ROWS = {"avx2": 12, "avx512_bf16": 4}
# Token counts up to which a layer of Q4_0 or Q4_1 rows runs the C++ Q4 kernel instead (and keeps no
# int4 pack), per CPU kind. On AVX512-BF16 (benchmarks/bench_cpu_q4.py, SmolLM2-135M's 120 layers
# cold, two threads; RESULTS.md "A 4-bit GGUF kernel for one sequence (eighteenth session)") it took
# 0.82-0.87x the int4 kernel's time at 1 row, 0.88-0.90x at 2, 1.01x at 4 and 0.90-0.93x at 8, so it
# serves every row count the int4 kernel did there. AVX2 (emulated: ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 on the same VM, its AVX2 branch, fp32 x as the AVX2 kind's fp32 engine calls
# both; RESULTS.md "B2 on the AVX2 kind, emulated (twentieth session)"; bench_cpu_q4.py --threads 2
# --kinds q4 int4f dense, two runs): q4 6.54 / 7.83 ms against int4 9.54 / 10.40 (dense 29.5 / 32.8)
# at 1 row, 7.13 / 6.64 against 11.30 / 10.57 at 2, 10.13 / 9.95 against 12.38 / 13.76 at 4, 20.1 /
# 20.0 / 21.7 against 28.1 / 26.0 / 28.4 at 8; above 8 rows in calls of 8 (q4_linear): 29.0 against
# 34.2 (dense 37.5) at 12, 38.4 / 42.2 / 42.7 at 16, 58.2 / 59.8 / 48.4 at 24: every row count the
# int4 kernel runs there.
MAX_Q4_ROWS = {"avx2": 12, "avx512_bf16": 4}
# (a layer on the Q4 kernel keeps no int4 pack: where it runs, it must take every row the int4 kernel did)
assert all(MAX_Q4_ROWS[kind] in (0, MAX_INT4_ROWS[kind]) for kind in MAX_Q4_ROWS)
# Whether batches above MAX_Q4_ROWS of a Q4_0 / Q4_1 layer run the int8 VNNI kernel
# (kernels/cpu_gguf_vnni.py: x rounded to 8 bits per 32 values, not exact) where the CPU has it
# (AVX512-VNNI or AVX2); False: they run the dense product on the dequantized weight (bf16, or fp32
# on the AVX2 kind), as before.
VNNI_PRODUCTS = True
# Whether prefill steps (and steps that mix prefill and decode) run it too; False: decode steps only,
# and prefill keeps the dense bf16 product (and each layer its dense copy: ~2 bytes a weight beside
# the VNNI pack's 0.625). The prompt's keys and values and the first token's logits are where the
# error shows: on prefill the kernel moved the embedded SmolLM2's teacher-forced logprobs by 0.057-0.065
# on average against the fp32 product (the bf16 product: 0.035-0.038) and turned the README's "What is
# the capital of France?" from "The capital of France is Paris." to "L'Étoile, la Marseillaise, ..."
# (a near-tie in fp32 too: "The" -1.88, "L" -1.97); prefill is a small part of a batched run's time
# (B2: one or two steps of ~2,500 rows against 128 decode steps). RESULTS.md has both. "Decode step"
# is the step context's `is_decode_only` (every sequence computes one token): a prefill whose last chunk is
# one token (a prefix-cache hit up to the prompt's last token, a one-token prompt) counts as one.
VNNI_PREFILL = False
# Token counts up to which a layer of Q4_0 or Q4_1 rows runs the VNNI kernel (rows up to MAX_Q4_ROWS
# run the Q4 kernel, exact; math.inf: every larger batch, and the layer keeps no dense copy).
# AVX512-BF16 (without AMX; the 2-core Zen 4 VM, benchmarks/bench_cpu_q4.py, SmolLM2-135M's 120
# layers cold, two threads, Q4_1, bf16 x; RESULTS.md "Int8 (VNNI) products for batches of GGUF
# 4-bit weights (nineteenth session)"): VNNI against oneDNN's packed bf16 product 7.07 / 12.02 ms at
# 5 rows, 7.33 / 12.48 at 8, 11.56 / 23.21 at 16, 32.25 / 43.40 at 64, 134.8 / 153.5 at 256,
# 264.5 / 297.6 at 512, 873 / 1051 at 2048: faster at every batch measured. AVX2 (the kernel's AVX2
# form, vpmaddubsw + vpmaddwd; the fp32 engine; the same bench with fp32 x under ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 on that VM, two runs; RESULTS.md "The int8 GGUF product on AVX2 (twentieth
# session)"): against oneDNN's packed fp32 product 15.6 / 16.3 against 44.7 / 48.3 ms at 16 rows,
# 52.5 / 54.8 against 108.0 / 107.1 at 64, 225 / 188 against 351 / 343 at 256: faster at every batch
# measured too (and than the int4 kernel, which keeps rows up to MAX_INT4_ROWS: 9.0 / 11.0 against
# 23.8 / 28.8 at 8 rows).
MAX_VNNI_ROWS = {"avx2": math.inf, "avx512_bf16": math.inf}
# Token counts from which a decode step's batch of such a layer runs the VNNI kernel ahead of the Q4 and
# int4 kernels (rows below it keep them; prefill steps keep them, exact, at every row count they take).
# AVX512-BF16: past MAX_Q4_ROWS, so the few rows of a decode step stay exact. AVX2: from one row, with x
# rounded to 8 bits per 32 values in decode steps as llama.cpp's AVX2 path rounds it: its AVX2 form took
# 3.15 / 3.47 ms at 1 row against the Q4 kernel's 5.18 / 4.97 and the int4 kernel's 8.40 / 8.31, 4.97 /
# 6.98 against 8.80 / 9.98 and 12.8 / 15.1 at 4, 9.01 / 11.0 against 18.4 / 21.2 and 23.8 / 28.8 at 8
# (the same bench as above, fp32 x, `--kinds vnni q4 int4 dnn`, two runs; RESULTS.md "The int8 GGUF
# product on AVX2 (twentieth session)"), and B2's one sequence is where the AVX2 kind trailed llama.cpp.
MIN_VNNI_DECODE_ROWS = {"avx2": 1, "avx512_bf16": MAX_Q4_ROWS["avx512_bf16"] + 1}
# The layers' types it runs (its Q8_0 form was measured for the LM head only, not for layers, whose
# Q8_0 kernel keeps its small batches: kernels/cpu_gguf_vnni.py)
VNNI_GGUF_TYPES = ("Q4_0", "Q4_1")
# Token counts up to which the Q8_0 kernel (kernels/cpu_q8_0.py) beats the dense product, per CPU
# kind. AVX512-BF16: against oneDNN's packed bf16 product, two threads (benchmarks/RESULTS.md "Q8_0
# kept quantized on the CPU"; benchmarks/bench_cpu_q8_0.py): 1536x576 0.063 against 0.130 ms at 1
# row, 0.056 / 0.089 at 2, 0.105 / 0.104 at 4, 0.149 / 0.140 at 8; 576x1536 0.072 / 0.123 at 1,
# 0.098 / 0.138 at 2, 0.137 / 0.126 at 4. The LM head 49152x576: 1.45 / 2.95 ms at 1, 1.80 / 3.07
# at 2, 2.32 / 2.90 at 4, 4.41 / 3.14 at 8. AVX2 (emulated, fp32 x against the fp32 engine's dense
# product: the column-major F.linear below 3 rows, oneDNN's packed fp32 from 3; RESULTS.md "B2 on the
# AVX2 kind, emulated (twentieth session)"; ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
# bench_cpu_q8_0.py --threads 2 --dtype float32, two runs): 1536x576 0.062 / 0.250 ms at 1 row, 0.098
# / 0.246 at 4, 0.181 / 0.281 and 0.153 / 0.251 at 8, 0.231 / 0.275 at 12, 0.337 / 0.416 and 0.335 /
# 0.327 at 16, 0.482 / 0.393 at 24; 576x1536 0.085 / 0.362 at 1, 0.287 / 0.304 at 12, 0.380 / 0.346
# at 16; the head 49152x576 1.79 / 7.13 at 1, 2.67 / 7.24 at 4, 6.40 / 8.87 and 6.09 / 8.43 at 8,
# 7.30 / 9.72 at 12, 12.1 / 11.5 and 11.8 / 11.9 at 16, 14.1 / 12.9 at 24.
MAX_Q8_0_ROWS = {"avx2": 12, "avx512_bf16": 2}
MAX_Q8_0_HEAD_ROWS = {"avx2": 12, "avx512_bf16": 4}
# The same for a Q6_K LM head (its scales one per 16 values: more work a weight). AVX512-BF16, the 49152 x 576
# head, two threads (benchmarks/bench_cpu_q8_0.py --block 16; RESULTS.md "GGUF Q6_K kept as int8 values on
# the CPU"): 1.41 against 2.73 ms at 1 row, 1.48 / 2.59 at 2, 1.84 / 2.28 at 3, 2.45 / 2.36 at 4. AVX2
# (emulated, fp32, as Q8_0 above with --block 16 --shapes 49152x576): 2.12 against 6.95 ms at 1 row,
# 3.39 / 8.36 at 4, 3.47 / 7.14 at 6, 6.96 / 8.35 at 8, 9.73 / 9.72 at 12, 12.9 / 11.1 at 16.
MAX_Q6_K_HEAD_ROWS = {"avx2": 8, "avx512_bf16": 3}
# Token counts up to which a layer of Q5_K rows runs the Q8_0 kernel with offsets (its int8 values 0..31,
# a scale and an offset per 32 values: 1.25 bytes a weight), per CPU kind; larger batches run the dense
# product. Measured on SmolLM2-135M-like shapes (960x576 qkv, 576x576 o, 3072x576 gate_up, 576x1536 down:
# a layer's four products, summed below), two threads, the 2-core Zen 4 VM (benchmarks/RESULTS.md "GGUF
# Q5_K kept quantized on the CPU (twentieth session)"), two runs each:
# AVX512-BF16, bf16 x, against oneDNN's packed bf16 product (benchmarks/bench_cpu_q8_0.py --threads 2
# --type Q5_K --shapes 960x576 576x576 3072x576 576x1536 49152x576 --rows 1 2 3 4 8): the four layers
# 0.26 / 0.27 against 0.41 / 0.41 ms at 1 row, 0.32 / 0.30 against 0.43 / 0.41 at 2, 0.41 / 0.36 against
# 0.46 / 0.41 at 3 (576x1536 alone 1.09 / 1.20x the dense time there), 0.46 / 0.43 against 0.45 / 0.41
# at 4, 0.87 / 0.76 against 0.56 / 0.49 at 8.
# AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 on the same VM, fp32 x, against the engine's fp32
# dense product: the column-major weight for 1-2 rows, oneDNN's packed copy from 3; the same command with
# --dtype float32, then --rows 8 12 16 24 --repeats 30): 0.34 / 0.41 against 1.11 / 1.03 ms at 1 row,
# 0.41 / 0.47 against 1.64 / 1.51 at 2, 0.49 / 0.67 against 1.06 / 1.28 at 4, 1.00 / 0.97 against
# 1.33 / 1.34 at 8, 1.21 / 1.31 against 1.45 / 1.50 at 12, 1.55 / 1.63 against 1.59 / 1.72 at 16 (about
# even), 2.28 / 2.41 against 1.89 / 2.06 at 24.
MAX_Q5_K_ROWS = {"avx2": 12, "avx512_bf16": 3}
# The same for a Q5_K LM head, the 49152 x 576 head, same runs:
# AVX512-BF16 1.69 / 2.08 against 3.43 / 3.28 ms at 1 row, 2.65 / 2.53 against 3.63 / 3.18 at 3,
# 3.60 / 2.93 against 3.78 / 3.28 at 4, 4.87 / 4.81 against 3.98 / 3.84 at 8; AVX2 2.25 / 1.59 against
# 6.85 / 5.86 at 1, 5.88 / 6.47 against 8.62 / 8.62 at 8, 8.13 / 10.12 against 10.07 / 9.93 at 12,
# 13.9 / 14.2 against 11.7 / 11.3 at 16.
MAX_Q5_K_HEAD_ROWS = {"avx2": 8, "avx512_bf16": 3}
_UNSET = -1.0  # row_source entries not loaded from a GGUF tensor


@register_quantization("gguf")
class GGUFConfig(QuantizationConfig):
    """A GGUF file's weights: 4-bit, Q8_0, Q6_K and Q5_K types kept for the CPU's kernels, the rest dense."""

    def __init__(self):
        self.packed = True
        self.max_q4_rows = MAX_Q4_ROWS[cpu_kind()]
        self.max_int4_rows = MAX_INT4_ROWS[cpu_kind()]
        self.max_vnni_rows = MAX_VNNI_ROWS[cpu_kind()] if VNNI_PRODUCTS and cpu_gguf_vnni.runs_here() else 0
        self.vnni_prefill = VNNI_PREFILL
        self.min_vnni_decode_rows = MIN_VNNI_DECODE_ROWS[cpu_kind()]
        self.max_q8_0_rows = MAX_Q8_0_ROWS[cpu_kind()]
        self.max_q8_0_head_rows = MAX_Q8_0_HEAD_ROWS[cpu_kind()]
        self.max_q5_k_rows = MAX_Q5_K_ROWS[cpu_kind()]
        self.max_q5_k_head_rows = MAX_Q5_K_HEAD_ROWS[cpu_kind()]

    @classmethod
    def from_config(cls, quant_config: dict) -> "GGUFConfig":
        return cls()

    def configure(self, device: torch.device, dtype_option: str) -> None:
        self.packed = device.type == "cpu" and dtype_option != "float32"

    def get_linear_method(self, layer: nn.Module) -> LinearMethod:
        return GGUFLinearMethod(self) if self.packed else UnquantizedLinearMethod()

    def get_moe_method(self, layer: nn.Module):
        return None  # experts load dequantized (layers/fused_moe.py's dense method)

    def keeps_q8_0_embedding(self) -> bool:
        return self.packed and self.max_q8_0_head_rows > 0

    def process_model_after_loading(self, model: nn.Module) -> None:
        """The LM head runs its batches of up to `max_q8_0_head_rows` rows (a Q6_K head: at most
        MAX_Q6_K_HEAD_ROWS; a Q5_K head: `max_q5_k_head_rows`) by its blocks' values (a tied head: the
        token embedding's, layers/embed_head.py)."""
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or not self.keeps_q8_0_embedding():
            return
        if getattr(head, "q8_weight", None) is None and embed is not None and head.weight is embed.weight:
            head.q8_weight, head.q8_dtype = embed.q8_weight, embed.q8_dtype
        weight = getattr(head, "q8_weight", None)
        if weight is None:
            return
        if weight.offsets is not None:  # Q5_K: measured apart
            head.q8_max_rows = self.max_q5_k_head_rows
        elif weight.block == cpu_q8_0.BLOCK_OF["Q6_K"]:
            head.q8_max_rows = min(self.max_q8_0_head_rows, MAX_Q6_K_HEAD_ROWS[cpu_kind()])
        else:
            head.q8_max_rows = self.max_q8_0_head_rows


@register_quantization("gguf_dequant")
class GGUFDequantConfig(QuantizationConfig):
    """A GGUF file's weights dequantized at load to the engine's dtype (the dense path)."""

    @classmethod
    def from_config(cls, quant_config: dict) -> "GGUFDequantConfig":
        return cls()

    @classmethod
    def overrides(cls, checkpoint_method: str) -> bool:
        return checkpoint_method == "gguf"

    def get_linear_method(self, layer: nn.Module) -> LinearMethod:
        return UnquantizedLinearMethod()

    def get_moe_method(self, layer: nn.Module):
        return None


class GGUFLinearMethod(UnquantizedLinearMethod):
    """Dense weight (dequantized) plus, where every row is a 4-bit GGUF type, the Q4 kernel's or
    the int4 pack (and, all Q4_0 or all Q4_1, the VNNI pack), and where every row is Q8_0, every
    row Q6_K or every row Q5_K, the int8 values and scales (Q5_K: and offsets) in the Q8_0 kernel's
    layout."""

    def __init__(self, config: GGUFConfig):
        self.max_q4_rows = config.max_q4_rows
        self.max_int4_rows = config.max_int4_rows
        self.max_vnni_rows = config.max_vnni_rows
        self.vnni_prefill = config.vnni_prefill
        self.min_vnni_decode_rows = config.min_vnni_decode_rows
        self.max_q8_0_rows = config.max_q8_0_rows
        self.max_q5_k_rows = config.max_q5_k_rows
        self.q8_max_rows = 0  # batches of up to this many rows run the Q8_0 kernel (where `q8` is kept)
        self.parts: list[tuple[str, torch.Tensor]] = []  # (ggml type, raw [rows, bytes]) per tensor
        self.row_source: nn.Parameter | None = None      # [out, 2]: (part, row) of each output row
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.q4: cpu_gguf_q4.PackedQ4 | None = None
        self.vnni: cpu_gguf_vnni.PackedVNNI | None = None
        self.q8: cpu_q8_0.Q8Weight | None = None

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size, output_size, params_dtype)
        layer.weight.weight_loader = functools.partial(self._load, layer)
        source = torch.full((output_size, 2), _UNSET, dtype=torch.float64)
        self.row_source = set_shard_tags(nn.Parameter(source, requires_grad=False), output_dim=0, input_dim=None)

    def _load(self, layer: nn.Module, param: nn.Parameter, loaded, *shard_id) -> None:
        """The layer's own loader for the dense weight; then the same rows of (part, row) ids,
        so that each output row knows which raw GGUF row it came from."""
        layer.weight_loader(param, loaded, *shard_id)
        raw, type_name = getattr(loaded, "gguf_raw", None), getattr(loaded, "gguf_type", None)
        if raw is None:
            return
        rows = loaded.shape[0]
        part = len(self.parts)
        self.parts.append((type_name, raw.view(rows, -1)))
        ids = torch.stack([torch.full((rows,), float(part), dtype=torch.float64),
                           torch.arange(rows, dtype=torch.float64)], 1)  # [rows, 2]
        layer.weight_loader(self.row_source, ids, *shard_id)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        source = self.row_source.data
        types = {t for t, _ in self.parts}
        loaded = layer.weight.device.type == "cpu" and bool(self.parts) and bool((source >= 0).all())
        if loaded and self.max_q4_rows > 0 and len(types) == 1:
            self.q4 = self._pack_q4(layer, source.long(), next(iter(types)), cpu_gguf_q4)
        if loaded and self.max_vnni_rows > 0 and len(types) == 1 and types <= set(VNNI_GGUF_TYPES):
            self.vnni = self._pack_q4(layer, source.long(), next(iter(types)), cpu_gguf_vnni)
        int4 = (loaded and self.max_int4_rows > 0 and types <= set(cpu_int4.INT4_GGUF_TYPES)
                and cpu_int4.can_pack(*layer.weight.shape))
        type_name = next(iter(types)) if len(types) == 1 else None
        block = cpu_q8_0.BLOCK_OF.get(type_name)
        q8_rows = self.max_q5_k_rows if type_name in cpu_q8_0.OFFSET_TYPES else self.max_q8_0_rows
        q8 = (loaded and q8_rows > 0 and block is not None and layer.weight.shape[1] % block == 0
              and cpu_q8_0.built_for(layer.weight.dtype, type_name))
        if self.q4 is None and int4:
            q, scale, zero = self._gather(layer, source.long(), self._int4_parts(), cpu_int4.GROUP_SIZE)
            self.packed = cpu_int4.pack_int4(q, scale, zero, torch.bfloat16)
        elif q8:
            parts = [cpu_q8_0.from_gguf(raw, t).tensors() for t, raw in self.parts]
            self.q8 = cpu_q8_0.Q8Weight(*self._gather(layer, source.long(), parts, block))
            self.q8_max_rows = q8_rows
        self.parts, self.row_source = [], None  # the raw blocks are not needed any more

    def _pack_q4(self, layer: nn.Module, source: torch.Tensor, type_name: str, kernel):
        """This layer's rows (and this rank's columns) of the raw blocks in the layout of `kernel`
        (the module cpu_gguf_q4 or cpu_gguf_vnni); None where it does not take them (another
        type, no C++ compiler, neither of the VNNI kernel's forms)."""
        block_bytes = kernel.GGUF_BLOCK_BYTES.get(type_name)
        raws = [raw for _, raw in self.parts]
        if block_bytes is None or len({raw.shape[1] for raw in raws}) != 1:
            return None
        (rows,) = self._layer_rows(source, [(raw,) for raw in raws])   # [out, ckpt blocks * block bytes]
        in_features, block = layer.weight.shape[1], kernel.BLOCK
        start = self._shard_start(layer, rows.shape[1] // block_bytes * block)
        if start % block or in_features % block:  # a row-parallel shard that splits a GGUF block
            return None
        rows = rows[:, start // block * block_bytes:(start + in_features) // block * block_bytes]
        return kernel.pack(rows.contiguous(), type_name, layer.weight.dtype)

    def _int4_parts(self) -> list[tuple[torch.Tensor, ...]]:
        return [cpu_int4.gguf_int4_affine(raw, t) for t, raw in self.parts]

    def _gather(self, layer: nn.Module, source: torch.Tensor, parts: list[tuple[torch.Tensor, ...]], group: int):
        """Each of the parts' tensors ([ckpt_rows, ckpt_in] values, then [ckpt_rows, ckpt_in / group]
        scales and, where there are, zeros or offsets) at this layer's rows (and this rank's columns)."""
        gathered = self._layer_rows(source, parts)                      # [out, ckpt_in], [out, ckpt_in / group]
        in_features = layer.weight.shape[1]
        start = self._shard_start(layer, gathered[0].shape[1])
        assert start % group == 0, "a row-parallel shard splits a quantization block"
        cols = [slice(start, start + in_features)] + [slice(start // group, (start + in_features) // group)] * 2
        return tuple(t[:, c] for t, c in zip(gathered, cols))

    @staticmethod
    def _layer_rows(source: torch.Tensor, parts: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        """Each of the parts' tensors (one tuple per checkpoint tensor, each tensor with that
        checkpoint tensor's rows first) at this layer's output rows, `source` [out, 2] (part, row)."""
        offsets = torch.tensor([0] + [p[0].shape[0] for p in parts]).cumsum(0)
        index = offsets[source[:, 0]] + source[:, 1]                    # [out]
        return [torch.cat(x)[index] for x in zip(*parts)]

    @staticmethod
    def _shard_start(layer: nn.Module, ckpt_in: int) -> int:
        """The first checkpoint input column of this rank's columns: 0 unless the layer is a
        row-parallel shard of a checkpoint `ckpt_in` columns wide."""
        in_features = layer.weight.shape[1]
        return 0 if ckpt_in == in_features else layer.tp_rank * in_features

    @property
    def own_kernel_max_rows(self) -> int | float:
        """The largest batch this layer's own kernels run, each from one row up (kernels/cpu_linear.py
        keeps the dense copies that larger batches need); math.inf: every batch."""
        if self.q8 is not None:
            return self.q8_max_rows
        return max(self.max_q4_rows if self.q4 is not None else 0,
                   self.max_int4_rows if self.packed is not None else 0,
                   self.max_vnni_rows if self.vnni is not None and self.vnni_prefill else 0)

    def runs_vnni(self, rows: int, decode: bool) -> bool:
        """Whether a batch of `rows` tokens runs the VNNI kernel: in decode steps (prefill too with
        vnni_prefill) from min_vnni_decode_rows (below it, or outside decode steps, the Q4 and int4
        kernels come first) up to max_vnni_rows."""
        if self.vnni is None or rows > self.max_vnni_rows or not (decode or self.vnni_prefill):
            return False
        return (decode and rows >= self.min_vnni_decode_rows) or not (
            self.q4 is not None and rows <= self.max_q4_rows or self.packed is not None and rows <= self.max_int4_rows)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = None
        if self.runs_vnni(x.shape[0], in_decode_step()):
            y = cpu_gguf_vnni.vnni_linear(x, self.vnni)  # [num_tokens, out]; None: a dtype it does not take
        elif self.q4 is not None and x.shape[0] <= self.max_q4_rows:
            y = cpu_gguf_q4.q4_linear(x, self.q4)  # [num_tokens, out]; None: a dtype it does not take
        elif self.packed is not None and x.shape[0] <= self.max_int4_rows:
            y = cpu_int4.int4_linear(x, *self.packed)  # [num_tokens, out]
        elif self.q8 is not None and x.shape[0] <= self.q8_max_rows:
            y = cpu_q8_0.q8_0_linear(x, self.q8)  # [num_tokens, out]
        if y is None:
            return super().apply(layer, x, bias)
        return y if bias is None else y + bias
