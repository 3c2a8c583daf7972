"""Mixture of experts (Qwen3-MoE, Mixtral) beyond the family-parametrized tests.

The tiny MoE models are families of tests/tiny_models.py, so HF parity in every engine
mode (test_parity.py), TP=2 and each rank's shard (test_tp.py), and the GPU tests cover
them like the dense families. Here:
- config reading: the expert fields, Mixtral's missing window, and what is refused (shared
  experts, other routing, moe_intermediate_size not splittable, quantized experts);
- GGUF: qwen3moe files and llama files with experts (stacked `ffn_*_exps` and older
  per-expert `ffn_*.E` tensors) load exactly what the HF checkpoint holds, and, quantized,
  give the greedy ids of the HF model holding the file's dequantized weights;
- the packed experts from every checkpoint layout are the same tensors.
"""
import copy
import json
import os

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.model_source import ModelSource
from nanovllm.model_config import ModelConfig
from nanovllm.models.registry import get_model_class
from nanovllm.utils.loader import iter_safetensors, load_named_weights
from tiny_models import build_tiny_model, hf_greedy, random_prompts

NEW_TOKENS = 32
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=64)


def _hf_config(family: str, tiny_model) -> dict:
    with open(os.path.join(tiny_model(family)[0], "config.json")) as f:
        return json.load(f)


# ---- config reading -------------------------------------------------------------------

def test_expert_fields_are_read(tiny_model):
    qwen = ModelConfig.from_hf(_hf_config("qwen3moe", tiny_model))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.norm_topk_prob,
            qwen.qk_norm) == (8, 3, 64, False, True)
    assert [qwen.is_moe_layer(i) for i in range(3)] == [True, False, True]
    mixtral = ModelConfig.from_hf(_hf_config("mixtral", tiny_model))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob, mixtral.sliding_window) == (4, 2, 64, True, None)
    assert not mixtral.has_dense_layers


def test_decoder_sparse_step_picks_the_sparse_layers(tiny_model):
    hf = {**_hf_config("qwen3moe", tiny_model), "num_hidden_layers": 6, "decoder_sparse_step": 2,
          "mlp_only_layers": [3]}
    cfg = ModelConfig.from_hf(hf)
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == [1, 5]


def test_mixtral_window_applies_only_when_given(tiny_model):
    hf = _hf_config("mixtral", tiny_model)
    del hf["sliding_window"]
    assert ModelConfig.from_hf(hf).sliding_window is None  # MistralConfig's 4096 is not Mixtral's
    assert ModelConfig.from_hf({**hf, "sliding_window": 256}).sliding_window == 256


@pytest.mark.parametrize("family, update, message", [
    ("qwen3moe", {"shared_expert_intermediate_size": 128}, r"shared experts \(shared_expert_intermediate_size=128\)"),
    ("qwen3moe", {"n_shared_experts": 2}, r"shared experts \(n_shared_experts=2\)"),
    ("mixtral", {"scoring_func": "sigmoid"}, r"routing function \(scoring_func\) 'sigmoid' is not supported"),
    ("qwen3moe", {"topk_method": "group_limited_greedy", "n_group": 4}, "grouped top-k routing"),
    ("qwen3moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok must be in \[1, num_experts=8\], got 9"),
    ("mixtral", {"num_experts_per_tok": 0}, r"num_experts_per_tok must be in \[1, num_experts=4\], got 0"),
])
def test_unsupported_expert_configs_are_named(tiny_model, family, update, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**_hf_config(family, tiny_model), **update})


def test_moe_intermediate_size_that_does_not_split_is_rejected_before_any_process_starts(tmp_path):
    import multiprocessing as mp
    build_tiny_model("mixtral", str(tmp_path), intermediate_size=66)  # 66 / 4 ranks
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(66\) is not divisible by "
                                         r"tensor_parallel_size \(4\)"):
        LLM(str(tmp_path), tensor_parallel_size=4, device="cpu", **ENGINE)
    assert not mp.active_children()


