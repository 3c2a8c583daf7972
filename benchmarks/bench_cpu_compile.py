"""The CPU decode step eager against torch.compile'd (compilation_config=3), at 1, 16 and 64 rows.

One engine on the embedded SmolLM2 GGUF (or --model), built with compilation_config=3; its
runner switches between the compiled forward and the eager one **step by step** (the two
give the same greedy ids, which the script checks), so both see the same machine, the same
contexts and the same host work: on a machine shared with other jobs that is the only A/B
that holds. For each row count it runs `rows` prompts x --max-tokens greedy tokens and
reports, per decode step, the median of each mode's forward pass and of its whole
`ModelRunner.run` (step inputs, forward, LM head, sampling), in wall-clock and in this
thread's CPU time (`time.thread_time`: what another job's load cannot stretch as much).

Also printed: the engine's start-up with compilation and without (their difference is the
compile time: with an empty Inductor cache the first time, from the cache afterwards; point
TORCHINDUCTOR_CACHE_DIR at an empty directory for a cold one), and with --end-to-end the
wall time of whole `generate` calls of an eager and a compiled engine, alternating.

    python benchmarks/bench_cpu_compile.py                      # 1, 16, 64 rows
    python benchmarks/bench_cpu_compile.py --rows 16 --end-to-end --repeats 3

Prints a table and a final JSON line.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.model_source import default_model_path  # noqa: E402
from bench_cpu import cpu_flags  # noqa: E402


def prompts(rows: int) -> list[dict]:
    """`rows` prompts of 20-26 distinct-ish ids (no shared prefix, so no prefix-cache hits)."""
    return [{"prompt_token_ids": [1 + (i * 7 + j * 13) % 9000 for j in range(20 + i % 7)]} for i in range(rows)]


class StepTimer:
    """Wraps a runner: each `run` alternates compiled / eager and records its decode steps' times."""

    def __init__(self, runner):
        self.runner, self.compiled = runner, runner.compiled_forward
        self._run, self._forward = runner.run, runner._forward
        self.times = []  # (mode, rows, forward wall, forward cpu, run wall, run cpu) of decode steps
        self._decode, self._fwd, self._step = False, (0.0, 0.0), 0
        runner.run, runner._forward = self.run, self.forward

    def forward(self, input_ids, positions, context):
        self._decode = context.is_decode_only
        wall, cpu = time.perf_counter(), time.thread_time()
        hidden = self._forward(input_ids, positions, context)
        self._fwd = (time.perf_counter() - wall, time.thread_time() - cpu)
        return hidden

    def run(self, seqs):
        mode = "compiled" if self._step % 2 else "eager"
        self._step += 1
        self.runner.compiled_forward = self.compiled if mode == "compiled" else None
        wall, cpu = time.perf_counter(), time.thread_time()
        out = self._run(seqs)
        if self._decode:
            self.times.append((mode, len(seqs), *self._fwd, time.perf_counter() - wall, time.thread_time() - cpu))
        return out

    def medians(self, rows: int) -> dict:
        out = {}
        for mode in ("eager", "compiled"):
            ts = [t[2:] for t in self.times if t[0] == mode and t[1] == rows]
            out[mode] = [round(statistics.median(col) * 1e3, 2) for col in zip(*ts)] + [len(ts)]
        return out


def greedy(llm, rows: int, tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts(rows), params, use_tqdm=False)]


def timed_build(path: str, **kwargs):
    start = time.perf_counter()
    llm = LLM(path, max_model_len=1024, **kwargs)
    return llm, time.perf_counter() - start


def step_ab(llm, rows_list: list[int], tokens: int) -> dict:
    timer = StepTimer(llm.llm_engine.model_runner)
    result = {}
    for rows in rows_list:
        timer.runner.compiled_forward = timer.compiled
        reference = greedy(llm, rows, tokens)  # every step compiled
        timer.times.clear()
        alternating = greedy(llm, rows, tokens)
        med = timer.medians(rows)
        e, c = med["eager"], med["compiled"]
        result[rows] = dict(same_ids=alternating == reference, steps=(e[4], c[4]),
                            forward_ms=(e[0], c[0]), forward_cpu_ms=(e[1], c[1]),
                            run_ms=(e[2], c[2]), run_cpu_ms=(e[3], c[3]),
                            run_ratio=round(c[2] / e[2], 3), run_cpu_ratio=round(c[3] / e[3], 3),
                            load_average=round(os.getloadavg()[0], 2))
        print(f"rows {rows:>3}: {result[rows]}", flush=True)
    timer.runner.run, timer.runner._forward = timer._run, timer._forward
    timer.runner.compiled_forward = timer.compiled
    return result


def end_to_end(path: str, compiled_llm, rows: int, tokens: int, repeats: int) -> dict:
    eager_llm, _ = timed_build(path, compilation_config=0)
    seconds = {"eager": [], "compiled": []}
    for _ in range(repeats):
        for mode, llm in (("eager", eager_llm), ("compiled", compiled_llm)):
            start = time.perf_counter()
            greedy(llm, rows, tokens)
            seconds[mode].append(time.perf_counter() - start)
    med = {m: statistics.median(v) for m, v in seconds.items()}
    return dict(rows=rows, tokens=tokens, eager_s=round(med["eager"], 2), compiled_s=round(med["compiled"], 2),
                eager_tok_s=round(rows * tokens / med["eager"], 1), compiled_tok_s=round(rows * tokens / med["compiled"], 1),
                ratio=round(med["eager"] / med["compiled"], 3), all_s={m: [round(x, 2) for x in v] for m, v in seconds.items()},
                load_average=round(os.getloadavg()[0], 2))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--rows", default="1,16,64", help="comma-separated decode batch sizes (default: 1,16,64)")
    ap.add_argument("--max-tokens", type=int, default=33, help="tokens per prompt (default: 33: 32 decode steps)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    ap.add_argument("--end-to-end", action="store_true",
                    help="also time whole generate calls of an eager and a compiled engine, alternating")
    ap.add_argument("--repeats", type=int, default=3, help="end-to-end runs of each engine (default: 3)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    rows_list = [int(r) for r in args.rows.split(",")]
    eager, eager_s = timed_build(path, compilation_config=0)
    del eager
    llm, compiled_s = timed_build(path, compilation_config=3)
    result = dict(bench="cpu_compile", cpu_flags=cpu_flags(), threads=args.threads,
                  inductor_cache_dir=cache_dir(), start_up_eager_s=round(eager_s, 1), start_up_compiled_s=round(compiled_s, 1),
                  compile_s=round(compiled_s - eager_s, 1), graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"])
    print(result, flush=True)
    result["steps"] = step_ab(llm, rows_list, args.max_tokens)
    result["graphs_after"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if args.end_to_end:
        result["end_to_end"] = [end_to_end(path, llm, rows, args.max_tokens, args.repeats) for rows in rows_list]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
