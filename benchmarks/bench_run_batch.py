"""run-batch throughput: against `LLM.chat` on the same requests, and on Ray at one replica.

The embedded SmolLM2-135M-Instruct (GGUF) on CPU, B2's 64 chat questions as a batch
file (/v1/chat/completions, greedy, `max_tokens` new tokens each, `ignore_eos`):

1. `LLM.chat` on the 64 conversations in one call (the engine already loaded);
2. `run-batch` on one engine (`run_local`: the server's parsing and handlers on an
   `AsyncLLM`, lines written as they finish), the engine already loaded; goal: >= 0.95
   of (1)'s output tokens/s;
3. `run-batch --data-parallel-size 1` on a local Ray cluster (Ray Data, one replica
   actor with the same torch threads), end to end: replica start and model load are
   inside the job. For a like-for-like figure, (2) is also timed end to end with its
   engine load, and the Ray job's start-up is estimated by a one-line job (its time is
   start-up plus one request). Goal: the Ray path >= 0.9 of the one-engine path.

(1) and (2) alternate `--repeats` times (medians): this machine's load varies by the minute.

    python benchmarks/bench_run_batch.py                     # as above
    python benchmarks/bench_run_batch.py --num-requests 8 --max-tokens 16 --skip-ray   # a quick look

Prints the figures and a final JSON line. The answers of (1), (2) and (3) are compared
(greedy: they must be equal) so a fast wrong path cannot pass.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_cpu import SUBJECTS, TEMPLATES  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.model_source import default_model_path  # noqa: E402

MODEL_NAME = "smollm2"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of every engine")
    parser.add_argument("--repeats", type=int, default=3, help="alternating timed runs of (1) and (2); medians")
    parser.add_argument("--skip-ray", action="store_true")
    return parser.parse_args(argv)


def questions(n: int) -> list[str]:
    qs = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
    return (qs * (n // len(qs) + 1))[:n]


def write_batch_file(path: str, qs: list[str], max_tokens: int) -> None:
    with open(path, "w") as f:
        for i, q in enumerate(qs):
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")


def read_texts(path: str) -> dict[str, str]:
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    return {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in lines}


class GenerateRun:
    """`LLM.chat` on the conversations, the engine loaded once."""

    def __init__(self, model: str, qs: list[str], max_tokens: int):
        self.llm = LLM(model)
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.conversations = [[{"role": "user", "content": q}] for q in qs]
        self.llm.chat(self.conversations[:1], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up

    def __call__(self) -> tuple[float, int, dict[str, str]]:
        start = time.perf_counter()
        outs = self.llm.chat(self.conversations, self.params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.outputs[0].token_ids) for o in outs), \
            {f"q{i}": o.outputs[0].text for i, o in enumerate(outs)}


class RunBatchRun:
    """`run_local` on the batch file, the engine loaded once (its load time kept for the end-to-end figure)."""

    def __init__(self, model: str, in_path: str, workdir: str):
        from nanovllm.engine.async_llm import AsyncLLM
        from nanovllm.entrypoints.openai.chat_template import load_chat_template
        start = time.perf_counter()
        self.llm = AsyncLLM(model, log_stats_interval=0)
        self.load_seconds = time.perf_counter() - start
        self.template = load_chat_template(None, self.llm.tokenizer)
        self.in_path, self.workdir, self.runs = in_path, workdir, 0
        warm = os.path.join(workdir, "warm.jsonl")
        with open(in_path) as f, open(warm, "w") as w:
            w.write(f.readline())
        self._run(warm)

    def _run(self, path: str) -> tuple[dict, str]:
        from nanovllm.entrypoints.run_batch import run_local
        self.runs += 1
        out = os.path.join(self.workdir, f"local-{self.runs}.jsonl")
        return run_local(self.llm, [MODEL_NAME], self.template, path, out, progress=False), out

    def __call__(self) -> tuple[float, int, dict[str, str]]:
        start = time.perf_counter()
        summary, out = self._run(self.in_path)
        return time.perf_counter() - start, summary["generated_tokens"], read_texts(out)


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def alternate(model: str, qs: list[str], in_path: str, workdir: str, max_tokens: int, repeats: int) -> dict:
    """Time (1) and (2) alternately `repeats` times; medians of tokens/s, answers checked equal."""
    generate, run_batch = GenerateRun(model, qs, max_tokens), RunBatchRun(model, in_path, workdir)
    rates = {"generate": [], "run_batch": []}
    for _ in range(repeats):
        g_seconds, g_tokens, ref = generate()
        r_seconds, r_tokens, texts = run_batch()
        assert texts == ref, "run-batch answers differ from LLM.chat's"
        rates["generate"].append(g_tokens / g_seconds)
        rates["run_batch"].append(r_tokens / r_seconds)
    generate.llm.shutdown()
    run_batch.llm.shutdown()
    r_tok_s = median(rates["run_batch"])
    return {"generate_tok_s": median(rates["generate"]), "run_batch_tok_s": r_tok_s, "runs": rates,
            "run_batch_load_seconds": run_batch.load_seconds,
            "run_batch_e2e_tok_s": r_tokens / (r_tokens / r_tok_s + run_batch.load_seconds),
            "run_batch_vs_generate": r_tok_s / median(rates["generate"])}, ref


def bench_ray(model: str, in_path: str, workdir: str, threads: int) -> tuple[dict, dict[str, str]]:
    import ray
    from nanovllm.entrypoints.ray.batch import run_on_ray
    from nanovllm.entrypoints.run_batch import add_cli_args
    ray.init(num_cpus=threads + 1, include_dashboard=False, log_to_driver=False)   # one CPU beside the replica

    def job(path: str, out: str) -> float:
        argv = ["-i", path, "-o", out, "--served-model-name", MODEL_NAME, "--no-progress", "-dp", "1",
                "--cpus-per-replica", str(threads)] + (["--model", model] if model else [])
        start = time.perf_counter()
        run_on_ray(add_cli_args(argparse.ArgumentParser()).parse_args(argv))
        return time.perf_counter() - start
    one = os.path.join(workdir, "one.jsonl")
    with open(in_path) as f, open(one, "w") as w:
        w.write(f.readline())
    startup = job(one, os.path.join(workdir, "one-out.jsonl"))
    out = os.path.join(workdir, "ray.jsonl")
    seconds = job(in_path, out)
    ray.shutdown()
    texts = read_texts(out)
    with open(out) as f:
        tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in f)
    return {"e2e_seconds": seconds, "tokens": tokens, "e2e_tok_s": tokens / seconds, "one_line_job_seconds": startup,
            "steady_tok_s": tokens / max(seconds - startup, 1e-9)}, texts


def main(argv=None) -> None:
    import torch
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    qs = questions(args.num_requests)
    result = {"num_requests": args.num_requests, "max_tokens": args.max_tokens, "threads": args.threads,
              "repeats": args.repeats, "load_avg_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as workdir:
        in_path = os.path.join(workdir, "in.jsonl")
        write_batch_file(in_path, qs, args.max_tokens)
        local, ref = alternate(model, qs, in_path, workdir, args.max_tokens, args.repeats)
        result.update(local)
        if not args.skip_ray:
            result["ray_dp1"], texts = bench_ray(args.model, in_path, workdir, args.threads)
            assert texts == ref, "run-batch on Ray answers differ from LLM.chat's"
            result["ray_vs_local_e2e"] = result["ray_dp1"]["e2e_tok_s"] / result["run_batch_e2e_tok_s"]
            result["ray_vs_local_steady"] = result["ray_dp1"]["steady_tok_s"] / result["run_batch_tok_s"]
    result["load_avg_end"] = os.getloadavg()[0]
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
