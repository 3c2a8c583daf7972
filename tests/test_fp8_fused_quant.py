"""The RMSNorm and SiLU-and-mul that write the per-token fp8 input of the rowwise fp8 product
after them (kernels/triton_fused_quant.py, layers/quantization/fp8.py's QuantizedActivation).

- the kernels against the two launches they replace (triton_ops' RMSNorm / SiLU-and-mul, then
  triton_fp8.quantize_rows), bit for bit: fp8 values, scales and the new residual, over row
  counts 1 to 300, hidden sizes that are not powers of two, with and without the residual, an
  all-zero row (the MIN_SCALE floor); natively on a GPU (bf16 too) also near the torch
  reference. Without a GPU in the interpreter child (tests/triton_interpreter.py), fp16 and fp32
  only (it reads bf16 wrongly), and bit for bit only: its fp32 -> e4m3 cast is wrong where the
  rounding carries into the exponent (tests/test_fp8_kv_kernels.py), the same in both paths;
- what bit for bit rests on in the compiled RMSNorm, which the interpreter cannot see: its loads
  laid out as triton_ops.rms_norm's (so the sum of squares adds in the same order), checked by
  compiling both for sm_90 without a GPU; natively, 4096 rows at real hidden sizes;
- which products take their input quantized (`takes_quantized_input`);
- the engine: a tiny qwen3 / qwen2 (qkv bias) with `quantization="fp8"` gives the same greedy ids
  and prompt logprobs, bit for bit, with the fusion on and off (FUSED_ACTIVATION_QUANT), and with
  it on q/k/v, gate/up and down are handed quantized input, o not: on the GPU with CUDA graphs and
  eagerly; on the CPU through the same layers with the producers' torch steps, the products told
  to take quantized input there too.
"""
import gc
from types import SimpleNamespace

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.quantization import fp8
from tiny_models import random_prompts
from triton_interpreter import HAS_TRITON, INTERPRETED, RUN_HERE, OnGpu, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
CHILD_TIMEOUT_S = 300
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
ROWS, SIZES = [1, 7, 64, 300], [96, 1000]  # hidden or intermediate sizes: not powers of two
# (rows, size): every pair natively; under the interpreter, where 300 rows take ~1 s a test, each once
SHAPES = [(r, n) for r in ROWS for n in SIZES] if HAS_CUDA else list(zip(ROWS, SIZES * 2))
EPS = 1e-6
# the torch reference's norm differs from the kernel's by its 16-bit rounding (sums in another
# order); the fp8 rounding adds up to one e4m3 step (the kernel's fp32 division may round across a
# midpoint: test_fp8_weights.py): 2**-3 of the value, 2**-9 of the scale below e4m3's smallest normal
FP8_REL, FP8_SUBNORMAL = 2 ** -3, 2 ** -9
MIN_SCALE_F32 = torch.tensor(fp8.MIN_SCALE, dtype=torch.float32).item()
NORM_REL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="kernels run in this process")
def test_fused_quant_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _assert_near_reference(values: torch.Tensor, scale: torch.Tensor, reference: torch.Tensor, dtype) -> None:
    """values * scale is `reference` within the fp8 rounding (and the 16-bit rounding of the norm);
    natively only (the interpreter's cast: the module docstring)."""
    if not HAS_CUDA:
        return
    got, ref = (values.float() * scale).cpu(), reference.float().cpu()
    bound = ref.abs() * (FP8_REL + NORM_REL[dtype]) + scale.cpu() * FP8_SUBNORMAL + NORM_REL[dtype]
    assert ((got - ref).abs() <= bound).all(), f"max error {(got - ref).abs().max():.3g}"


@needs_kernels
@pytest.mark.parametrize("with_residual", [False, True], ids=["no-residual", "residual"])
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_quant_is_norm_then_quantize_rows(gen, dtype, rows, hidden, with_residual):
    from nanovllm.kernels import fused_ops, triton_fp8, triton_fused_quant, triton_ops
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(hidden, generator=gen).to(dtype)
    x[0] = 0 if residual is None else -residual[0]  # an all-zero row: the scale's floor
    x, weight = x.to(DEVICE), weight.to(DEVICE)
    residual = residual.to(DEVICE) if with_residual else None
    values, scale, new_residual = triton_fused_quant.rms_norm_per_token_quant(
        x, weight, EPS, residual, fp8.FP8_DTYPE, fp8.MIN_SCALE)
    out = triton_ops.rms_norm(x, weight, EPS, residual)
    normed, expected_residual = out if with_residual else (out, None)
    expected, expected_scale = triton_fp8.quantize_rows(normed, fp8.FP8_DTYPE, fp8.MIN_SCALE)
    assert _same_bits(values, expected), f"seed {gen.initial_seed()}"
    assert torch.equal(scale, expected_scale) and scale.shape == (rows, 1) and scale[0].item() == MIN_SCALE_F32
    if with_residual:
        assert torch.equal(new_residual, expected_residual)
    else:
        assert new_residual is None
    ref_in = x.cpu() + residual.cpu() if with_residual else x.cpu()
    _assert_near_reference(values, scale, fused_ops._rms_norm_torch(ref_in, weight.cpu(), EPS), dtype)


