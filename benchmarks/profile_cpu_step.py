"""Where a CPU decode step's time goes: B2's chat prompts, one engine, wall clock by kind.

Runs `--rows` of B2's chat prompts (benchmarks/bench_cpu.py) through `LLM(device="cpu")` for
`--tokens` greedy tokens (`ignore_eos`) and times every `ModelRunner.run`. Then the same
generation again with every module of a known kind wrapped in a wall-clock timer (what
`torch.profiler` reported here at 64 rows on two threads covered a fraction of the step's
time, so it is not used), and reports, per decode step of `--rows` rows, medians over those
steps (robust to the bursts of a shared machine):

- qkv / o / gate_up / down: the linear layers' products (by the layer's attribute name);
- lm_head, embed, sampler;
- attention: the K/V store and the decode attention (the C++ kernel where it runs);
- norm / rope / act: RMSNorm (with its residual add), RoPE, SiLU-and-mul;
- rest of run: the median `ModelRunner.run` minus the kinds' medians (the step's inputs, the
  layers' Python, views and residual adds outside the modules, sampling metadata);
- outside run: `generate`'s time per step outside `ModelRunner.run` (scheduler, block
  manager, output processing, detokenizer).

    python benchmarks/profile_cpu_step.py --rows 64 --threads 2
    python benchmarks/profile_cpu_step.py --rows 1 --compilation-config 3
    python benchmarks/profile_cpu_step.py --torch-small-ops   # without kernels/cpu_small_ops.py

Prints a table and a final JSON line (ms per decode step).
"""
import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_cpu import chat_prompts, cpu_flags  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.model_source import default_model_path  # noqa: E402
from nanovllm.utils.gguf_loader import gguf_tokenizer  # noqa: E402

# module class name -> kind (linear layers are named by their attribute instead)
MODULE_KINDS = {"RMSNorm": "norm", "RotaryEmbedding": "rope", "SiluAndMul": "act", "Attention": "attention",
                "ParallelLMHead": "lm_head", "VocabParallelEmbedding": "embed", "Sampler": "sampler"}
LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def time_modules(modules, times: dict) -> list:
    """Wrap the forward of every (name, module) of a known kind so that its wall time adds to
    times[kind]; returns the undo list [(module, original forward)]."""
    undo = []
    for name, module in modules:
        kind = MODULE_KINDS.get(type(module).__name__)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in LINEAR_NAMES:
            kind = leaf.removesuffix("_proj")
        if kind is None:
            continue
        forward = module.forward

        def wrapped(*args, _forward=forward, _kind=kind, **kwargs):
            start = time.perf_counter()
            out = _forward(*args, **kwargs)
            times[_kind] += time.perf_counter() - start
            return out
        module.forward = wrapped
        undo.append((module, forward))
    return undo


def generate_timed(llm, prompts, params, rows: int, times: dict | None) -> dict:
    """One generation; every `ModelRunner.run` timed, and with `times` the kinds inside the
    decode steps of `rows` rows (the wrappers' sums reset before each such step)."""
    runner = llm.llm_engine.model_runner
    run, steps, kinds = runner.run, [], collections.defaultdict(list)

    def timed_run(seqs):
        if times is not None:
            times.clear()
        start = time.perf_counter()
        out = run(seqs)
        steps.append((len(seqs), time.perf_counter() - start))
        if times is not None and len(steps) > 1 and len(seqs) == rows:
            for kind, seconds in times.items():
                kinds[kind].append(seconds)
        return out
    runner.run = timed_run
    start = time.perf_counter()
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        runner.run = run
    total = time.perf_counter() - start
    decode = [t for n, t in steps[1:] if n == rows]
    return {"total_s": total, "run_s": sum(t for _, t in steps), "steps": len(steps),
            "first_step_s": steps[0][1], "decode_ms": 1e3 * statistics.median(decode),
            "decode_mean_ms": 1e3 * statistics.mean(decode),
            "kinds_ms": {k: 1e3 * statistics.median(v) for k, v in kinds.items()}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compilation-config", type=int, default=0, choices=[0, 3])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--torch-small-ops", action="store_true",
                        help="RMSNorm, RoPE + K/V store and SiLU-and-mul by the torch code, not the C++")
    args = parser.parse_args(argv)
    if args.torch_small_ops:
        from nanovllm.kernels import cpu_small_ops
        cpu_small_ops._runs_here = lambda x: False
        cpu_small_ops.rope_store_built = lambda dtype, head_dim: False
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    prompts = chat_prompts(gguf_tokenizer(path), args.rows)
    llm = LLM(path, dtype=args.dtype, compilation_config=args.compilation_config)
    runner = llm.llm_engine.model_runner
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)

    plain = generate_timed(llm, prompts, params, args.rows, None)
    times = collections.defaultdict(float)
    undo = time_modules(list(runner.model.named_modules()) + [("sampler", runner.sampler)], times)
    timed = generate_timed(llm, prompts, params, args.rows, times)
    for module, forward in undo:
        module.forward = forward

    kinds = dict(sorted(timed["kinds_ms"].items(), key=lambda kv: -kv[1]))
    kinds["rest of run"] = timed["decode_ms"] - sum(kinds.values())
    outside = 1e3 * (plain["total_s"] - plain["run_s"]) / plain["steps"]
    print(f"cpu: {cpu_flags()}; threads {args.threads}; rows {args.rows}; tokens {args.tokens}; "
          f"compilation {args.compilation_config}; dtype {runner.dtype}; small ops: "
          f"{'torch' if args.torch_small_ops else 'C++ where built'}")
    print(f"generate {plain['total_s']:.2f} s ({args.rows * args.tokens / plain['total_s']:.1f} tok/s), "
          f"first step {plain['first_step_s']:.2f} s, decode step median {plain['decode_ms']:.1f} ms, "
          f"outside ModelRunner.run {outside:.1f} ms a step")
    print(f"timed run: decode step median {timed['decode_ms']:.1f} ms, mean {timed['decode_mean_ms']:.1f} ms:")
    for kind, ms in kinds.items():
        print(f"  {kind:12s} {ms:8.2f} ms  {100 * ms / timed['decode_ms']:5.1f}%")
    print(json.dumps({"rows": args.rows, "threads": args.threads, "tokens": args.tokens,
                      "compilation": args.compilation_config, "torch_small_ops": args.torch_small_ops, "tok_s": args.rows * args.tokens / plain["total_s"],
                      "first_step_s": plain["first_step_s"], "decode_step_ms": plain["decode_ms"],
                      "outside_run_ms": outside, "timed_kinds_ms": {k: round(v, 3) for k, v in kinds.items()}}))


if __name__ == "__main__":
    main()
