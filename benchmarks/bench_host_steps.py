"""Host time of B1's engine steps with the model stood in (CPU, no GPU needed).

B1's synchronous steps (its prefill chunks) leave the GPU idle while the host takes the
sampled tokens, schedules and builds the next step; `bench_offline.py` reports those gaps
on a GPU ("gpu_gap_ms"). This replays B1's workload through the real scheduler, block
manager, step inputs and output processing, with `ModelRunner.run` replaced by a stand-in
that builds the step's inputs (`prepare`) and samples token 0, and prints the host time of
each step until every prompt is prefilled.

With `--long-prompt N`, the workload is instead one N-token prompt (fresh ones, `--repeats` times)
prefilled in chunks of `--max-num-batched-tokens`: the host's share of a long prompt's TTFT
(`bench_long_context.py` times the whole of it on a GPU).

    python benchmarks/bench_host_steps.py [--profile]
    python benchmarks/bench_host_steps.py --long-prompt 32000 [--max-num-batched-tokens 8192]
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from random import randint, seed

sys.path.insert(0, os.path.dirname(__file__))
from bench_offline import SMALL, model_dir, workload  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.sampling_metadata import ModelRunnerOutput  # noqa: E402

MODEL = dict(SMALL, vocab_size=10_001)  # B1's prompt ids are randint(0, 10000)
NUM_KV_BLOCKS = 12_000  # room for every B1 prompt at block size 16
BLOCK_SIZE = 16         # the engine's default


def stand_in_run(runner):
    """ModelRunner.run without the model: the step's inputs are built, every sampling row gets token 0."""
    def run(seqs):
        _, _, _, sampling = runner.prepare(seqs)
        output = ModelRunnerOutput.empty(len(seqs))
        for i in sampling:
            output.sampled_token_ids[i] = 0
        return output
    return run


def long_prompt_steps(prompt_len: int, chunk: int, repeats: int) -> None:
    """Host ms of each step of one `prompt_len`-token prompt until its first token, `repeats` times."""
    llm = LLM(model_dir(MODEL), load_format="dummy", skip_tokenizer_init=True, max_model_len=prompt_len + 1,
              num_kvcache_blocks=2 * (prompt_len // BLOCK_SIZE + 1), max_num_batched_tokens=chunk,
              enforce_eager=True)
    engine = llm.llm_engine
    engine.model_runner.run = stand_in_run(engine.model_runner)
    seed(0)
    for _ in range(repeats):
        engine.add_request(None, [randint(0, 10000) for _ in range(prompt_len)], SamplingParams(max_tokens=1))
        step_ms = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            step_ms.append(round((time.perf_counter() - start) * 1e3, 2))
        print(json.dumps({"bench": "host_steps_long_prompt", "prompt_len": prompt_len, "max_num_batched_tokens": chunk,
                          "step_ms": step_ms, "total_ms": round(sum(step_ms), 1)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="store_true", help="print the functions taking the most host time")
    ap.add_argument("--long-prompt", type=int, default=None, metavar="N", help="one N-token prompt instead of B1's")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="with --long-prompt: the chunk")
    ap.add_argument("--repeats", type=int, default=3, help="with --long-prompt: fresh prompts, one after another")
    args = ap.parse_args()
    if args.long_prompt is not None:
        long_prompt_steps(args.long_prompt, args.max_num_batched_tokens, args.repeats)
        return
    llm = LLM(model_dir(MODEL), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              num_kvcache_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=16384, max_num_seqs=256)
    engine = llm.llm_engine
    engine.model_runner.run = stand_in_run(engine.model_runner)
    for prompt, params in zip(*workload(256, 1024, 1024)):
        engine.add_request(None, prompt, params)
    profile, step_ms = cProfile.Profile(), []
    while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
        start = time.perf_counter()
        if args.profile:
            profile.enable()
        engine.step()
        if args.profile:
            profile.disable()
        step_ms.append(round((time.perf_counter() - start) * 1e3, 2))
    print(json.dumps({"bench": "host_steps", "prefill_steps": len(step_ms), "step_ms": step_ms,
                      "total_ms": round(sum(step_ms), 1), "profiled": args.profile}))
    if args.profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
