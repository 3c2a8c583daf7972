"""Weight-only int4 / int8 on the CPU for unquantized checkpoints, quantized at load.

`quantization="int4"`: each linear weight becomes 4-bit integers with a scale and zero per
output channel and group of 32 inputs (asymmetric, round to nearest: kernels/cpu_int4.py),
run by `_weight_int4pack_mm_for_cpu`. `quantization="int8"`: symmetric int8 with one scale
per output channel, run by `_weight_int8pack_mm`. Both kernels run in bf16 (activations
and scales); batches past `max_rows` tokens run the dense product, which is faster there
(MAX_INT4_ROWS in layers/quantization/gguf.py, MAX_INT8_ROWS here: per CPU kind). The
token embedding and the LM head stay dense. Off the CPU, or for a shape the kernel cannot
take, a layer stays dense.

Error (measured on random weights, tests/test_cpu_quant.py): int8 per channel puts a
weight off by at most half a step (max |w| / 254 of its row); int4 by half a step of its
group ((max - min) / 30).
"""
import torch
from torch import nn

from nanovllm.kernels import cpu_int4, cpu_int8_dynamic
from nanovllm.layers.quantization import register_quantization
from nanovllm.layers.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from nanovllm.layers.quantization.gguf import MAX_INT4_ROWS
from nanovllm.utils.device import cpu_kind

# Token counts up to which `_weight_int8pack_mm` (bf16) beats the dense product, per CPU kind. On
# AVX2 int8 takes int4's figure (MAX_INT4_ROWS; not measured apart). On AVX512-BF16, against
# oneDNN's packed bf16 product (benchmarks/bench_cpu_gemm.py --kinds dnnbf int8bf, one thread;
# RESULTS "B2 CPU, round 8"; SmolLM2's 120 layers): 15.4 against 21.8 ms at 1 row, 23.5 against
# 22.4 at 2, 22.2 against 16.6 at 4.
MAX_INT8_ROWS = {"avx2": MAX_INT4_ROWS["avx2"], "avx512_bf16": 1}


class _CPUIntConfig(QuantizationConfig):
    bits = 0

    def __init__(self):
        self.max_rows = (MAX_INT4_ROWS if self.bits == 4 else MAX_INT8_ROWS)[cpu_kind()]

    @classmethod
    def from_config(cls, quant_config: dict) -> "_CPUIntConfig":
        return cls()

    def get_linear_method(self, layer: nn.Module) -> LinearMethod:
        return CPUIntLinearMethod(self.bits, self.max_rows)


@register_quantization("int4")
class Int4Config(_CPUIntConfig):
    """Weight-only int4 (groups of 32, asymmetric), quantized at load, CPU."""
    bits = 4


@register_quantization("int8")
class Int8Config(_CPUIntConfig):
    """Weight-only int8 (per output channel, symmetric), quantized at load, CPU."""
    bits = 8


class CPUIntLinearMethod(UnquantizedLinearMethod):
    """The dense weight as loaded, plus its int4 or int8 form for small batches."""

    def __init__(self, bits: int, max_rows: int):
        self.bits, self.max_rows = bits, max_rows
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        if w.device.type != "cpu" or not cpu_int4.can_pack(*w.shape):
            return
        if self.bits == 4:
            self.packed = cpu_int4.pack_int4(*cpu_int4.quantize_affine(w), torch.bfloat16)
        else:
            q, scale = cpu_int8_dynamic.quantize_per_channel(w)  # symmetric, |q| <= 127
            self.packed = (q, scale.to(torch.bfloat16))

    @property
    def own_kernel_max_rows(self) -> int:
        return 0 if self.packed is None else self.max_rows

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is None or x.shape[0] > self.max_rows:
            return super().apply(layer, x, bias)
        if self.bits == 4:
            y = cpu_int4.int4_linear(x, *self.packed)
        else:
            q, scale = self.packed
            y = torch.ops.aten._weight_int8pack_mm(x.to(scale.dtype), q, scale).to(x.dtype)
        return y if bias is None else y + bias