def test_quantization_without_an_expert_method_refuses_the_model(tiny_model):
    from nanovllm.layers.quantization import QuantizationConfig, building_with
    cfg = ModelSource.resolve(tiny_model("mixtral")[0]).model_config()

    class DenseLinearsOnly(QuantizationConfig):
        name = "dense-linears-only"

        def get_linear_method(self, layer):
            from nanovllm.layers.quantization import UnquantizedLinearMethod
            return UnquantizedLinearMethod()
    with building_with(DenseLinearsOnly()), pytest.raises(
            ValueError, match="quantization 'dense-linears-only' has no method for mixture-of-experts layers"):
        get_model_class(cfg.architecture)(cfg, 256)


# ---- checkpoint layouts ---------------------------------------------------------------

def _load(path: str, weights) -> dict[str, torch.Tensor]:
    cfg = ModelSource.resolve(path).model_config()
    model = get_model_class(cfg.architecture)(cfg, 256)
    load_named_weights(model, weights)
    return dict(model.named_parameters())


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_hub_and_transformers5_layouts_pack_the_same_experts(tiny_model, family):
    """Per-expert safetensors (the hub's layout) and transformers 5's whole-layer tensors."""
    path, hf = tiny_model(family)
    from_hub = _load(path, iter_safetensors(path))
    from_memory = _load(path, hf.state_dict().items())
    assert from_hub.keys() == from_memory.keys()
    for name in from_hub:
        assert torch.equal(from_hub[name], from_memory[name]), name
    gate_up = hf.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(from_hub["model.layers.0.mlp.experts.w13_weight"], gate_up)


# ---- GGUF -----------------------------------------------------------------------------

