"""How much an fp8 KV cache moves teacher-forced logprobs, per scale granularity.

The embedded SmolLM2-135M (fp32 weights and activations, CPU) reads a few English
passages as prompts; each prompt token's logprob (`prompt_logprobs=0`: the model fed
the true previous tokens, so errors cannot compound through sampling) is compared with
the run on an fp32 cache. Rows: the cache dtype and how its scales are shared
(`engine/kv_scales.py`: one per tensor, per layer, per KV head), plus the scale 1.0
that vLLM uses when a checkpoint has none.

    python benchmarks/bench_fp8_kv_accuracy.py
"""
import json
from unittest import mock

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine import kv_scales

PASSAGES = [
    "The capital of France is Paris. It lies on the Seine, in the north of the country, and has been "
    "its largest city for centuries. Its museums, among them the Louvre, draw millions of visitors a year.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide "
    "into glucose and oxygen. It takes place mostly in the leaves, inside small structures called chloroplasts.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "In 1969 the Apollo 11 mission landed the first two people on the Moon. Neil Armstrong stepped out "
    "first, followed by Buzz Aldrin, while Michael Collins stayed in orbit aboard the command module.",
]
TEACHER = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)


def prompt_logprobs(llm: LLM, prompts: list[str]) -> torch.Tensor:
    """Logprob of every prompt token after the first, all prompts concatenated.  # [tokens]"""
    values = []
    for out in llm.generate(prompts, TEACHER, use_tqdm=False):
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            values.append(entry[token].logprob)
    return torch.tensor(values)


def measure(kv_cache_dtype: str, granularity: str | None, reference: torch.Tensor | None):
    """granularity: kv_scales' "tensor" | "layer" | "head", or "unit" (every scale 1.0)."""
    if granularity == "unit":
        patch = mock.patch.object(kv_scales, "scales_from_amax", lambda amax, *args: torch.ones_like(amax))
    else:
        patch = mock.patch.object(kv_scales, "GRANULARITY", granularity or kv_scales.GRANULARITY)
    with patch:
        llm = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
                  num_kvcache_blocks=64, max_model_len=1024)
        values = prompt_logprobs(llm, PASSAGES)
    if reference is None:
        return values, None
    diff = (values - reference).abs()
    return values, dict(kv_cache_dtype=kv_cache_dtype, scales=granularity, tokens=len(values),
                        max_abs_diff=round(diff.max().item(), 4), mean_abs_diff=round(diff.mean().item(), 5),
                        mean_logprob=round(values.mean().item(), 4))


def main() -> None:
    torch.set_num_threads(2)
    reference, _ = measure("auto", None, None)
    print(f"fp32 cache: {len(reference)} tokens, mean logprob {reference.mean():.4f}")
    rows = []
    for dtype in ("fp8_e4m3", "fp8_e5m2"):
        for granularity in ("unit", "tensor", "layer", "head"):
            _, row = measure(dtype, granularity, reference)
            rows.append(row)
            print(f"{dtype:9s} scales {granularity:6s}: max |dlogprob| {row['max_abs_diff']:.4f}  "
                  f"mean {row['mean_abs_diff']:.5f}  mean logprob {row['mean_logprob']:.4f}")
    print(json.dumps(dict(bench="fp8_kv_accuracy", reference_mean_logprob=round(reference.mean().item(), 4),
                          rows=rows)))


if __name__ == "__main__":
    main()
