"""The calls a compiled CPU forward pass keeps opaque: each linear layer's product and each
attention layer's store + paged attention, as torch custom ops (vLLM's way of hiding its
attention from torch.compile).

torch.compile (engine/cpu_compile.py) traces the decoder with these calls in it and lets
Inductor fuse only what lies between them (residual adds, RMSNorm, RoPE, SiLU-and-mul, the
casts). Inside, the layer runs exactly as it does eagerly, choosing its kernel by the row
count at run time (int4, oneDNN-packed or column-major; a decode or a mixed step's
attention), which the compiler could otherwise only follow by recompiling per row count.

An op finds its layer by a key tensor: `register_layers` gives every linear and attention
layer a one-element tensor `opaque_key`, which the layer passes to its op. A tensor, not a
name: the compiler sees every decoder layer's call as the same graph with other inputs, so one
compiled layer serves all layers (a name would be a constant, one graph per layer). The op
looks the layer up by the key's address. The fake implementations give only the output's shape.
"""
import weakref

import torch
from torch import nn

# opaque_key.data_ptr() -> its layer; weak, so a registered model that is dropped is freed
_LAYERS: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()


def register_layers(model: nn.Module) -> None:
    """Give every linear and attention layer of `model` its `opaque_key`."""
    from nanovllm.layers.attention import Attention
    from nanovllm.layers.linear import LinearBase
    for module in model.modules():
        if isinstance(module, (LinearBase, Attention)) and not hasattr(module, "opaque_key"):
            module.opaque_key = torch.zeros(1, dtype=torch.int8)  # its address is the key
            _LAYERS[module.opaque_key.data_ptr()] = module


def unregister_layers(model: nn.Module) -> None:
    for module in model.modules():
        key = getattr(module, "opaque_key", None)
        if key is not None:
            del _LAYERS[key.data_ptr()]
            del module.opaque_key


# Defined through torch.library.Library rather than torch.library.custom_op: the call costs
# ~10 us less (5-10 us against 15-30 us over the kernel's own time, one thread; a step makes
# ~150 of them).
_lib = torch.library.Library("nanovllm", "FRAGMENT")
_lib.define("linear(Tensor x, Tensor key, int out_features) -> Tensor")
_lib.define("attention(Tensor q, Tensor k, Tensor v, Tensor key) -> Tensor")


def _linear(x: torch.Tensor, key: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [num_tokens, in] -> [num_tokens, out_features]: the keyed layer's product, as eager runs it."""
    layer = _LAYERS[key.data_ptr()]
    return layer.quant_method.apply(layer, x, layer.bias)


def _linear_fake(x: torch.Tensor, key: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """q [num_tokens, heads, d], k / v [num_tokens, kv_heads, d] -> [num_tokens, heads * d]: the keyed
    layer's K/V store into its cache and its paged attention over the step's context."""
    return _LAYERS[key.data_ptr()].forward_eager(q, k, v)


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


_lib.impl("linear", _linear, "CompositeExplicitAutograd")
_lib.impl("attention", _attention, "CompositeExplicitAutograd")
torch.library.register_fake("nanovllm::linear", _linear_fake, lib=_lib)
torch.library.register_fake("nanovllm::attention", _attention_fake, lib=_lib)
linear = torch.ops.nanovllm.linear.default
attention = torch.ops.nanovllm.attention.default
