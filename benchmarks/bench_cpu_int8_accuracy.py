"""How much the CPU's int8 products (quantization="gguf_int8") move the embedded SmolLM2's outputs.

Against the present path (`quantization="gguf"`: fp32 products for every batch past the int4
kernel's 12 rows, so B2's 64-row decode steps and every prefill here are fp32), on the
embedded Q4_1 file, one thread:

1. teacher-forced logprobs (bench_fp8_kv_accuracy.py's method: `prompt_logprobs=0`, so errors
   cannot compound through sampling) over its four English passages and over
   `--chat-prompts` of B2's chat prompts followed by the present path's 128-token greedy
   answer (the text B2 makes), for each variant: int8 weights per output channel with
   activations per tensor (FBGEMM's own, 7-bit) or per token (7 bits, or 8 against 7-bit
   weights), with and without the LM head,
   and the int4 kernel on every batch (the present path's small-batch kernel, for scale);
2. greedy agreement over B2's 64 chat prompts x 128 tokens (`--greedy` variants): identical
   sequences, and at each first divergence whether it is a near-tie (each side's token in the
   other's top-5 logprobs, the rule tests/ use).

    python benchmarks/bench_cpu_int8_accuracy.py [--chat-prompts 16] [--greedy rot_token_head token_head]

Prints one line per variant and a final JSON line.
"""
import argparse
import json
import os
import sys
from contextlib import ExitStack
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_cpu import chat_prompts  # noqa: E402
from bench_fp8_kv_accuracy import PASSAGES  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels import cpu_int8_dynamic  # noqa: E402
from nanovllm.layers.quantization import gguf, gguf_int8  # noqa: E402

TOP_K_CLOSE = 5
# name -> (quantization, per-token activations, activation bits, Hadamard block, LM head by int8,
#          int4 on every batch)
VARIANTS = {
    "tensor": ("gguf_int8", False, 7, 0, False, False),
    "tensor_head": ("gguf_int8", False, 7, 0, True, False),
    "token": ("gguf_int8", True, 7, 0, False, False),
    "token_head": ("gguf_int8", True, 7, 0, True, False),
    "token8": ("gguf_int8", True, 8, 0, False, False),
    "token8_head": ("gguf_int8", True, 8, 0, True, False),
    "rot_token": ("gguf_int8", True, 7, 64, False, False),
    "rot_token_head": ("gguf_int8", True, 7, 64, True, False),
    "rot_token8": ("gguf_int8", True, 8, 64, False, False),
    "rot_token8_head": ("gguf_int8", True, 8, 64, True, False),
    "int4_all": ("gguf", False, 7, 0, False, True),
}


def engine(variant: str | None) -> tuple[LLM, ExitStack]:
    """An engine of `variant` (None: the present path); the patches stay on while it runs."""
    stack = ExitStack()
    quantization = "gguf"
    if variant is not None:
        quantization, per_token, bits, block, head, int4_all = VARIANTS[variant]
        stack.enter_context(mock.patch.object(cpu_int8_dynamic, "ROTATION_BLOCK", block))
        stack.enter_context(mock.patch.object(cpu_int8_dynamic, "PER_TOKEN", per_token))
        stack.enter_context(mock.patch.object(cpu_int8_dynamic, "ACTIVATION_BITS", bits))
        stack.enter_context(mock.patch.object(gguf_int8, "INT8_LM_HEAD", head))
        if int4_all:
            stack.enter_context(mock.patch.dict(gguf.MAX_INT4_ROWS, {k: 1 << 20 for k in gguf.MAX_INT4_ROWS}))
    llm = LLM(quantization=quantization, enable_prefix_caching=False, max_model_len=1024)
    return llm, stack


def teacher_forced(llm: LLM, prompts: list) -> torch.Tensor:
    """Logprob of every prompt token after the first, all prompts concatenated.  # [tokens]"""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    values = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            values.append(entry[token].logprob)
    return torch.tensor(values)


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=TOP_K_CLOSE)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def agreement(ours, ref) -> dict:
    """Identical sequences; at each first divergence, whether both rank the other's token top-5."""
    same, near, far, parts = 0, 0, 0, []
    for a, b in zip(ours, ref):
        x, y = list(a.token_ids), list(b.token_ids)
        i = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if i is None:
            same += 1
            continue
        parts.append(i)
        close = y[i] in a.logprobs[i] and x[i] in b.logprobs[i]
        near, far = near + close, far + (not close)
    return dict(identical=f"{same}/{len(ref)}", near_ties=near, not_near_ties=far,
                first_divergence=sorted(parts))


def diff_stats(values: torch.Tensor, reference: torch.Tensor) -> dict:
    d = (values - reference).abs()
    return dict(tokens=len(d), max_abs=round(d.max().item(), 4), mean_abs=round(d.mean().item(), 5))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chat-prompts", type=int, default=16, help="B2 chat prompts (+ answers) teacher-forced")
    ap.add_argument("--num-prompts", type=int, default=64, help="B2 prompts for the greedy agreement")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--greedy", nargs="*", default=["rot_token_head"], choices=list(VARIANTS),
                    help="variants whose greedy ids are compared over the B2 prompts")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm, stack = engine(None)
    prompts = chat_prompts(llm.get_tokenizer(), args.num_prompts)
    ref_greedy = greedy(llm, prompts, args.max_tokens)
    forced = [{"prompt_token_ids": p + list(o.token_ids)} for p, o in
              zip(prompts[:args.chat_prompts], ref_greedy)]
    reference = {"passages": teacher_forced(llm, PASSAGES), "chat": teacher_forced(llm, forced)}
    stack.close()
    del llm
    result = dict(bench="cpu_int8_accuracy", threads=args.threads, load_average=" ".join(
        f"{x:.2f}" for x in os.getloadavg()), chat_prompts=args.chat_prompts, rows={})
    for variant in args.variants:
        llm, stack = engine(variant)
        row = {name: diff_stats(teacher_forced(llm, p), reference[name])
               for name, p in (("passages", PASSAGES), ("chat", forced))}
        if variant in args.greedy:
            row["greedy"] = agreement(greedy(llm, prompts, args.max_tokens), ref_greedy)
        stack.close()
        del llm
        result["rows"][variant] = row
        print(variant, json.dumps(row), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
