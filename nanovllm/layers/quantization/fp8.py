"""FP8 (e4m3) linear weights: quantized at load, or read from FP8 checkpoints.

Three ways in, one product:

- `quantization="fp8"` on a bf16/fp16/fp32 checkpoint ("fp8", empty config): each weight
  is loaded dense, then quantized once with one scale per output channel
  (amax of the row / 448).
- HF fine-grained FP8 (`quant_method: "fp8"`, as the official Qwen3 FP8 checkpoints ship):
  e4m3 `weight` with `weight_scale_inv` [ceil(out / bn), ceil(in / bk)] for blocks of
  `weight_block_size` [bn, bk] (128 x 128 there); without a block size, one
  `weight_scale` per tensor (AutoFP8's files).
- compressed-tensors float8 (`quant_method: "compressed-tensors"`, llm-compressor's
  FP8_DYNAMIC and FP8 schemes): e4m3 `weight` with `weight_scale` per channel
  [out, 1] or per tensor [1].

Scales are tagged for tensor parallelism (base.py), so they shard with their weights;
a merged layer (q/k/v, gate/up) gets one per-tensor scale per checkpoint tensor, each
spread over that tensor's rows. Activations are quantized per token at run time
(dynamic); checkpoints with static activation scales are refused, as are layers to be
left unquantized other than the LM head (which is never one of these layers).

The product: per-channel weights run fp8 x fp8 with rowwise scales: on the GPU a Triton
kernel for decode-sized batches (kernels/triton_batch_gemm.py's `scaled_fp8_linear`) and
`torch._scaled_mm` (cuBLAS) for larger ones, which accumulates in the tensor cores' own
accumulator (`use_fast_accum`, FAST_ACCUM) as vLLM's fp8 GEMMs do, rather than promoting
partial sums to fp32 every few k-steps (Triton's fp8 products on Hopper do the same by
default); `_scaled_mm` runs on CPU too, which is how CI tests it. Block-scaled weights run
a Triton GEMM on the GPU (kernels/triton_fp8.py: bf16/fp16 activations times the fp8 weight
tile, one scale per block; torch 2.11's block-wise `_scaled_mm` is not used, see
benchmarks/RESULTS.md "FP8"), and elsewhere are dequantized to the activation dtype per call.

Activations arriving quantized: on the GPU the RMSNorm before q/k/v and gate/up and the
SiLU-and-mul before down write their output as per-token fp8 themselves, in the kernel that
computes it (layers/quantization/fp8_activation.py), when told at load that the product after
them is a rowwise one here (`takes_quantized_input`; the model names the pairs, DecoderLayer's
`quantized_input_pairs`, and layers/quantization/__init__.py tells them); `apply` then takes that
`QuantizedActivation` as it is. The values and scales are those of the op's output quantized by
`quantize_rows`, bit for bit, so the products are unchanged; one launch and one read of each row
fewer (FUSED_ACTIVATION_QUANT).
"""
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import kv_quant
from nanovllm.layers.quantization import register_quantization
from nanovllm.layers.quantization.base import LinearMethod, QuantizationConfig, set_shard_tags

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
MIN_SCALE = 1e-12  # an all-zero row or token: any scale is exact; this one avoids 0 / 0
UNQUANTIZED_OK = ("lm_head", "re:.*lm_head")  # names a checkpoint may leave dense: not our linear layers
# `_scaled_mm(use_fast_accum=...)` for cuBLAS's batches (above triton_batch_gemm.FP8_TILES' rows; the
# Triton tiles below accumulate the same way, always): Qwen3-8B's B1 with fp8 weights and KV ran at
# 12,355 tok/s with it against 11,655 without, with the same error against the fp32 product (0.0375,
# the fp8 rounding of x and w), on an H200 (benchmarks/RESULTS.md "Fifteenth session").
FAST_ACCUM = True
# The RMSNorm / SiLU-and-mul before a rowwise product on the GPU write its per-token fp8 input
# (module docstring); False: the product quantizes its input itself. Read at load, so set before an
# engine starts (the benchmarks' A/B: --attn-constants with the key
# "nanovllm.layers.quantization.fp8.FUSED_ACTIVATION_QUANT").
FUSED_ACTIVATION_QUANT = True


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row: x [rows, cols] -> (fp8 [rows, cols], float32 scales [rows, 1]).
    On a GPU one Triton launch (kernels/triton_fp8.py)."""
    if x.is_cuda and x.stride(-1) == 1:
        from nanovllm.kernels import triton_fp8
        return triton_fp8.quantize_rows(x, FP8_DTYPE, MIN_SCALE)
    scale = (x.abs().amax(1, keepdim=True).float() / FP8_MAX).clamp_min(MIN_SCALE)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@dataclass(frozen=True)
class QuantizedActivation:
    """A rowwise fp8 linear layer's input, quantized per token by the layer before it (as
    `quantize_rows` would quantize the values that layer computes)."""
    values: torch.Tensor   # [num_tokens, in] e4m3
    scale: torch.Tensor    # [num_tokens, 1] float32
    dtype: torch.dtype     # the activations' own dtype: the product's output dtype


def expand_block_scales(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(out / bn), ceil(in / bk)] -> one per weight element [out, in]."""
    return scale.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


