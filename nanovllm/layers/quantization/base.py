"""What a quantization method is: how a linear layer stores its weight and runs its product.

A `QuantizationConfig` (one per engine, picked at start from the `quantization` option or
the checkpoint's `quantization_config`) hands each linear layer a `LinearMethod`. The
method owns the layer's parameters and its product, in three steps (vLLM's split):

- `create_weights(layer, input_size, output_size, params_dtype)`: register the layer's
  parameters for this rank's partition (`weight`, and scales or packed blocks where the
  method has them). Each parameter is tagged with how it follows the layer's split under
  tensor parallelism (`set_shard_tags`): which of its dims runs along the layer's output
  features (`output_dim`) and input features (`input_dim`), None where it does not, and
  how many weight rows/columns one entry along that dim covers (`shard_unit`: 1 for a
  weight or a per-channel scale, 128 for 128x128 block scales). The layers' weight loaders
  read these tags, so a scale is sharded with its weight without code of its own. A
  parameter that arrives with a `weight_loader` of its own keeps it.
- `process_weights_after_loading(layer)`: once every checkpoint tensor is in, turn what
  was loaded into what `apply` runs on (quantize, repack for a kernel, transpose).
- `apply(layer, x, bias)`: the product, `x` [num_tokens, input_size] ->
  [num_tokens, output_size] (this rank's partial sum for row-parallel layers). A method whose
  `takes_quantized_input(layer)` is True may get `x` already quantized by the layer before it.

`UnquantizedLinearMethod` is the dense product every engine ran before quantization
existed, and what runs when no method is configured.
"""
import torch
from torch import nn

from nanovllm.kernels.cpu_gemm import dense_linear


def set_shard_tags(param: nn.Parameter, output_dim: int | None, input_dim: int | None,
                   shard_unit: int = 1) -> nn.Parameter:
    """Tag `param` with how it is split with its layer (see the module docstring)."""
    param.output_dim, param.input_dim, param.shard_unit = output_dim, input_dim, shard_unit
    return param


class LinearMethod:
    """How one linear layer stores its weight and computes its product."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once per layer after all weights are loaded (checkpoint or dummy)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def takes_quantized_input(self, layer: nn.Module) -> bool:
        """Whether `apply` takes its input quantized by the layer before it (fp8.py's
        `QuantizedActivation`), asked once after loading (layers/quantization/__init__.py)."""
        return False

    @property
    def is_dense(self) -> bool:
        """True when `layer.weight` is a plain [out, in] float matrix that layout changes
        (the CPU's column-major re-layout) may rewrite."""
        return False

    @property
    def own_kernel_max_rows(self) -> int:
        """Batches of up to this many tokens run the method's own kernel (int4, int8) and never
        read a dense `layer.weight`; 0 when every batch reads it."""
        return 0


class UnquantizedLinearMethod(LinearMethod):
    """A dense weight in the engine's dtype; the product is `F.linear` (on the CPU, oneDNN's
    on a packed copy for batches: kernels/cpu_gemm.py; on the GPU, batches of a few rows by
    kernels/triton_skinny_gemm.py)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        layer.register_parameter("weight", set_shard_tags(weight, output_dim=0, input_dim=1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            from nanovllm.kernels import triton_skinny_gemm
            if triton_skinny_gemm.applies(x, layer.weight):
                return triton_skinny_gemm.skinny_linear(x, layer.weight, bias)
        return dense_linear(x, layer.weight, bias, getattr(layer, "packed_weight", None),
                            getattr(layer, "int8_weight", None))

    @property
    def is_dense(self) -> bool:
        return True


def is_unquantized(layer: nn.Module) -> bool:
    """Whether a linear layer runs `UnquantizedLinearMethod` itself. Methods built on it (GGUF,
    CPU int weights) answer False: they keep other weights beside or instead of a plain one, and
    a product fused around the layer's weight would skip what their `apply` does."""
    return type(layer.quant_method) is UnquantizedLinearMethod


class FusedMoEMethod:
    """How one mixture-of-experts layer stores its experts and runs them: the experts'
    counterpart of `LinearMethod` (layers/fused_moe.py has the dense one)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        """Register the experts' parameters: this rank's `intermediate_size` of each of `num_experts`."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once per layer after all weights are loaded (checkpoint or dummy)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden], topk_weights/ids [num_tokens, top_k] -> [num_tokens, hidden]."""
        raise NotImplementedError


class QuantizationConfig:
    """One engine's quantization: which `LinearMethod` each linear layer gets.

    Subclasses are registered by name (`register_quantization` in this package) and built
    by `from_config` from the checkpoint's `quantization_config` dict (an empty dict when
    the option asks to quantize an unquantized checkpoint at load).
    """
    name: str = ""

    @classmethod
    def from_config(cls, quant_config: dict) -> "QuantizationConfig":
        raise NotImplementedError

    def get_linear_method(self, layer: nn.Module) -> LinearMethod:
        raise NotImplementedError

    def get_moe_method(self, layer: nn.Module) -> FusedMoEMethod:
        """The method of a mixture-of-experts layer; a config without one refuses the model."""
        raise ValueError(f"quantization {self.name!r} has no method for mixture-of-experts layers")

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError when this method cannot run on `device` (e.g. fp8 before sm_89)."""

    def configure(self, device: torch.device, dtype_option: str) -> None:
        """Called once before the model is built, with its device and `Config.dtype` as given
        ("auto" or a name): a method may choose its kernels by them."""

    def keeps_q8_0_embedding(self) -> bool:
        """Whether a token embedding or LM head loaded from GGUF Q8_0 blocks keeps them
        (`q8_weight`, kernels/cpu_q8_0.py), asked as the model is built."""
        return False

    def process_model_after_loading(self, model: nn.Module) -> None:
        """Called once after every layer's `process_weights_after_loading`: what a method does
        across the model (e.g. the LM head, which is no linear layer)."""

    @classmethod
    def overrides(cls, checkpoint_method: str) -> bool:
        """True when this method, asked for by name, may load a checkpoint quantized with
        `checkpoint_method` (e.g. gguf_dequant a GGUF file); otherwise the names must agree."""
        return False
