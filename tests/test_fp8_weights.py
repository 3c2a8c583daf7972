"""FP8 weights (layers/quantization/fp8.py) on CPU: loading each checkpoint format, the
product, tensor-parallel shards, and the errors.

The tiny qwen3 is written in each format by quantizing its linear weights here:
HF fine-grained FP8 (block scales `weight_scale_inv`; 32 x 32 blocks so that the tiny
shapes hold several), HF/AutoFP8 per-tensor `weight_scale`, and compressed-tensors per
channel and per tensor. The reference is the HF model with each linear weight replaced by
its dequantized fp32 value:

- every layer's loaded weight, dequantized, equals the checkpoint's exactly (q/k/v and
  gate/up merged; per-tensor scales spread over their own rows), also per TP=2 rank (the
  engine at TP=2 is tested with an fp8 KV cache in test_fp8_kv.py; with per-token
  activation scales a row-parallel layer's rounding differs between TP=1 and TP=2 by
  design, as in vLLM, so ids are not compared across TP sizes here);
- teacher-forced logprobs match the reference within a measured bound (activations are
  quantized per token at run time in the per-channel paths; the block path is exact);
- `quantization="fp8"` quantizes a dense checkpoint at load and is close to it.
"""
import copy
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from nanovllm import LLM, SamplingParams
from nanovllm.engine.model_source import ModelSource
from nanovllm.layers import quantization as q
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.quantization import fp8
from nanovllm.models.registry import get_model_class
from nanovllm.utils.loader import iter_safetensors, load_named_weights
from nanovllm.utils.parallel import tensor_parallel
from tiny_models import random_prompts

BLOCK = 32
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = {
    "hf-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                 "weight_block_size": [BLOCK, BLOCK]},
    "hf-tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "ct-channel": None, "ct-tensor": None,  # compressed-tensors: filled in by _ct_config
}
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256, num_kvcache_blocks=64)
TEACHER = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
# |logprob - reference| over 232 prompt tokens of the tiny qwen3 (initializer 0.2: large
# activations), measured max / mean: block 4.8e-6 / 9.6e-7 (weights dequantized, activations
# not rounded); hf-tensor and ct-tensor 0.54 / 0.105, ct-channel 0.47 / 0.118 (activations
# rounded to e4m3 per token too); dense weights quantized at load, against the dense model,
# 0.73 / 0.176. Bounds (max, mean) about 1.5x those:
LOGPROB_ATOL = {"hf-block": (1e-4, 1e-5), "hf-tensor": (0.8, 0.16), "ct-channel": (0.8, 0.18),
                "ct-tensor": (0.8, 0.16), "dense-at-load": (1.1, 0.26)}


def _ct_config(strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "symmetric": True, "dynamic": True}}}}