class Fp8LinearMethod(LinearMethod):
    """fp8 weight [out, in] with scales `weight_scale` per channel [out, 1] (after loading;
    per tensor in the checkpoint is spread per channel), or `weight_scale_inv` per block."""

    def __init__(self, source: str, block: tuple[int, int] | None = None):
        assert source in ("dense", "channel", "tensor", "block"), source
        self.source, self.block = source, block

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        dtype = params_dtype if self.source == "dense" else FP8_DTYPE
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", set_shard_tags(weight, output_dim=0, input_dim=1))
        if self.source in ("channel", "tensor"):
            scale = nn.Parameter(torch.empty(output_size, 1, dtype=torch.float32), requires_grad=False)
            layer.register_parameter("weight_scale", set_shard_tags(scale, output_dim=0, input_dim=None))
            if self.source == "tensor":
                scale.weight_loader = _per_tensor_loader(layer)
        elif self.source == "block":
            bn, bk = self.block
            scale = nn.Parameter(torch.empty(-(-output_size // bn), -(-input_size // bk), dtype=torch.float32),
                                 requires_grad=False)
            layer.register_parameter("weight_scale_inv", set_shard_tags(scale, 0, 1, shard_unit=bn))
            if bn != bk:
                raise ValueError(f"weight_block_size {list(self.block)}: only square blocks are supported")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.source == "dense":
            weight, scale = quantize_rows(layer.weight.data)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if self.source != "block":  # [1, out] as _scaled_mm takes the weight's rowwise scales
            layer.weight_scale = nn.Parameter(layer.weight_scale.data.reshape(1, -1).contiguous(),
                                              requires_grad=False)

    def takes_quantized_input(self, layer: nn.Module) -> bool:
        """Rowwise products on the GPU take their input quantized by the layer before them."""
        return FUSED_ACTIVATION_QUANT and self.source != "block" and layer.weight.is_cuda

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedActivation,
              bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):  # quantized by the layer before (takes_quantized_input)
            assert self.source != "block", "block-scaled products take 16-bit activations"
            x_fp8, x_scale, dtype, lead = x.values, x.scale, x.dtype, x.values.shape[:-1]
        elif self.source == "block":
            return self._apply_block(layer, x, bias)
        else:
            x_fp8, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))    # [tokens, in], [tokens, 1]
            dtype, lead = x.dtype, x.shape[:-1]
        y = _rowwise_product(x_fp8, x_scale, layer.weight, layer.weight_scale, dtype)  # [tokens, out]
        if bias is not None:
            y = y + bias
        return y.view(*lead, -1)


    def _apply_block(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Block-scaled weights: a Triton GEMM on the GPU (the weight read once, at one byte);
        elsewhere the weight dequantized to x's dtype per call."""
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            from nanovllm.kernels import triton_fp8
            x2 = x.reshape(-1, x.shape[-1]).contiguous()
            y = triton_fp8.block_fp8_linear(x2, layer.weight, layer.weight_scale_inv, self.block)
            y = y if bias is None else y + bias
            return y.view(*x.shape[:-1], -1)
        scale = expand_block_scales(layer.weight_scale_inv, self.block, layer.weight.shape)
        return F.linear(x, (layer.weight.float() * scale).to(x.dtype), bias)


def _rowwise_product(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """(x_fp8 * x_scale) @ (weight * w_scale)^T in `dtype`: x_fp8 [M, K], x_scale [M, 1], weight [N, K],
    w_scale [1, N]. Decode-sized GPU batches run kernels/triton_batch_gemm.py's tiles, the rest `_scaled_mm`;
    a CPU whose `_scaled_mm` takes per-tensor scales only (torch before 2.13) the dequantized product."""
    if x_fp8.is_cuda:
        from nanovllm.kernels import triton_batch_gemm
        tile = triton_batch_gemm.tile_for(x_fp8, weight)
        if tile is not None:
            return triton_batch_gemm.scaled_fp8_linear(x_fp8, x_scale, weight, w_scale, tile).to(dtype)
        # CUDA's rowwise-scaled product writes bf16 only: other dtypes are cast from it
        return torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16,
                                use_fast_accum=FAST_ACCUM).to(dtype)
    if not _cpu_rowwise_scaled_mm():  # the fp32 product of the fp8 values, then both scales, as _scaled_mm
        return (F.linear(x_fp8.float(), weight.float()) * x_scale * w_scale).to(dtype)
    return torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=dtype)


