"""The quantization registry: choosing a method, refusing unknown ones, and sharding
a method's extra tensors (scales) with their weights under tensor parallelism.

The sharding tests register a small test method: an int8 weight with a per-output-channel
scale (`weight_scale` [out, 1]) and, for a block-scaled variant, one scale per 4x4 block
(`shard_unit` 4). Each rank's tensors must be exactly its slice of the checkpoint's.
"""
import json

import pytest
import torch
from torch import nn

from nanovllm import LLM
from nanovllm.config import Config
from nanovllm.layers import quantization as q
from nanovllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear)
from nanovllm.utils.parallel import tensor_parallel
from tiny_models import build_tiny_model

TP = 2
BLOCK = 4  # the block-scaled test method's block edge


class _ScaledInt8Method(q.LinearMethod):
    """int8 weight, one fp32 scale per output channel, or per BLOCK x BLOCK block."""

    def __init__(self, block: int | None):
        self.block = block

    def create_weights(self, layer, input_size, output_size, params_dtype):
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.int8), requires_grad=False)
        layer.register_parameter("weight", q.set_shard_tags(weight, 0, 1))
        if self.block is None:
            scale = nn.Parameter(torch.empty(output_size, 1), requires_grad=False)
            layer.register_parameter("weight_scale", q.set_shard_tags(scale, 0, None))
        else:
            scale = nn.Parameter(torch.empty(-(-output_size // self.block), -(-input_size // self.block)),
                                 requires_grad=False)
            layer.register_parameter("weight_scale", q.set_shard_tags(scale, 0, 1, shard_unit=self.block))

    def apply(self, layer, x, bias):
        raise AssertionError("not run in these tests")


class _ScaledInt8Config(q.QuantizationConfig):
    def __init__(self, block):
        self.block = block

    @classmethod
    def from_config(cls, quant_config):
        return cls(quant_config.get("block"))

    def get_linear_method(self, layer):
        return _ScaledInt8Method(self.block)


@pytest.fixture
def test_method():
    q.register_quantization("test-int8")(_ScaledInt8Config)
    yield "test-int8"
    del q.QUANTIZATION_METHODS["test-int8"]


def _checkpoint(out_features: int, in_features: int, block: int | None, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    scale_shape = (out_features, 1) if block is None else (out_features // block, in_features // block)
    return weight, torch.rand(scale_shape, generator=g)


def _build(layer_cls, rank, quant_config, *args):
    with tensor_parallel(rank, TP), q.building_with(quant_config):
        return layer_cls(*args)


@pytest.mark.parametrize("block", [None, BLOCK], ids=["per-channel", "block"])
def test_column_and_row_layers_shard_scales_with_their_weights(test_method, block):
    cfg = q.get_quantization_config(test_method, None) if block is None else _ScaledInt8Config(block)
    weight, scale = _checkpoint(16, 8, block, seed=0)
    for rank in range(TP):
        col = _build(ColumnParallelLinear, rank, cfg, 8, 16)
        col.weight.weight_loader(col.weight, weight)
        col.weight_scale.weight_loader(col.weight_scale, scale)
        rows = slice(rank * 8, (rank + 1) * 8)
        assert torch.equal(col.weight, weight[rows])
        assert torch.equal(col.weight_scale, scale[rows] if block is None else scale[rank * 2:(rank + 1) * 2])

        row = _build(RowParallelLinear, rank, cfg, 16, 8)
        weight_t, scale_t = _checkpoint(8, 16, block, seed=1)
        row.weight.weight_loader(row.weight, weight_t)
        row.weight_scale.weight_loader(row.weight_scale, scale_t)
        assert torch.equal(row.weight, weight_t[:, rows])
        # per-channel scales follow the outputs, which a row-parallel layer does not split
        assert torch.equal(row.weight_scale, scale_t if block is None else scale_t[:, rank * 2:(rank + 1) * 2])


@pytest.mark.parametrize("block", [None, BLOCK], ids=["per-channel", "block"])
def test_packed_layers_place_each_part_and_its_scales(block):
    cfg = _ScaledInt8Config(block)
    gate, gate_scale = _checkpoint(16, 8, block, seed=2)
    up, up_scale = _checkpoint(16, 8, block, seed=3)
    for rank in range(TP):
        layer = _build(MergedColumnParallelLinear, rank, cfg, 8, [16, 16])
        for shard_id, (w, s) in enumerate([(gate, gate_scale), (up, up_scale)]):
            layer.weight.weight_loader(layer.weight, w, shard_id)
            layer.weight_scale.weight_loader(layer.weight_scale, s, shard_id)
        rows = slice(rank * 8, (rank + 1) * 8)
        assert torch.equal(layer.weight, torch.cat([gate[rows], up[rows]]))
        srows = rows if block is None else slice(rank * 2, (rank + 1) * 2)
        assert torch.equal(layer.weight_scale, torch.cat([gate_scale[srows], up_scale[srows]]))


def test_qkv_scales_follow_heads():
    cfg = _ScaledInt8Config(None)
    d, heads, kv_heads = 4, 4, 2
    parts = {name: _checkpoint(n * d, 8, None, seed=i)
             for i, (name, n) in enumerate([("q", heads), ("k", kv_heads), ("v", kv_heads)])}
    for rank in range(TP):
        layer = _build(QKVParallelLinear, rank, cfg, 8, d, heads, kv_heads)
        for name, (w, s) in parts.items():
            layer.weight.weight_loader(layer.weight, w, name)
            layer.weight_scale.weight_loader(layer.weight_scale, s, name)
        q_rows, kv_rows = slice(rank * 8, (rank + 1) * 8), slice(rank * 4, (rank + 1) * 4)
        expected = torch.cat([parts["q"][1][q_rows], parts["k"][1][kv_rows], parts["v"][1][kv_rows]])
        assert torch.equal(layer.weight_scale, expected)


def test_a_block_that_straddles_the_rank_boundary_is_an_error():
    cfg = _ScaledInt8Config(BLOCK)
    weight, scale = _checkpoint(20, 8, BLOCK, seed=4)  # 10 rows per rank: rank 1 starts inside block 2
    layer = _build(ColumnParallelLinear, 1, cfg, 8, 20)
    with pytest.raises(ValueError, match="inside a block of 4"):
        layer.weight_scale.weight_loader(layer.weight_scale, scale)


def test_unknown_quantization_option_is_rejected_by_name():
    with pytest.raises(ValueError, match="quantization must be one of .*got 'int3'"):
        Config(model="x", quantization="int3")


def test_option_must_match_the_checkpoint_method(test_method):
    q.register_quantization("test-other")(type("_Other", (_ScaledInt8Config,), {}))
    try:
        with pytest.raises(ValueError, match="checkpoint is quantized with 'test-other'"):
            q.get_quantization_config(test_method, {"quant_method": "test-other"})
        assert q.get_quantization_config(None, {"quant_method": "test-other"}).name == "test-other"
    finally:
        del q.QUANTIZATION_METHODS["test-other"]


def test_a_checkpoint_with_an_unknown_method_is_refused_not_loaded_dense(tmp_path):
    build_tiny_model("llama", str(tmp_path))
    config_path = tmp_path / "config.json"
    hf = json.loads(config_path.read_text())
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4}
    config_path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="quant_method 'awq', which is not supported"):
        LLM(str(tmp_path), dtype="float32", num_kvcache_blocks=16, skip_tokenizer_init=True)


def test_dense_layers_get_the_unquantized_method():
    layer = ColumnParallelLinear(8, 16)
    assert isinstance(layer.quant_method, q.UnquantizedLinearMethod)
    assert layer.weight.output_dim == 0 and layer.weight.input_dim == 1