@pytest.mark.skipif(not HAS_CUDA, reason="the compiled kernels' layouts: natively only")
@pytest.mark.parametrize("hidden", [4096, 5120])
def test_rms_norm_quant_sums_squares_in_the_unfused_order(gen, hidden):
    """Many rows at real hidden sizes (Qwen3-8B's, and one of 8192 lanes): were the fused RMSNorm's sum
    of squares added in another order than triton_ops.rms_norm's (kernels/triton_fused_quant.py's
    docstring), an inverse rms an ulp off would move a bf16 output an ulp in a few percent of rows,
    and some of those an fp8 step; over 4096 rows several would."""
    from nanovllm.kernels import triton_fp8, triton_fused_quant, triton_ops
    rows = 4096
    x, residual = ((torch.randn(rows, hidden, generator=gen) * 3).to(torch.bfloat16).cuda() for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(torch.bfloat16).cuda()
    values, scale, _ = triton_fused_quant.rms_norm_per_token_quant(x, weight, EPS, residual, fp8.FP8_DTYPE,
                                                                   fp8.MIN_SCALE)
    normed, _ = triton_ops.rms_norm(x, weight, EPS, residual)
    expected, expected_scale = triton_fp8.quantize_rows(normed, fp8.FP8_DTYPE, fp8.MIN_SCALE)
    differ = (values.view(torch.uint8) != expected.view(torch.uint8)).any(1)
    assert not differ.any(), f"{int(differ.sum())} rows differ, seed {gen.initial_seed()}"
    assert torch.equal(scale, expected_scale)


def _bf16_load_layouts(fn, consts: dict, pointers: dict) -> set[str]:
    """The layouts of a kernel's bf16 loads, compiled for sm_90 (no GPU needed: Triton's own tools)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    num_warps, names = consts.pop("num_warps"), list(fn.arg_names)
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "eps" else "i32") for n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
               if n in pointers or n.startswith("stride") or n == "hidden"}  # as the engine's launches specialize
    ttgir = triton.compile(ASTSource(fn, signature, consts, aligned), target=GPUTarget("cuda", 90, 32),
                           # fused multiply-adds on, as every Triton the engine runs on compiles by default
                           options=dict(num_warps=num_warps, enable_fp_fusion=True)).asm["ttgir"]
    layouts = dict(re.findall(r"^(#blocked\d*) = (.*)$", ttgir, re.M))
    return {layouts[name] for name in re.findall(r"tt\.load .*!tt\.ptr<bf16>, (#blocked\d*)>", ttgir)}


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="compiles for the GPU: outside the interpreter child")
@pytest.mark.parametrize("block", [1024, 4096, 8192])
@pytest.mark.parametrize("with_residual", [False, True], ids=["no-residual", "residual"])
def test_fused_rms_norm_lays_a_row_out_as_the_unfused_one(with_residual, block):
    """The fused RMSNorm's loads get triton_ops.rms_norm's layout, hence its order of the sum of squares
    (kernels/triton_fused_quant.py's docstring): a 1-D fp8 store of the row would widen them to 16 elements
    a thread. Checked at hidden sizes around Qwen3's (4096), compiled for sm_90 without a GPU."""
    from nanovllm.kernels import triton_fused_quant, triton_ops
    common = dict(HAS_RESIDUAL=with_residual, BLOCK=block, PDL=False, num_warps=triton_ops.RMS_NORM_WARPS)
    bf16 = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", res_out_ptr="*bf16")
    fused = _bf16_load_layouts(triton_fused_quant._rms_norm_quant_kernel,
                               dict(common, FP8_MAX=fp8.FP8_MAX, MIN_SCALE=fp8.MIN_SCALE),
                               dict(bf16, out_ptr="*fp8e4nv", scale_ptr="*fp32"))
    unfused = _bf16_load_layouts(triton_ops._rms_norm_kernel, dict(common), dict(bf16, out_ptr="*bf16"))
    assert len(unfused) == 1 and fused == unfused, (fused, unfused)


@needs_kernels
@pytest.mark.parametrize("rows,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_quant_is_silu_and_mul_then_quantize_rows(gen, dtype, rows, d):
    from nanovllm.kernels import triton_fp8, triton_fused_quant, triton_ops
    x = (torch.randn(rows, 2 * d, generator=gen) * 3).to(dtype)
    x[0, :d] = 0  # silu(0) * up: an all-zero row
    x = x.to(DEVICE)
    values, scale = triton_fused_quant.silu_and_mul_per_token_quant(x, fp8.FP8_DTYPE, fp8.MIN_SCALE)
    expected, expected_scale = triton_fp8.quantize_rows(triton_ops.silu_and_mul(x), fp8.FP8_DTYPE, fp8.MIN_SCALE)
    assert _same_bits(values, expected), f"seed {gen.initial_seed()}"
    assert torch.equal(scale, expected_scale) and scale.shape == (rows, 1) and scale[0].item() == MIN_SCALE_F32
    gate, up = x.cpu().float().chunk(2, -1)
    _assert_near_reference(values, scale, torch.nn.functional.silu(gate) * up, dtype)


def test_only_rowwise_products_on_the_gpu_take_quantized_input(monkeypatch):
    """Per-channel and per-tensor fp8 weights on the GPU take it; block-scaled ones (16-bit
    activations), CPU weights and the switch off do not; dense layers never."""
    from nanovllm.layers.quantization.base import UnquantizedLinearMethod
    on_gpu = SimpleNamespace(weight=torch.empty(4, 4).as_subclass(OnGpu))
    on_cpu = SimpleNamespace(weight=torch.empty(4, 4))
    for source in ("dense", "channel", "tensor"):
        assert fp8.Fp8LinearMethod(source).takes_quantized_input(on_gpu)
        assert not fp8.Fp8LinearMethod(source).takes_quantized_input(on_cpu)
    assert not fp8.Fp8LinearMethod("block", (128, 128)).takes_quantized_input(on_gpu)
    assert not UnquantizedLinearMethod().takes_quantized_input(on_gpu)
    monkeypatch.setattr(fp8, "FUSED_ACTIVATION_QUANT", False)
    assert not fp8.Fp8LinearMethod("channel").takes_quantized_input(on_gpu)


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TEACHER = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)


def _run(path: str, engine: dict, monkeypatch) -> tuple[list[list[int]], list[float], dict[str, set[str]]]:
    """Greedy ids and teacher-forced prompt logprobs of a fresh fp8 engine, and what its products took:
    projection name (qkv_proj, o_proj, ...) -> the kinds of input its layers were given."""
    taken: dict[int, set[str]] = {}  # id(layer) -> input kinds
    plain_apply = fp8.Fp8LinearMethod.apply

    def recording_apply(method, layer, x, bias):
        taken.setdefault(id(layer), set()).add(type(x).__name__)
        return plain_apply(method, layer, x, bias)
    monkeypatch.setattr(fp8.Fp8LinearMethod, "apply", recording_apply)
    llm = LLM(path, quantization="fp8", skip_tokenizer_init=True, max_model_len=256, num_kvcache_blocks=64,
              **engine)
    prompts = random_prompts([9, 30, 41], seed=5)
    ids = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    logprobs = [entry[t].logprob for o in llm.generate(prompts, TEACHER, use_tqdm=False)
                for t, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
    inputs: dict[str, set[str]] = {}
    for name, module in llm.llm_engine.model_runner.model.named_modules():
        if id(module) in taken:
            inputs.setdefault(name.rsplit(".", 1)[-1], set()).update(taken[id(module)])
    monkeypatch.setattr(fp8.Fp8LinearMethod, "apply", plain_apply)
    del llm
    gc.collect()
    return ids, logprobs, inputs


def _assert_fusion_changes_nothing(path: str, engine: dict, monkeypatch) -> None:
    """The same ids and logprobs, bit for bit, with the fusion on and off; on, q/k/v, gate/up and
    down take the fp8 values their norm or SiLU-and-mul wrote, and o a tensor; off, all tensors."""
    fused_ids, fused_logprobs, inputs = _run(path, engine, monkeypatch)
    assert inputs == {"qkv_proj": {"QuantizedActivation"}, "o_proj": {"Tensor"},
                      "gate_up_proj": {"QuantizedActivation"}, "down_proj": {"QuantizedActivation"}}
    monkeypatch.setattr(fp8, "FUSED_ACTIVATION_QUANT", False)
    ids, logprobs, inputs = _run(path, engine, monkeypatch)
    assert set(inputs) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert all(kinds == {"Tensor"} for kinds in inputs.values())
    # the bit-for-bit comparison is over values that vary (a tiny random model's greedy continuation
    # may repeat one token; its teacher-forced logprobs over random prompts do not)
    assert len(set(logprobs)) >= len(logprobs) // 2
    assert fused_ids == ids
    assert fused_logprobs == logprobs


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_engine_on_the_cpu_with_products_taking_quantized_input(tiny_model, family, monkeypatch):
    """The layers' plumbing on the CPU: the producers' torch steps (norm or SiLU-and-mul, then
    quantize_rows) hand QuantizedActivations to the products, which on the CPU take them only here."""
    path, _ = tiny_model(family)
    monkeypatch.setattr(fp8.Fp8LinearMethod, "takes_quantized_input",
                        lambda method, layer: fp8.FUSED_ACTIVATION_QUANT and method.source != "block")
    _assert_fusion_changes_nothing(path, dict(device="cpu", dtype="float32"), monkeypatch)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_engine_on_the_gpu_gives_the_same_ids_fused_or_not(tiny_model, family, enforce_eager, monkeypatch):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 weights need an fp8 GPU (sm_89 or later)")
    path, _ = tiny_model(family)
    _assert_fusion_changes_nothing(path, dict(device="cuda", dtype="bfloat16", enforce_eager=enforce_eager,
                                              max_num_seqs=8), monkeypatch)