def _quantize(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """One linear weight [out, in] in `fmt`: {suffix: tensor}."""
    if fmt == "hf-block":
        out, inp = w.shape
        blocks = w.view(out // BLOCK, BLOCK, inp // BLOCK, BLOCK)
        scale = blocks.abs().amax((1, 3)) / fp8.FP8_MAX                      # [out/B, in/B]
        full = fp8.expand_block_scales(scale, (BLOCK, BLOCK), w.shape)
        return {"weight": (w / full).to(fp8.FP8_DTYPE), "weight_scale_inv": scale}
    if fmt.endswith("tensor"):
        scale = w.abs().amax() / fp8.FP8_MAX
        return {"weight": (w / scale).to(fp8.FP8_DTYPE), "weight_scale": scale.reshape(1 if fmt[:2] == "ct" else ())}
    weight, scale = fp8.quantize_rows(w)
    return {"weight": weight, "weight_scale": scale}


def _dequantize(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    w = tensors["weight"].float()
    if "weight_scale_inv" in tensors:
        return w * fp8.expand_block_scales(tensors["weight_scale_inv"], (BLOCK, BLOCK), w.shape)
    scale = tensors["weight_scale"]
    return w * (scale if scale.numel() > 1 else scale.reshape(()))


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    """checkpoints(fmt) -> (dir, HF model with the dequantized weights, {name: dequantized})."""
    src, hf = tiny_model("qwen3")
    built = {}

    def get(fmt: str):
        if fmt in built:
            return built[fmt]
        path = str(tmp_path_factory.mktemp(f"fp8-{fmt}"))
        state, deq = {}, {}
        for name, t in hf.state_dict().items():
            if name.rsplit(".", 2)[-2] in LINEAR and name.endswith(".weight"):
                parts = _quantize(t, fmt)
                state.update({name[:-len("weight")] + k: v.contiguous() for k, v in parts.items()})
                deq[name] = _dequantize(parts)
            else:
                state[name] = t.contiguous()
        state.pop("lm_head.weight", None)  # tied
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        config = json.load(open(os.path.join(src, "config.json")))
        config["quantization_config"] = FORMATS[fmt] or _ct_config(fmt.split("-")[1])
        json.dump(config, open(os.path.join(path, "config.json"), "w"))
        ref = copy.deepcopy(hf)
        ref.load_state_dict({**hf.state_dict(), **deq})
        built[fmt] = path, ref, deq
        return built[fmt]
    return get


def _prompt_logprobs(llm: LLM, prompts) -> torch.Tensor:
    out = []
    for o in llm.generate(prompts, TEACHER, use_tqdm=False):
        out += [entry[t].logprob for t, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
    return torch.tensor(out)


@torch.inference_mode()
def _hf_prompt_logprobs(hf, prompts) -> torch.Tensor:
    out = []
    for p in prompts:
        logprobs = hf(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1)
        out += logprobs.gather(1, torch.tensor(p[1:])[:, None])[:, 0].tolist()
    return torch.tensor(out)


def _dequantized_layers(model) -> dict[str, torch.Tensor]:
    """Each fp8 linear layer's weight as it multiplies, fp32.  # name -> [out, in]"""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LinearBase) and isinstance(m.quant_method, fp8.Fp8LinearMethod):
            assert m.weight.dtype == fp8.FP8_DTYPE and not m.quant_method.is_dense
            if m.quant_method.source == "block":
                out[name] = _dequantize({"weight": m.weight, "weight_scale_inv": m.weight_scale_inv})
            else:
                out[name] = m.weight.float() * m.weight_scale.reshape(-1, 1)
    return out


def _expected_merged(deq: dict, layer: int, rank: int = 0, tp: int = 1) -> dict[str, torch.Tensor]:
    """What qkv_proj and gate_up_proj of `layer` hold on `rank`, from the dequantized checkpoint."""
    a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
    def part(name: str, dim: int = 0) -> torch.Tensor:
        return deq[name + ".weight"].chunk(tp, dim)[rank]
    return {a + "qkv_proj": torch.cat([part(a + "q_proj"), part(a + "k_proj"), part(a + "v_proj")]),
            a + "o_proj": part(a + "o_proj", 1),
            m + "gate_up_proj": torch.cat([part(m + "gate_proj"), part(m + "up_proj")]),
            m + "down_proj": part(m + "down_proj", 1)}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_checkpoint_format_loads_exactly_and_matches_its_dequantized_reference(checkpoints, fmt):
    path, ref, deq = checkpoints(fmt)
    llm = LLM(path, **ENGINE)
    model = llm.llm_engine.model_runner.model
    loaded = _dequantized_layers(model)
    assert len(loaded) == 4 * 2  # four linear layers in each of two decoder layers
    for layer in range(2):
        for name, expected in _expected_merged(deq, layer).items():
            assert torch.equal(loaded[name], expected), name
    prompts = random_prompts([40, 75, 120], seed=4)
    diff = (_prompt_logprobs(llm, prompts) - _hf_prompt_logprobs(ref, prompts)).abs()
    max_atol, mean_atol = LOGPROB_ATOL[fmt]
    assert diff.max() < max_atol and diff.mean() < mean_atol, f"max {diff.max():.2e}, mean {diff.mean():.2e}"


def test_quantization_fp8_quantizes_a_dense_checkpoint_at_load(tiny_model):
    path, hf = tiny_model("qwen3")
    llm = LLM(path, quantization="fp8", **ENGINE)
    model = llm.llm_engine.model_runner.model
    loaded = _dequantized_layers(model)
    deq = {k: v for k, v in hf.state_dict().items()}
    expected = _expected_merged(deq, 0)
    for name, w in expected.items():  # per-channel e4m3: each weight within 1/16 of its row's max
        err = (loaded[name] - w).abs().max(1).values / w.abs().max(1).values
        assert (err <= 2 ** -4).all(), name
        assert loaded[name].shape == w.shape
    prompts = random_prompts([40, 75, 120], seed=4)
    diff = (_prompt_logprobs(llm, prompts) - _hf_prompt_logprobs(hf, prompts)).abs()
    max_atol, mean_atol = LOGPROB_ATOL["dense-at-load"]
    assert diff.max() < max_atol and diff.mean() < mean_atol, f"max {diff.max():.2e}, mean {diff.mean():.2e}"


@pytest.mark.parametrize("fmt", ["hf-block", "ct-tensor", "ct-channel"])
def test_tp2_ranks_hold_their_shards_of_weights_and_scales(checkpoints, fmt):
    path, _, deq = checkpoints(fmt)
    model_config = ModelSource.resolve(path).model_config()
    quant_config = q.get_quantization_config(None, model_config.quantization_config)
    for rank in range(2):
        with tensor_parallel(rank, 2), q.building_with(quant_config):
            model = get_model_class(model_config.architecture)(model_config, 256)
        load_named_weights(model, iter_safetensors(path))
        q.process_weights_after_loading(model)
        loaded = _dequantized_layers(model)
        for layer in range(2):
            for name, expected in _expected_merged(deq, layer, rank, 2).items():
                assert torch.equal(loaded[name], expected), (rank, name)


# ---- errors -------------------------------------------------------------------------------

def _with_config(src: str, dst, quantization_config: dict, drop: str | None = None, reshape: str | None = None):
    os.makedirs(dst)
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = quantization_config
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    state = {name: sl[...] for name, sl in iter_safetensors(src)}
    if drop:
        del state[drop]
    if reshape:  # a scale of the wrong shape
        state[reshape] = torch.ones(3)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("change,message", [
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}, "left unquantized.*down_proj"),
    ({"weight_block_size": [32]}, "weight_block_size"),
])
def test_unsupported_hf_fp8_configs_are_named(checkpoints, tmp_path, change, message):
    path, _, _ = checkpoints("hf-block")
    with pytest.raises(ValueError, match=message):
        LLM(_with_config(path, tmp_path / "m", {**FORMATS["hf-block"], **change}), **ENGINE)


def test_unsupported_compressed_tensors_schemes_are_named(checkpoints, tmp_path):
    path, _, _ = checkpoints("ct-channel")
    int4 = _ct_config("channel")
    int4["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4, strategy="group")
    with pytest.raises(ValueError, match="scheme not supported.*int 4-bit group"):
        LLM(_with_config(path, tmp_path / "a", int4), **ENGINE)
    static = _ct_config("channel")
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(ValueError, match="static input scales"):
        LLM(_with_config(path, tmp_path / "b", static), **ENGINE)


def test_missing_and_misshaped_scales_name_the_tensor(checkpoints, tmp_path):
    path, _, _ = checkpoints("hf-block")
    with pytest.raises(ValueError, match=r"missing weights: .*model\.layers\.0\.mlp\.down_proj\.weight_scale_inv"):
        LLM(_with_config(path, tmp_path / "a", FORMATS["hf-block"],
                         drop="model.layers.0.mlp.down_proj.weight_scale_inv"), **ENGINE)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight_scale_inv"):
        LLM(_with_config(path, tmp_path / "b", FORMATS["hf-block"],
                         reshape="model.layers.1.self_attn.k_proj.weight_scale_inv"), **ENGINE)
    path, _, _ = checkpoints("ct-tensor")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight_scale"):
        LLM(_with_config(path, tmp_path / "c", _ct_config("tensor"),
                         reshape="model.layers.0.self_attn.q_proj.weight_scale"), **ENGINE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton per-token quantizer runs on a GPU")
def test_triton_quantize_rows_matches_torch():
    from nanovllm.kernels import triton_fp8
    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16) * 3
    x[3] = 0  # an all-zero row
    got, got_scale = triton_fp8.quantize_rows(x, fp8.FP8_DTYPE, fp8.MIN_SCALE)
    expected_scale = (x.abs().amax(1, keepdim=True).float() / fp8.FP8_MAX).clamp_min(fp8.MIN_SCALE)
    torch.testing.assert_close(got_scale, expected_scale, rtol=0, atol=0)
    expected = (x.float() / expected_scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
    # equal, up to one e4m3 step where the kernel's fp32 division rounds the other way
    differ = got.view(torch.uint8) != expected.view(torch.uint8)
    assert differ.float().mean() < 1e-3
    assert ((got.view(torch.uint8).int() - expected.view(torch.uint8).int()).abs() <= 1).all()


def _rowwise_scaled_mm_reference(x_fp8, x_scale, w_fp8, w_scale) -> torch.Tensor:
    """torch's own rowwise `_scaled_mm` in fp32: the CPU's where it takes rowwise scales, else
    CUDA's (bf16 out only there, so compared at bf16's tolerance either way below); skips where
    neither exists."""
    if fp8._cpu_rowwise_scaled_mm():
        return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.float32)
    if not torch.cuda.is_available():
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only and there is no GPU")
    cuda = [t.cuda() for t in (x_fp8, x_scale, w_fp8, w_scale)]
    return torch._scaled_mm(cuda[0], cuda[2].t(), scale_a=cuda[1], scale_b=cuda[3], out_dtype=torch.bfloat16).float().cpu()


def test_cpu_fallback_without_rowwise_scaled_mm_matches_it(monkeypatch):
    """Where torch's CPU `_scaled_mm` takes per-tensor scales only (torch 2.11), the product of the
    dequantized operands stands in: the same values as the rowwise `_scaled_mm` within fp32 summation
    order, rounded once to the output dtype."""
    g = torch.Generator().manual_seed(4)
    x_fp8, x_scale = fp8.quantize_rows(torch.randn(5, 64, generator=g) * 3)
    w_fp8, w_scale = fp8.quantize_rows(torch.randn(32, 64, generator=g) * 0.05)  # CUDA's: sizes of 16s
    w_scale = w_scale.reshape(1, -1).contiguous()
    expected = _rowwise_scaled_mm_reference(x_fp8, x_scale, w_fp8, w_scale)
    fp32_reference = fp8._cpu_rowwise_scaled_mm()
    monkeypatch.setattr(fp8, "_cpu_rowwise_scaled_mm", lambda: False)
    for dtype in (torch.float32, torch.bfloat16):
        got = fp8._rowwise_product(x_fp8, x_scale, w_fp8, w_scale, dtype)
        assert got.dtype == dtype
        exact = dtype == torch.float32 and fp32_reference
        torch.testing.assert_close(got.float(), expected, rtol=1e-5 if exact else 2 ** -7, atol=1e-5)
