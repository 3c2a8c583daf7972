"""Quantized weights, one mechanism: a registry of quantization configs, picked once.

`get_quantization_config(option, checkpoint_config)` turns the engine's `quantization`
option and the checkpoint's `quantization_config` (config.json) into one
`QuantizationConfig`, or None for dense weights. A method the registry does not know is a
`ValueError` naming it: a quantized checkpoint is never loaded as if it were dense.

The model is built inside `building_with(quant_config)` (as it is inside
`tensor_parallel`), and each linear layer asks `get_linear_method(layer)` for its method
when it is constructed, so model files know nothing of quantization. After the weights are
loaded, `process_weights_after_loading(model)` lets every method repack what it loaded, and
tells the layers that feed a method taking quantized input (fp8's rowwise products on the GPU)
to write it so.

Methods live in their own files in this package and register themselves with
`@register_quantization("name")`; this file imports each such module at its end, so the
registry is complete once the package is imported.
"""
from contextlib import contextmanager

from torch import nn

from nanovllm.layers.quantization.base import (FusedMoEMethod, LinearMethod, QuantizationConfig,
                                               UnquantizedLinearMethod, set_shard_tags)

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {}
_building: QuantizationConfig | None = None  # the config of the model being built


def register_quantization(name: str):
    """Class decorator: make a `QuantizationConfig` subclass selectable as `name`."""
    def register(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
        assert name not in QUANTIZATION_METHODS, f"quantization method {name!r} registered twice"
        cls.name = name
        QUANTIZATION_METHODS[name] = cls
        return cls
    return register


def check_quantization_option(option: str | None) -> None:
    """ValueError unless `option` is None or a registered method's name."""
    if option is not None and option not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {_known()}; got {option!r}")


def get_quantization_config(option: str | None, checkpoint_config: dict | None) -> QuantizationConfig | None:
    """The engine's quantization: the checkpoint's own method, or `option` applied at load.

    Args:
        option: `Config.quantization` (None: whatever the checkpoint says).
        checkpoint_config: the checkpoint's `quantization_config` dict, or None.
    Raises:
        ValueError: the checkpoint's method is unknown, or disagrees with `option`.
    """
    check_quantization_option(option)
    if checkpoint_config:
        method = checkpoint_config.get("quant_method")
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"the checkpoint's quantization_config has quant_method {method!r}, "
                             f"which is not supported (supported: {_known()})")
        if option is not None and option != method:
            if not QUANTIZATION_METHODS[option].overrides(method):
                raise ValueError(f"quantization={option!r} was asked for, but the checkpoint is "
                                 f"quantized with {method!r}")
            method = option  # e.g. gguf_dequant: the file's blocks loaded dequantized
        return QUANTIZATION_METHODS[method].from_config(checkpoint_config)
    return None if option is None else QUANTIZATION_METHODS[option].from_config({})


@contextmanager
def building_with(quant_config: QuantizationConfig | None):
    """Linear layers constructed inside this block take their methods from `quant_config`."""
    global _building
    outer, _building = _building, quant_config
    try:
        yield
    finally:
        _building = outer


def get_linear_method(layer: nn.Module) -> LinearMethod:
    """The method of a linear layer being constructed now."""
    if _building is None:
        return UnquantizedLinearMethod()
    return _building.get_linear_method(layer)


def keeps_q8_0_embedding() -> bool:
    """Whether the token embedding or LM head being constructed now keeps its GGUF Q8_0 blocks."""
    return _building is not None and _building.keeps_q8_0_embedding()


def get_moe_method(layer: nn.Module) -> FusedMoEMethod | None:
    """The method of a mixture-of-experts layer being constructed now; None: dense experts."""
    return None if _building is None else _building.get_moe_method(layer)


def process_weights_after_loading(model: nn.Module, quant_config: QuantizationConfig | None = None) -> None:
    """Let every layer's method turn its loaded weights into what it runs on, then the config
    do what it does across the model."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, (LinearMethod, FusedMoEMethod)):
            method.process_weights_after_loading(module)
    if quant_config is not None:
        quant_config.process_model_after_loading(model)
    _quantize_outputs_where_taken(model)


def _quantize_outputs_where_taken(model: nn.Module) -> None:
    """Each layer whose output only one linear layer reads (the pairs a model module lists in its
    `quantized_input_pairs()`) writes that output quantized when the linear's method takes it so
    (`LinearMethod.takes_quantized_input`): its `quantized_output` flag."""
    for module in model.modules():
        pairs = module.quantized_input_pairs() if hasattr(module, "quantized_input_pairs") else ()
        for producer, linear in pairs:
            producer.quantized_output = linear.quant_method.takes_quantized_input(linear)


def _known() -> str:
    return ", ".join(sorted(QUANTIZATION_METHODS)) or "none yet"


__all__ = ["FusedMoEMethod", "LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "QUANTIZATION_METHODS",
           "building_with", "check_quantization_option", "get_linear_method", "get_moe_method", "get_quantization_config",
           "keeps_q8_0_embedding",
           "process_weights_after_loading", "register_quantization", "set_shard_tags"]


from nanovllm.layers.quantization import fp8  # noqa: E402,F401  (registers "fp8", "compressed-tensors")
from nanovllm.layers.quantization import cpu_int, gguf  # noqa: E402,F401  (register gguf, gguf_dequant, int4, int8)
from nanovllm.layers.quantization import gguf_int8  # noqa: E402,F401  (registers gguf_int8)