@functools.cache
def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes rowwise scales (2.13 does; 2.11 asserts)."""
    a = torch.ones(2, 16, dtype=FP8_DTYPE)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def _per_tensor_loader(layer: nn.Module):
    """A per-tensor checkpoint scale spread over the rows of its tensor in this layer's
    per-channel `weight_scale` (through the layer's own loader, so q/k/v and gate/up each
    land on their own rows)."""
    def load(param: nn.Parameter, loaded, *shard_id) -> None:
        value = (loaded if isinstance(loaded, torch.Tensor) else loaded[...]).float().reshape(-1)
        if value.numel() != 1:
            raise ValueError(f"a per-tensor weight_scale must hold one value, got shape {tuple(value.shape)}")
        from nanovllm.layers.linear import ColumnParallelLinear
        # column layers read their own rows of the whole tensor's; the others take it whole
        rows = layer.output_size * (layer.tp_size if isinstance(layer, ColumnParallelLinear) else 1)
        layer.weight_loader(param, value.reshape(1, 1).expand(rows, 1), *shard_id)
    return load


@register_quantization("fp8")
class Fp8Config(QuantizationConfig):
    """`quantization="fp8"` at load (empty config), or an HF FP8 checkpoint's config."""

    def __init__(self, source: str, block: tuple[int, int] | None = None):
        self.source, self.block = source, block

    @classmethod
    def from_config(cls, quant_config: dict) -> "Fp8Config":
        if not quant_config:
            return cls("dense")
        _check_dynamic(quant_config.get("activation_scheme", "dynamic") == "dynamic",
                       f"activation_scheme {quant_config.get('activation_scheme')!r}")
        _check_unquantized(quant_config.get("modules_to_not_convert") or quant_config.get("ignored_layers"))
        if quant_config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoint format {quant_config['fmt']!r} is not supported (only e4m3)")
        block = quant_config.get("weight_block_size")
        if block is None:
            return cls("tensor")
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"weight_block_size must be two positive ints, got {block!r}")
        return cls("block", tuple(block))

    def get_linear_method(self, layer: nn.Module) -> LinearMethod:
        return Fp8LinearMethod(self.source, self.block)

    def check_device(self, device: torch.device) -> None:
        kv_quant.check_fp8_device(device, "quantization='fp8'")


@register_quantization("compressed-tensors")
class CompressedTensorsFp8Config(QuantizationConfig):
    """compressed-tensors checkpoints with float8 weights (per channel or per tensor) and
    dynamic per-token float8 activations; any other scheme is refused by name."""

    def __init__(self, strategy: str):
        self.strategy = strategy

    @classmethod
    def from_config(cls, quant_config: dict) -> "CompressedTensorsFp8Config":
        groups = list((quant_config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors: exactly one config group is supported, got {len(groups)}")
        group = groups[0]
        weights, acts = group.get("weights") or {}, group.get("input_activations")
        scheme = (f"weights {weights.get('type')} {weights.get('num_bits')}-bit {weights.get('strategy')}, "
                  f"activations {acts}")
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or not weights.get("symmetric", True) \
                or weights.get("strategy") not in ("channel", "tensor") or weights.get("dynamic", False):
            raise ValueError(f"compressed-tensors scheme not supported ({scheme}): only float8 weights, "
                             "per channel or per tensor")
        _check_dynamic(acts is not None and (acts.get("type"), acts.get("num_bits")) == ("float", 8)
                       and acts.get("dynamic") is True, f"compressed-tensors activations {acts}")
        if "Linear" not in (group.get("targets") or []):
            raise ValueError(f"compressed-tensors targets {group.get('targets')!r}: only 'Linear' is supported")
        _check_unquantized(quant_config.get("ignore"))
        return cls(weights["strategy"])

    def get_linear_method(self, layer: nn.Module) -> LinearMethod:
        return Fp8LinearMethod(self.strategy)

    def check_device(self, device: torch.device) -> None:
        kv_quant.check_fp8_device(device, "compressed-tensors float8 weights")


def _check_dynamic(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{what}: only dynamic per-token float8 activations are supported "
                         "(static input scales are not)")


def _check_unquantized(names) -> None:
    other = [n for n in names or [] if n not in UNQUANTIZED_OK]
    if other:
        raise ValueError(f"layers left unquantized are not supported (only the LM head may be): {other}")
