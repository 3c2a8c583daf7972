"""The calls a compiled CPU forward pass keeps opaque: each linear layer's product and each
attention layer's store + paged attention, as torch custom ops (vLLM's way of hiding its
attention from torch.compile).

torch.compile (engine/cpu_compile.py) traces the decoder with these calls in it and lets
Inductor fuse only what lies between them (residual adds, RMSNorm, RoPE, SiLU-and-mul, the
casts). Inside, the layer runs exactly as it does eagerly, choosing its kernel by the row
count at run time (int4, oneDNN-packed or column-major; a decode or a mixed step's
attention), which the compiler could otherwise only follow by recompiling per row count.

An op finds its layer by name: `register_layers` names every linear and attention layer of a
model (the model's id, then its module path, so two engines in one process do not collide).
The fake implementations give only the output's shape and dtype.
"""
import torch
from torch import nn

_LAYERS: dict[str, nn.Module] = {}


def register_layers(model: nn.Module, prefix: str) -> None:
    """Give every linear and attention layer of `model` its op name, `prefix.module_path`."""
    from nanovllm.layers.attention import Attention
    from nanovllm.layers.linear import LinearBase
    for path, module in model.named_modules():
        if isinstance(module, (LinearBase, Attention)):
            module.opaque_name = f"{prefix}.{path}"
            _LAYERS[module.opaque_name] = module


def unregister_layers(prefix: str) -> None:
    for name in [n for n in _LAYERS if n.startswith(prefix + ".")]:
        del _LAYERS[name]


# Defined through torch.library.Library rather than torch.library.custom_op: the call costs
# ~10 us less (5-10 us against 15-30 us over the kernel's own time, one thread; a step makes
# ~150 of them).
_lib = torch.library.Library("nanovllm", "FRAGMENT")
_lib.define("linear(Tensor x, str layer_name) -> Tensor")
_lib.define("attention(Tensor q, Tensor k, Tensor v, str layer_name) -> Tensor")


def _linear(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    """x [num_tokens, in] -> [num_tokens, out]: the named layer's product, as eager runs it."""
    layer = _LAYERS[layer_name]
    return layer.quant_method.apply(layer, x, layer.bias)


def _linear_fake(x: torch.Tensor, layer_name: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], _LAYERS[layer_name].output_size)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    """q [num_tokens, heads, d], k / v [num_tokens, kv_heads, d] -> [num_tokens, heads * d]: the named
    layer's K/V store into its cache and its paged attention over the step's context."""
    return _LAYERS[layer_name].forward_eager(q, k, v)


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


_lib.impl("linear", _linear, "CompositeExplicitAutograd")
_lib.impl("attention", _attention, "CompositeExplicitAutograd")
torch.library.register_fake("nanovllm::linear", _linear_fake, lib=_lib)
torch.library.register_fake("nanovllm::attention", _attention_fake, lib=_lib)
linear = torch.ops.nanovllm.linear.default
attention = torch.ops.nanovllm.attention.default
