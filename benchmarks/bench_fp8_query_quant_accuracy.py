"""What the fp8 tensor-core decode tiles (`triton_attn.DECODE_FP8_QUERY_QUANT`: queries and
probabilities rounded to e4m3 as well; `DECODE_FP8_PV_MMA`: probabilities only) cost in
accuracy, against the plain fp8 cache.

The harness of `bench_fp8_kv_accuracy.py` (the embedded SmolLM2-135M, fp32, CPU; the same four
passages, teacher-forced prompt logprobs against the fp32 cache's), with the attention replaced
by `kernels/query_quant_ref.py`, the kernel's rounding in torch: every prompt token attends as a
decode of its own would (one query row per token and head). Rows: the plain e4m3 cache (per-layer
scales, the engine's default), and the emulated tile per query-scale choice (one scale per row,
the kernel's; one per token; scale 1) and, with q not rounded ("none"), only P rounded: the
`DECODE_FP8_PV_MMA` tile. The passages are under 64 tokens, so one KV tile: the tile size is no
matter here. Top-1: how often the argmax next token
(each position, teacher-forced) equals the fp32 cache's.

    python benchmarks/bench_fp8_query_quant_accuracy.py
"""
import functools
import json
import types
from unittest import mock

import torch

from bench_fp8_kv_accuracy import PASSAGES
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import query_quant_ref, torch_ref

TEACHER = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)


def teacher_forced(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of every prompt token after the first, and the top-1 token id at each of those
    positions, all prompts concatenated.  # [tokens], [tokens]"""
    values, top1 = [], []
    for out in llm.generate(PASSAGES, TEACHER, use_tqdm=False):
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            values.append(entry[token].logprob)
            top1.append(max(entry, key=lambda t: entry[t].logprob))
    return torch.tensor(values), torch.tensor(top1)


def emulated_attention(q, k_cache, *args, emulate: dict, **kwargs):
    """The tile's rounding over an e4m3 cache; the plain reference over the scale calibration's
    scratch cache (in the model dtype)."""
    if k_cache.dtype != query_quant_ref.FP8:
        return torch_ref.paged_attention(q, k_cache, *args, **kwargs)
    return query_quant_ref.paged_attention(q, k_cache, *args, **kwargs, **emulate)


def run(kv_cache_dtype: str, emulate: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """emulate: query_quant_ref.paged_attention's keywords (block_n, q_scales), None: the engine's."""
    patch = mock.patch("nanovllm.engine.model_runner.get_attention_backend",
                       lambda device_type: types.SimpleNamespace(
                           store_kvcache=torch_ref.store_kvcache,
                           paged_attention=functools.partial(emulated_attention, emulate=emulate)))
    with patch if emulate is not None else mock.MagicMock():
        llm = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
                  num_kvcache_blocks=64, max_model_len=1024)
        return teacher_forced(llm)


def main() -> None:
    torch.set_num_threads(2)
    reference, ref_top1 = run("auto", None)
    print(f"fp32 cache: {len(reference)} tokens, mean logprob {reference.mean():.4f}")
    rows = []
    variants = [("plain e4m3 (engine default)", None)] + [
        (f"query quant, q scales {q}, {n}-key tiles", dict(q_scales=q, block_n=n))
        for q, n in (("row", 128), ("token", 128), ("unit", 128), ("none", 128))]
    for name, emulate in variants:
        values, top1 = run("fp8", emulate)
        diff = (values - reference).abs()
        row = dict(variant=name, tokens=len(values), max_abs_diff=round(diff.max().item(), 4),
                   mean_abs_diff=round(diff.mean().item(), 5),
                   top1_agreement=round((top1 == ref_top1).float().mean().item(), 4))
        rows.append(row)
        print(f"{name:40s}: max |dlogprob| {row['max_abs_diff']:.4f}  mean {row['mean_abs_diff']:.5f}  "
              f"top-1 agreement {row['top1_agreement']:.4f}")
    print(json.dumps(dict(bench="fp8_query_quant_accuracy", reference_mean_logprob=round(reference.mean().item(), 4),
                          rows=rows)))


if __name__ == "__main__":
    main()
