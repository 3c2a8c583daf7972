"""GGUF weights on the CPU: 4-bit, Q8_0 and Q6_K blocks kept quantized for their kernels.

A GGUF file's model config names this method ("gguf"). Each linear layer loads its weight
dequantized, exactly as the dense path does, and also keeps the raw blocks of every
checkpoint tensor it was loaded from, with where each checkpoint row went (packed q/k/v
and gate/up rows, this rank's shard). After loading, on the CPU, a layer whose rows are all
Q4_0 or all Q4_1 is repacked for our C++ Q4 kernel (kernels/cpu_gguf_q4.py: fp32 arithmetic on
the file's exact values) where it was measured faster (MAX_Q4_ROWS), and, where the CPU has
AVX512-VNNI, for the int8 VNNI kernel that runs the batches above those rows
(kernels/cpu_gguf_vnni.py: MAX_VNNI_ROWS); otherwise a layer whose
rows are all Q4_0, Q4_1 or Q4_K is repacked for `_weight_int4pack_mm_for_cpu` (kernels/cpu_int4.py), and
a layer whose rows are all Q8_0 or all Q6_K keeps them as int8 values and fp32 scales (one per
32 values; per 16 for Q6_K: exactly the file's values) for the Q8_0 kernel
(kernels/cpu_q8_0.py); everything else (Q5_K, F16, F32 tensors, layers of
mixed types, shapes the kernels cannot take, the GPU) stays on the dense path, dequantized. The
token embedding and the LM head are not linear layers: one of those two types keeps its blocks too
(layers/embed_head.py): the embedding reads its rows from them and the head runs batches of
up to `max_q8_0_head_rows` rows by the Q8_0 kernel (`process_model_after_loading`; a tied
head shares the embedding's blocks). Other types stay dense.

Where it runs: the int4 product runs in bf16 (fast; in fp32 it is 30-60x slower), so it
is used when the engine's dtype is "auto" or "bfloat16"; the Q8_0 kernel takes fp32 or bf16
activations (accumulating in fp32) and is used under the same options, so that
`dtype="float32"` still asks for fp32 products and gets every weight dequantized (exact), as
does `quantization="gguf_dequant"`. Batches of more than `max_q4_rows` / `max_int4_rows` /
`max_q8_0_rows` tokens run the dense product (oneDNN's packed copy of the dequantized weight:
kernels/cpu_gemm.py), which is faster there; in decode steps a layer with the VNNI pack runs
the VNNI kernel instead (prefill steps too only with VNNI_PREFILL). The crossovers are measured
per CPU kind: MAX_Q4_ROWS, MAX_INT4_ROWS, MAX_VNNI_ROWS, MAX_Q8_0_ROWS, MAX_Q8_0_HEAD_ROWS.

Which products are exact: `dtype="float32"` and `quantization="gguf_dequant"` (the dequantized
weight, fp32 or the dtype asked for); the Q4 kernel and the Q8_0 kernel (the file's values
times x in fp32, in another summation order; the dense bf16 weight rounds them to bf16). Not
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
# (kernels/cpu_gguf_vnni.py: x rounded to 8 bits per 32 values, not exact) where the CPU has it;
# False: they run the dense bf16 product on the dequantized weight, as before.
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
# 264.5 / 297.6 at 512, 873 / 1051 at 2048: faster at every batch measured. AVX2 has no VNNI of
# 512 bits: 0 (the int4 kernel and the dense product, as before).
MAX_VNNI_ROWS = {"avx2": 0, "avx512_bf16": math.inf}
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
_UNSET = -1.0  # row_source entries not loaded from a GGUF tensor


@register_quantization("gguf")
class GGUFConfig(QuantizationConfig):
    """A GGUF file's weights: 4-bit, Q8_0 and Q6_K types kept for the CPU's kernels, the rest dense."""

    def __init__(self):
        self.packed = True
        self.max_q4_rows = MAX_Q4_ROWS[cpu_kind()]
        self.max_int4_rows = MAX_INT4_ROWS[cpu_kind()]
        self.max_vnni_rows = MAX_VNNI_ROWS[cpu_kind()] if VNNI_PRODUCTS and cpu_gguf_vnni.runs_here() else 0
        self.vnni_prefill = VNNI_PREFILL
        self.max_q8_0_rows = MAX_Q8_0_ROWS[cpu_kind()]
        self.max_q8_0_head_rows = MAX_Q8_0_HEAD_ROWS[cpu_kind()]

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
        MAX_Q6_K_HEAD_ROWS) by its blocks' values (a tied head: the token embedding's,
        layers/embed_head.py)."""
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or not self.keeps_q8_0_embedding():
            return
        if getattr(head, "q8_weight", None) is None and embed is not None and head.weight is embed.weight:
            head.q8_weight, head.q8_dtype = embed.q8_weight, embed.q8_dtype
        if getattr(head, "q8_weight", None) is not None:
            q6_k = head.q8_weight.block == cpu_q8_0.BLOCK_OF["Q6_K"]
            head.q8_max_rows = min(self.max_q8_0_head_rows, MAX_Q6_K_HEAD_ROWS[cpu_kind()]) if q6_k \
                else self.max_q8_0_head_rows


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
    the int4 pack (and, all Q4_0 or all Q4_1, the VNNI pack), and where every row is Q8_0 or every
    row Q6_K, the int8 values and scales in the Q8_0 kernel's layout."""

    def __init__(self, config: GGUFConfig):
        self.max_q4_rows = config.max_q4_rows
        self.max_int4_rows = config.max_int4_rows
        self.max_vnni_rows = config.max_vnni_rows
        self.vnni_prefill = config.vnni_prefill
        self.max_q8_0_rows = config.max_q8_0_rows
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
        block = cpu_q8_0.BLOCK_OF.get(next(iter(types))) if len(types) == 1 else None
        q8 = (loaded and self.max_q8_0_rows > 0 and block is not None and layer.weight.shape[1] % block == 0
              and cpu_q8_0.built(layer.weight.dtype, block))
        if self.q4 is None and int4:
            q, scale, zero = self._gather(layer, source.long(), self._int4_parts(), cpu_int4.GROUP_SIZE)
            self.packed = cpu_int4.pack_int4(q, scale, zero, torch.bfloat16)
        elif q8:
            parts = [(w.values, w.scales) for w in (cpu_q8_0.from_gguf(raw, t) for t, raw in self.parts)]
            self.q8 = cpu_q8_0.Q8Weight(*self._gather(layer, source.long(), parts, block))
        self.parts, self.row_source = [], None  # the raw blocks are not needed any more

    def _pack_q4(self, layer: nn.Module, source: torch.Tensor, type_name: str, kernel):
        """This layer's rows (and this rank's columns) of the raw blocks in the layout of `kernel`
        (the module cpu_gguf_q4 or cpu_gguf_vnni); None where it does not take them (another
        type, no C++ compiler, no VNNI)."""
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
        scales) at this layer's rows (and this rank's columns)."""
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
            return self.max_q8_0_rows
        return max(self.max_q4_rows if self.q4 is not None else 0,
                   self.max_int4_rows if self.packed is not None else 0,
                   self.max_vnni_rows if self.vnni is not None and self.vnni_prefill else 0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = None
        if self.q4 is not None and x.shape[0] <= self.max_q4_rows:
            y = cpu_gguf_q4.q4_linear(x, self.q4)  # [num_tokens, out]; None: a dtype it does not take
        elif self.packed is not None and x.shape[0] <= self.max_int4_rows:
            y = cpu_int4.int4_linear(x, *self.packed)  # [num_tokens, out]
        elif self.vnni is not None and x.shape[0] <= self.max_vnni_rows and (self.vnni_prefill or in_decode_step()):
            y = cpu_gguf_vnni.vnni_linear(x, self.vnni)  # [num_tokens, out]; None: a dtype it does not take
        elif self.q8 is not None and x.shape[0] <= self.max_q8_0_rows:
            y = cpu_q8_0.q8_0_linear(x, self.q8)  # [num_tokens, out]
        if y is None:
            return super().apply(layer, x, bias)
        return y if bias is None else y + bias