WRITE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "F32")
GGUF_LAYER_NAMES = {  # HF hub fragment -> llama.cpp's, written out independently of the loader's table
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
}
EXPERT_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
GGUF_FILES = {  # case -> (family, GGUF architecture, one tensor per expert)
    "qwen3moe": ("qwen3moe", "qwen3moe", False),
    "mixtral-exps": ("mixtral", "llama", False),
    "mixtral-per-expert": ("mixtral", "llama", True),
}


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (llama files interleave Q/K rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(path: str, cfg, arch: str, per_expert: bool) -> dict[str, np.ndarray]:
    """llama.cpp's tensors of the HF checkpoint at `path` (hub names, per-expert tensors)."""
    out, experts = {}, {}  # experts: (layer, projection) -> {expert: array}
    for name, sl in iter_safetensors(path):
        data = sl[:].float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = data
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        if ".experts." in rest:
            _, expert, projection, _ = rest.rsplit(".", 3)
            experts.setdefault((layer, EXPERT_PROJECTIONS[projection]), {})[int(expert)] = data
            continue
        module = rest.removesuffix(".weight")
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            data = _permute_qk(data, cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads)
        out[f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.weight"] = data
    for (layer, projection), per in experts.items():
        if per_expert:
            out.update({f"blk.{layer}.ffn_{projection}.{e}.weight": a for e, a in per.items()})
        else:
            out[f"blk.{layer}.ffn_{projection}_exps.weight"] = np.stack([per[e] for e in sorted(per)])
    return out


def write_moe_gguf(hf_dir: str, hf_cfg, arch: str, per_expert: bool, path: str, quantize: bool) -> None:
    import gguf
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(hf_cfg.max_position_embeddings)
    w.add_embedding_length(hf_cfg.hidden_size)
    w.add_block_count(hf_cfg.num_hidden_layers)
    w.add_head_count(hf_cfg.num_attention_heads)
    w.add_head_count_kv(hf_cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(hf_cfg.rms_norm_eps)
    w.add_rope_freq_base(hf_cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(hf_cfg.vocab_size)
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_eos_token_id(1)
    w.add_expert_count(hf_cfg.num_local_experts)
    w.add_expert_used_count(hf_cfg.num_experts_per_tok)
    if arch == "qwen3moe":  # llama.cpp writes both; a llama (Mixtral) file has feed_forward_length only
        w.add_feed_forward_length(hf_cfg.intermediate_size)
        w.add_expert_feed_forward_length(hf_cfg.moe_intermediate_size)
    else:
        w.add_feed_forward_length(hf_cfg.intermediate_size)
    for i, (name, data) in enumerate(_gguf_tensors(hf_dir, hf_cfg, arch, per_expert).items()):
        qtype = gguf.GGMLQuantizationType[WRITE_TYPES[i % len(WRITE_TYPES)] if quantize and data.ndim >= 2
                                          else "F32"]
        if qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """moe_gguf(case, quantize) -> (gguf path, HF dir, HF model); GGUF has no dense layers
    between sparse ones, and llama.cpp renormalizes the top-k weights: the Qwen3-MoE is built so."""
    pytest.importorskip("gguf")  # not on the GPU machine
    built = {}

    def get(case: str, quantize: bool):
        if (case, quantize) not in built:
            family, arch, per_expert = GGUF_FILES[case]
            d = tmp_path_factory.mktemp(f"gguf-{case}")
            overrides = dict(mlp_only_layers=[], norm_topk_prob=True) if family == "qwen3moe" else {}
            hf = build_tiny_model(family, str(d / "hf"), **overrides)
            path = str(d / f"tiny-{case}.gguf")
            write_moe_gguf(str(d / "hf"), hf.config, arch, per_expert, path, quantize)
            built[case, quantize] = path, str(d / "hf"), hf
        return built[case, quantize]
    return get


@pytest.mark.parametrize("case", sorted(GGUF_FILES))
def test_moe_gguf_round_trips_the_checkpoint(moe_gguf, case):
    """Unquantized: the model loaded from the file holds exactly the HF checkpoint's weights."""
    from nanovllm.utils.gguf_loader import iter_gguf_weights
    path, hf_dir, _ = moe_gguf(case, quantize=False)
    gguf_cfg, hf_cfg = ModelSource.resolve(path).model_config(), ModelSource.resolve(hf_dir).model_config()
    fields = ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "qk_norm", "num_key_value_heads", "head_dim")
    assert [getattr(gguf_cfg, f) for f in fields] == [getattr(hf_cfg, f) for f in fields]
    ours, expected = _load(path, iter_gguf_weights(path)), _load(hf_dir, iter_safetensors(hf_dir))
    assert ours.keys() == expected.keys()
    for name in ours:
        assert torch.equal(ours[name], expected[name]), name


def _hf_state_from_gguf(path: str) -> dict[str, torch.Tensor]:
    """The file's dequantized weights under transformers 5's in-memory names (experts
    stacked as gate_up_proj [E, 2I, H] and down_proj [E, H, I])."""
    from nanovllm.utils.gguf_loader import iter_gguf_weights
    state, experts = {}, {}
    for name, t in iter_gguf_weights(path):
        if ".experts." not in name:
            state[name] = t
            continue
        prefix, rest = name.split(".experts.")
        parts = rest.split(".")  # [projection, weight] or [expert, projection, weight]
        if len(parts) == 3:
            experts.setdefault((prefix, parts[1]), {})[int(parts[0])] = t
        else:
            experts[prefix, parts[0]] = t
    for (prefix, projection), t in list(experts.items()):
        if isinstance(t, dict):
            experts[prefix, projection] = torch.stack([t[e] for e in sorted(t)])
    for prefix in {p for p, _ in experts}:
        state[f"{prefix}.experts.gate_up_proj"] = torch.cat([experts[prefix, "gate_proj"],
                                                             experts[prefix, "up_proj"]], dim=1)
        state[f"{prefix}.experts.down_proj"] = experts[prefix, "down_proj"]
    return state


@pytest.mark.parametrize("case", sorted(GGUF_FILES))
def test_quantized_moe_gguf_greedy_matches_hf_with_its_dequantized_weights(moe_gguf, case):
    """Quantized (Q8_0/Q4_0/Q4_1/F16/BF16/F32 mixed, experts included): the HF model the
    file came from, holding the file's dequantized weights, is the reference."""
    path, _, hf = moe_gguf(case, quantize=True)
    hf = copy.deepcopy(hf)
    missing, unexpected = hf.load_state_dict(_hf_state_from_gguf(path), strict=False)
    assert (missing, unexpected) == ([], [])
    prompts = random_prompts([5, 17, 33])
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(e)) > NEW_TOKENS // 4 for e in expected)  # varied continuations
    llm = LLM(path, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
