"""GGUF weights on the CPU with int8 x int8 products (`quantization="gguf_int8"`, off by default).

The "gguf" method (layers/quantization/gguf.py), except for the products: every linear layer
and the LM head also gets an int8 copy of its dequantized weight, per output channel, with
its input features rotated in blocks of 64 by a Hadamard matrix, and batches of
`INT8_MIN_ROWS` tokens and more (1 on AVX2: every product, decode and prefill) run FBGEMM's
dynamic int8 product on it, the activations rotated alike and quantized per token at run time
(kernels/cpu_int8_dynamic.py), instead of the int4 kernel and oneDNN's packed fp32 product.
A layer whose every batch runs int8 keeps no fp32 weight (kernels/cpu_linear.py drops what no
batch reads); the LM head keeps the token embedding's.

For fp32 engines on the CPU only (CPUs without fast bf16: AVX2); anywhere else, and on a
checkpoint that is not a GGUF file, asking for it is a ValueError. The error it adds (RESULTS
"B2 CPU, round 7": teacher-forced logprobs of the embedded SmolLM2 move by 0.09-0.13 on
average, 6-7x the int4 kernel's, ~2x the fp8 KV cache's; greedy ids part from the "gguf"
path's) is why it is an option and not the default.
"""
import torch
from torch import nn

from nanovllm.kernels import cpu_int8_dynamic
from nanovllm.layers.quantization import register_quantization
from nanovllm.layers.quantization.gguf import GGUFConfig
from nanovllm.utils.device import resolve_dtype

INT8_LM_HEAD = True  # the LM head's batches by int8 too (RESULTS "B2 CPU, round 7" has both)


@register_quantization("gguf_int8")
class GGUFInt8Config(GGUFConfig):
    """A GGUF file's weights as "gguf", with batches by int8 x int8 products (CPU, fp32)."""

    def __init__(self):
        super().__init__()
        self.min_rows = cpu_int8_dynamic.INT8_MIN_ROWS
        self.int8 = False

    @classmethod
    def from_config(cls, quant_config: dict) -> "GGUFInt8Config":
        if quant_config.get("quant_method") != "gguf":
            raise ValueError("quantization='gguf_int8' is for GGUF files; this checkpoint is not one")
        return cls()

    @classmethod
    def overrides(cls, checkpoint_method: str) -> bool:
        return checkpoint_method == "gguf"

    def configure(self, device: torch.device, dtype_option: str) -> None:
        super().configure(device, dtype_option)
        if device.type != "cpu":
            raise ValueError(f"quantization='gguf_int8' runs on the CPU only; the device is {device.type!r}")
        if resolve_dtype(dtype_option, device, None) != torch.float32:
            raise ValueError(f"quantization='gguf_int8' needs fp32 products; dtype={dtype_option!r} runs "
                             "bf16 here (use dtype='float32')")
        if not cpu_int8_dynamic.can_run():
            raise ValueError("quantization='gguf_int8' needs torch's FBGEMM int8 kernels, which this "
                             "torch build lacks")
        self.int8 = True
        self.max_int4_rows = min(self.max_int4_rows, self.min_rows - 1)  # int8 takes the rest
        self.max_q4_rows = min(self.max_q4_rows, self.min_rows - 1)
        self.max_vnni_rows = min(self.max_vnni_rows, self.min_rows - 1)
        self.max_q8_0_rows = min(self.max_q8_0_rows, self.min_rows - 1)
        self.max_q5_k_rows = min(self.max_q5_k_rows, self.min_rows - 1)
        self.max_q8_0_head_rows = min(self.max_q8_0_head_rows, self.min_rows - 1) if INT8_LM_HEAD else 0
        self.max_q5_k_head_rows = min(self.max_q5_k_head_rows, self.min_rows - 1) if INT8_LM_HEAD else 0

    def process_model_after_loading(self, model: nn.Module) -> None:
        if self.int8:
            use_int8_for_batches(model, self.min_rows, INT8_LM_HEAD)


def use_int8_for_batches(model: nn.Module, min_rows: int, lm_head: bool) -> None:
    """Give every linear layer with an fp32 weight (and the LM head, if `lm_head`) its int8
    copy `int8_weight`, which `cpu_gemm.dense_linear` runs for batches of `min_rows` and more."""
    from nanovllm.layers.embed_head import ParallelLMHead
    from nanovllm.layers.linear import LinearBase
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            if not lm_head:
                continue
        elif not (isinstance(module, LinearBase) and module.quant_method.is_dense):
            continue
        if module.weight is not None and module.weight.dtype == torch.float32:
            module.int8_weight = cpu_int8_dynamic.prepack(module.weight.data, min_rows)
