"""CPU int8 products (kernels/cpu_int8_dynamic.py, quantization="gguf_int8").

- The product against the fp32 one within its measured error, each row on its own scale (a
  row of small values beside a large one keeps its precision), and the Hadamard rotation
  lowering the error of an input with an outlier channel.
- Which kernel runs at which rows: int8 from the weight's `min_rows`, the packed fp32 product
  below it.
- A tiny GGUF model under "gguf_int8": every linear layer and the LM head carry an int8 copy
  and no fp32 weight or packed copy a batch would not read; greedy ids equal the dense
  path's or part at a near-tie (each side's token in the other's top-5).
- Bad use is a ValueError naming it: a non-GGUF checkpoint, a bf16 engine, the GPU.
"""
import pytest
import torch

from nanovllm.kernels import cpu_gemm, cpu_int8_dynamic

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_int8_dynamic.can_run(), reason="this torch build has no FBGEMM")

OUT, IN = 96, 128
# measured (seeds 0-2): 0.95-1.6e-2 relative per row (without the rotation 4.6-5.3e-2, per tensor 0.6-0.99)
PRODUCT_RTOL = 3e-2
NEW_TOKENS = 12
TOP_K_CLOSE = 5
INIT_RANGE = 0.5  # sharper next-token distributions than tiny_models' 0.2 (fewer near-ties in 12 tokens)


def _operands(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(OUT, IN, generator=gen) * 0.05
    x = torch.randn(6, IN, generator=gen)
    x[0] *= 40  # one large row: per-tensor scales would leave the others a few levels
    x[:, 7] *= 25  # one outlier channel, as real activations have
    return w, x


def _row_errors(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (y - ref).norm(dim=1) / ref.norm(dim=1)  # [rows]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_product_matches_fp32_within_its_error(seed):
    w, x = _operands(seed)
    b = torch.randn(OUT)
    ref = x.double() @ w.double().t() + b.double()
    y = cpu_int8_dynamic.int8_linear(x, cpu_int8_dynamic.prepack(w, 1), b)
    errors = _row_errors(y.double(), ref)
    assert bool((errors < PRODUCT_RTOL).all()) and errors.min() > 0, errors


def test_rows_and_channels_keep_their_precision(monkeypatch):
    """Per-token scales keep the small rows beside the large one; the rotation spreads the
    outlier channel: turning either off makes the product clearly worse."""
    w, x = _operands()
    ref = (x.double() @ w.double().t())

    def worst(**patch) -> float:
        for name, value in patch.items():
            monkeypatch.setattr(cpu_int8_dynamic, name, value)
        return _row_errors(cpu_int8_dynamic.int8_linear(x, cpu_int8_dynamic.prepack(w, 1), None).double(),
                           ref).max().item()
    best = worst()
    assert worst(ROTATION_BLOCK=0) > 1.5 * best
    assert worst(PER_TOKEN=False) > 5 * best


def test_int8_runs_from_min_rows_and_packed_fp32_below():
    w, _ = _operands()
    int8, packed = cpu_int8_dynamic.prepack(w, 4), cpu_gemm.pack(w)
    for rows in (3, 4, 9):
        x = torch.randn(rows, IN)
        y = cpu_gemm.dense_linear(x, None, None, packed, int8)
        if rows >= 4:
            assert torch.equal(y, cpu_int8_dynamic.int8_linear(x, int8, None))
        else:
            torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)  # fp32, not int8's ~1e-2


# ---- a tiny GGUF model --------------------------------------------------------------------

def _write_tiny_llama_gguf(path: str) -> None:
    """A 2-layer Llama GGUF (llama.cpp's names; random weights): linear layers Q4_1 as in the
    embedded file, the rest F32."""
    from tiny_models import build_tiny_model
    hf = build_tiny_model("llama", path + ".hf", rope_scaling=None, num_key_value_heads=2, initializer_range=INIT_RANGE)
    cfg = hf.config
    w = gguf.GGUFWriter(path, "llama")
    for add, value in ((w.add_context_length, cfg.max_position_embeddings), (w.add_embedding_length, cfg.hidden_size),
                       (w.add_block_count, cfg.num_hidden_layers), (w.add_feed_forward_length, cfg.intermediate_size),
                       (w.add_head_count, cfg.num_attention_heads), (w.add_head_count_kv, cfg.num_key_value_heads),
                       (w.add_layer_norm_rms_eps, cfg.rms_norm_eps), (w.add_vocab_size, cfg.vocab_size),
                       (w.add_rope_freq_base, cfg.rope_parameters["rope_theta"]), (w.add_eos_token_id, 1)):
        add(value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for name, t in hf.state_dict().items():
        data = t.float().numpy()
        proj = name.split(".")[-2]
        if proj in heads:  # llama.cpp's interleaved rotary rows (convert_hf_to_gguf.py's permute)
            n = heads[proj]
            data = data.reshape(n, 2, data.shape[0] // n // 2, data.shape[1]).swapaxes(1, 2).reshape(data.shape)
        qtype = gguf.GGMLQuantizationType.Q4_1 if "proj" in name else gguf.GGMLQuantizationType.F32
        if qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, qtype)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(gguf_int8 engine, the dense engine: "gguf" with dtype float32, every weight dequantized)."""
    from nanovllm import LLM
    path = str(tmp_path_factory.mktemp("int8") / "tiny-llama.gguf")
    _write_tiny_llama_gguf(path)
    kwargs = dict(dtype="float32", max_model_len=128, num_kvcache_blocks=32, skip_tokenizer_init=True)
    return LLM(path, quantization="gguf_int8", **kwargs), LLM(path, **kwargs)


def test_every_layer_has_its_int8_copy_and_no_unread_fp32(engines):
    from nanovllm.layers.linear import LinearBase
    model = engines[0].llm_engine.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(layers) == 2 * 4
    assert all(m.int8_weight.min_rows == cpu_int8_dynamic.INT8_MIN_ROWS for m in layers + [model.lm_head])
    assert all(m.weight is None and not hasattr(m, "packed_weight") for m in layers)
    assert not hasattr(model.lm_head, "packed_weight")  # the head keeps the embedding's weight only
    dense = engines[1].llm_engine.model_runner.model
    assert not any(hasattr(m, "int8_weight") for m in dense.modules())


def test_greedy_ids_match_dense_or_part_at_a_near_tie(engines):
    from nanovllm import SamplingParams
    from tiny_models import random_prompts
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 9, 17, 30])]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_K_CLOSE)
    ours, ref = (llm.generate(prompts, params, use_tqdm=False) for llm in engines)
    for a, b in zip(ours, ref):
        x, y = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        assert len(set(y)) > 2
        if x != y:
            i = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
            assert y[i] in a.outputs[0].logprobs[i] and x[i] in b.outputs[0].logprobs[i], (i, x, y)


def test_bad_use_is_a_value_error(tmp_path):
    from nanovllm import LLM
    from nanovllm.layers.quantization import get_quantization_config
    from tiny_models import build_tiny_model
    config = get_quantization_config("gguf_int8", {"quant_method": "gguf"})
    with pytest.raises(ValueError, match="CPU only"):
        config.configure(torch.device("cuda"), "auto")
    with pytest.raises(ValueError, match="fp32"):
        config.configure(torch.device("cpu"), "bfloat16")
    build_tiny_model("llama", str(tmp_path))
    with pytest.raises(ValueError, match="GGUF files"):
        LLM(str(tmp_path), quantization="gguf_int8", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="'gguf_int9'"):
        LLM(str(tmp_path), quantization="gguf_int9", skip_tokenizer_init=True)
