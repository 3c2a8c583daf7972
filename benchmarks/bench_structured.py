"""Structured outputs: what a JSON-schema constraint costs.

GPU (the default): B1's workload (bench_offline.py: 256 prompts, the Qwen3-0.6B
configuration with dummy weights, temperature 0.6, ignore_eos) run twice in one process,
unconstrained and with every other request under a JSON schema whose outputs can run to
max_tokens (an unbounded array of strings); prints both throughputs and their ratio. A
constrained request whose array closes ends there (its grammar is complete), so the
output token counts are printed too. Needs a tokenizer for the grammar (--tokenizer DIR, an
HF tokenizer directory; Qwen3's matches the model's vocabulary).

Each run prints a per-step breakdown (`StepBreakdown`) that explains the ratio: decode
steps run in multi-step rounds and in plain one-step steps, steps per round, rounds
chained (async scheduling), lazy rounds (grammar rows: each step's masks filled while the
device runs its forward, engine/decode_round.py), the host's bitmask fill
(ms per step that had one, and rows per fill), the rest of the sampling metadata, the
sampler's launch, the engine's postprocessing (ms per step), the host's wait for the
device's tokens (ms per step: near 0 means the host is the bottleneck), and the wall and
CPU time per step (CPU: all the process's threads). A run with fills then replays them
alone (`fill_alone`): fresh matchers of the same grammar follow the run's constrained
outputs, and the same fill is timed at the same states with nothing else running, so
"in the engine / alone" says what running inside the engine costs the fill.
--save-histories FILE keeps those outputs for bench_bitmask_fill.py --histories;
--torch-threads N sets torch's CPU threads first (OpenMP threads that spin after a
parallel CPU op compete with the fill's threads for the cores); --full-bitmask-first puts
the parallel CPU op that came before each fill until the ninth session back (an A/B).

CPU (--cpu-mask): the host's per-step cost of the masks at batch 64: 64 matchers on one
schema walk random valid paths; per step, filling the 64 bitmask rows from the matchers
(sampling_metadata.fill_token_bitmask), applying them to [64, vocab] float32 logits
(layers/sampler.py `apply_token_bitmask`), and each matcher accepting its token; beside
them, one copy of the logits as a yardstick of the machine's speed at the time.

CPU (--cpu-rounds): constrained vs free throughput on a tiny model (bench_offline's SMALL
shape with the tokenizer's vocabulary; SmolLM2's without --tokenizer) at batch 8 (--batch), with
one-step and multi-step rounds (num_scheduler_steps forced), alternating free and half
constrained runs (--repeats pairs; medians), each with the breakdown above.

    python benchmarks/bench_structured.py --tokenizer DIR            # GPU, B1 half constrained
    python benchmarks/bench_structured.py --cpu-mask [--tokenizer DIR --vocab 151936]  # CPU, batch 64
    python benchmarks/bench_structured.py --cpu-rounds [--tokenizer DIR --vocab 151936]  # CPU, tiny model
"""
import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import torch

WARMUP_PROMPTS = 2  # the untimed warm-up: one constrained request and one free one

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.engine.decode_round import StepLauncher  # noqa: E402
from nanovllm.engine.sampling_metadata import samples_under_grammar  # noqa: E402
from nanovllm.engine.sequence import Sequence  # noqa: E402
from nanovllm.engine.warmup import VariantCounter  # noqa: E402

UNBOUNDED = {"type": "array", "items": {"type": "string"}}
MASK_BATCH, MASK_STEPS = 64, 64
CPU_ROUNDS_BATCH, CPU_ROUNDS_PROMPT, CPU_ROUNDS_TOKENS, CPU_ROUNDS_STEPS = 8, 128, 128, 8


class StepBreakdown:
    """Wraps one engine's pieces to count and time what a run's steps do (see the module
    docstring); `take()` returns the figures since the last take and starts afresh."""

    def __init__(self, llm: LLM):
        from nanovllm.engine import sampling_metadata
        engine, runner = llm.llm_engine, llm.llm_engine.model_runner
        self._reset()
        self._wrap(runner, "run", self._counted_run)
        self._wrap(runner, "launch_decode_round", self._counted_launch)
        self._wrap(engine, "_postprocess", self._timer("postprocess_s"))
        self._wrap(sampling_metadata, "fill_token_bitmask", self._timed_fill)  # every step's metadata calls it
        self._wrap(sampling_metadata.SamplingMetadata, "build", self._timer("metadata_s"))  # includes the fill
        self._wrap(StepLauncher, "sample", self._timed_sample)  # a round step's metadata + sampler launch
        if torch.cuda.is_available():  # the host's waits for a round's tokens
            self._wrap(torch.cuda.Event, "synchronize", self._timer("wait_s"))

    def _reset(self) -> None:
        self.counts = dict(plain_steps=0, rounds=0, round_steps=0, chained_rounds=0, lazy_rounds=0, fills=0,
                           filled_rows=0)
        self.seconds = dict(postprocess_s=0.0, fill_s=0.0, wait_s=0.0, metadata_s=0.0, sample_s=0.0)
        self.fill_ms: list[float] = []

    def _wrap(self, owner, name: str, make) -> None:
        attribute = owner.__dict__.get(name) if isinstance(owner, type) else None
        if isinstance(attribute, classmethod):  # wrapped as the function it binds, kept a classmethod
            setattr(owner, name, classmethod(make(attribute.__func__)))
        else:
            setattr(owner, name, make(getattr(owner, name)))

    def _timer(self, key: str):
        def make(fn):
            @functools.wraps(fn)
            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds[key] += time.perf_counter() - start
            return timed
        return make

    def _timed_fill(self, fn):
        @functools.wraps(fn)
        def timed(seqs, *args, **kwargs):
            start = time.perf_counter()
            bitmask = fn(seqs, *args, **kwargs)
            if bitmask is not None:  # a step with an active grammar row
                ms = (time.perf_counter() - start) * 1e3
                self.counts["fills"] += 1
                self.counts["filled_rows"] += sum(samples_under_grammar(seq) for seq in seqs)
                self.fill_ms.append(ms)
                self.seconds["fill_s"] += ms / 1e3
            return bitmask
        return timed

    def _timed_sample(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start, metadata_s = time.perf_counter(), self.seconds["metadata_s"]
            try:
                return fn(*args, **kwargs)
            finally:  # the sampler's launch (and on a GPU its copies): what the metadata build leaves
                self.seconds["sample_s"] += time.perf_counter() - start - (self.seconds["metadata_s"] - metadata_s)
        return timed

    def _counted_run(self, fn):
        def run(seqs):
            self.counts["plain_steps"] += 1
            return fn(seqs)
        return run

    def _counted_launch(self, fn):
        def launch(seqs, num_steps, after=None):
            decode_round = fn(seqs, num_steps, after=after)
            self.counts["rounds"] += 1
            self.counts["round_steps"] += num_steps
            self.counts["chained_rounds"] += after is not None
            self.counts["lazy_rounds"] += decode_round.lazy
            return decode_round
        return launch

    def take(self) -> dict:
        c, s = self.counts, self.seconds
        steps = max(1, c["plain_steps"] + c["round_steps"])
        per_step = lambda seconds: round(seconds * 1e3 / steps, 3)  # noqa: E731
        result = dict(c, steps=steps, steps_per_round=round(c["round_steps"] / max(1, c["rounds"]), 2),
                      fill_ms_per_filled_step=round(statistics.median(self.fill_ms), 3) if self.fill_ms else 0.0,
                      rows_per_fill=round(c["filled_rows"] / max(1, c["fills"]), 1),
                      fill_ms_per_step=per_step(s["fill_s"]),
                      metadata_ms_per_step=per_step(s["metadata_s"] - s["fill_s"]),  # the rest of the build
                      sampler_launch_ms_per_round_step=round(s["sample_s"] * 1e3 / max(1, c["round_steps"]), 3),
                      postprocess_ms_per_step=per_step(s["postprocess_s"]),
                      wait_ms_per_step=per_step(s["wait_s"]))
        self._reset()
        return result


def _print_breakdown(name: str, b: dict) -> None:
    print(f"  {name}: {b['plain_steps']} one-step steps, {b['round_steps']} steps in {b['rounds']} rounds "
          f"({b['steps_per_round']} per round; {b['chained_rounds']} chained, {b['lazy_rounds']} lazy); "
          f"bitmask fill {b['fill_ms_per_filled_step']} ms per filled step (median, {b['fills']} "
          f"fills of {b['rows_per_fill']} rows), per step (means): wall {b['wall_ms_per_step']} ms, "
          f"CPU {b['cpu_ms_per_step']} ms (all threads), fill {b['fill_ms_per_step']} ms, rest of the "
          f"metadata {b['metadata_ms_per_step']} ms, sampler launch {b['sampler_launch_ms_per_round_step']} ms "
          f"(per step in rounds), "
          f"postprocess {b['postprocess_ms_per_step']} ms, waiting for the device {b['wait_ms_per_step']} ms")
    if "fill_alone_ms_per_filled_step" in b:
        print(f"  {name}, the same fills alone (the outputs' states replayed after the run, nothing else "
              f"running): {b['fill_alone_ms_per_filled_step']} ms per filled step (median, {b['alone_fills']} "
              f"fills of {b['alone_rows_per_fill']} rows): in the engine / alone = {b['fill_engine_over_alone']}")


def fill_alone(llm: LLM, run_params: list[SamplingParams], outputs) -> dict:
    """A run's bitmask fills again, alone: fresh matchers of the engine's own compiled grammar
    follow each constrained output token by token, and before each token the same
    `fill_token_bitmask` fills the rows still under their grammar (free rows between them,
    as in the run's batch) on the engine's device, with nothing else running. The states
    are the engine's; what differs from the run is only what ran beside the fill."""
    from nanovllm.engine import sampling_metadata
    engine = llm.llm_engine
    rows = []  # (sequence, its output token ids)
    for params, output in zip(run_params, outputs):
        seq = Sequence([1])
        if params.structured_outputs is not None:
            seq.grammar = engine.structured_outputs.grammar_for(params.structured_outputs,
                                                                frozenset(params.stop_token_ids))
        rows.append((seq, output.outputs[0].token_ids))
    fill = getattr(sampling_metadata.fill_token_bitmask, "__wrapped__", sampling_metadata.fill_token_bitmask)
    vocab, device = engine.model_config.vocab_size, engine.model_runner.device
    times, num_rows = [], 0
    for step in range(max(len(token_ids) for _, token_ids in rows)):
        for seq, token_ids in rows:
            if step == len(token_ids):
                seq.finish("length")
        seqs = [seq for seq, _ in rows]
        start = time.perf_counter()
        bitmask = fill(seqs, vocab, device)
        if bitmask is None:
            break
        times.append((time.perf_counter() - start) * 1e3)  # timed as in the run: the copy is queued
        if device.type == "cuda":
            torch.cuda.synchronize()  # untimed: the copy lands before the next fill, as in a run
        num_rows += sum(samples_under_grammar(seq) for seq in seqs)
        for seq, token_ids in rows:
            if seq.grammar is not None and not seq.is_finished:
                seq.grammar.accept(token_ids[step])
    return dict(fill_alone_ms_per_filled_step=round(statistics.median(times), 3) if times else 0.0,
                alone_fills=len(times), alone_rows_per_fill=round(num_rows / max(1, len(times)), 1))


def full_bitmask_first() -> None:
    """The eighth session's order, for an A/B in one call: a torch.full of the whole batch's
    bitmask on the host (a parallel CPU op from 8 rows of a 152k vocabulary up) right before
    each fill, as fill_token_bitmask made its bitmask then."""
    from nanovllm.engine import sampling_metadata
    fill = sampling_metadata.fill_token_bitmask

    @functools.wraps(fill)
    def after_full(seqs, vocab_size, device):
        if any(samples_under_grammar(seq) for seq in seqs):
            words = -(-vocab_size // sampling_metadata.BITS_PER_WORD)
            torch.full((len(seqs), words), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        return fill(seqs, vocab_size, device)
    sampling_metadata.fill_token_bitmask = after_full


def timed_runs(llm: LLM, prompts, runs: dict[str, list[SamplingParams]], breakdown: StepBreakdown,
               histories: dict | None = None) -> dict:
    """Each run of `runs` once, timed, with its breakdown (and its fills replayed alone);
    `histories`: gets each run's constrained outputs (token ids) by run name."""
    result = {}
    for name, run_params in runs.items():
        breakdown.take()
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, run_params, use_tqdm=False)
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        b = breakdown.take()
        b.update(wall_ms_per_step=round(seconds * 1e3 / b["steps"], 3),
                 cpu_ms_per_step=round(cpu_s * 1e3 / b["steps"], 3))
        if b["fills"]:
            b.update(fill_alone(llm, run_params, outputs))
            alone = max(1e-9, b["fill_alone_ms_per_filled_step"])
            b["fill_engine_over_alone"] = round(b["fill_ms_per_filled_step"] / alone, 2)
        if histories is not None:
            histories[name] = [o.outputs[0].token_ids for o, p in zip(outputs, run_params)
                               if p.structured_outputs is not None]
        # the process's CPU time: on a shared CPU machine, steadier than the wall time
        result[name] = {"seconds": round(seconds, 3), "cpu_s": round(cpu_s, 3), "output_tokens": tokens,
                        "tok_per_s": round(tokens / seconds, 1), "tok_per_cpu_s": round(tokens / cpu_s, 1),
                        "breakdown": b}
        print(f"{name}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s "
              f"({cpu_s:.2f} s of this process's CPU time: {tokens / cpu_s:.1f} tok per CPU s)")
        _print_breakdown(name, result[name]["breakdown"])
    return result


def half_constrained(params: list[SamplingParams]) -> list[SamplingParams]:
    """`params` with every other request under the unbounded array-of-strings schema."""
    constraint = StructuredOutputsParams(json=UNBOUNDED)
    return [SamplingParams(temperature=p.temperature, ignore_eos=True, max_tokens=p.max_tokens,
                           structured_outputs=constraint if i % 2 == 0 else None)
            for i, p in enumerate(params)]


def warm_up(llm: LLM) -> None:
    """Untimed: one constrained request and one free one (the grammar compiles here)."""
    from bench_offline import WARMUP_TOKENS
    constraint = StructuredOutputsParams(json=UNBOUNDED)
    warm = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=WARMUP_TOKENS, structured_outputs=c)
            for c in (constraint, None) * (WARMUP_PROMPTS // 2)]
    llm.generate([[i + 1] * 50 for i in range(WARMUP_PROMPTS)], warm, use_tqdm=False)


def gpu_b1(tokenizer: str, small: bool, histories: dict | None = None) -> dict:
    from bench_offline import QWEN3_0_6B, SMALL, model_dir, workload
    # The small run keeps the real vocabulary (the tokenizer's ids must fit) and workload()'s
    # 100-token minimum lengths.
    cfg = dict(SMALL, vocab_size=QWEN3_0_6B["vocab_size"]) if small else QWEN3_0_6B
    n, max_in, max_out = (16, 128, 128) if small else (256, 1024, 1024)
    prompts, params = workload(n, max_in, max_out)
    llm = LLM(model_dir(cfg), load_format="dummy", tokenizer=tokenizer, max_model_len=4096)
    breakdown = StepBreakdown(llm)
    variants = VariantCounter().__enter__()  # Triton variants first met after start-up: should be none
    warm_up(llm)
    result = timed_runs(llm, prompts, {"unconstrained": params, "half_json": half_constrained(params)}, breakdown,
                        histories)
    variants.__exit__()
    result["variants_after_start"] = len(variants.names)
    print(f"Triton kernel variants first met after start-up: {len(variants.names)} {variants.names}")
    result["ratio"] = round(result["half_json"]["tok_per_s"] / result["unconstrained"]["tok_per_s"], 3)
    print(f"half-constrained / unconstrained throughput: {result['ratio']}")
    return result


def cpu_rounds(tokenizer_dir: str | None, vocab: int | None, repeats: int, batch: int = CPU_ROUNDS_BATCH,
               histories: dict | None = None) -> dict:
    """Free vs half constrained on a tiny CPU model, one-step vs multi-step rounds: `repeats`
    alternating pairs of runs per mode (this shared machine's speed drifts), medians."""
    from bench_offline import SMALL, model_dir, workload
    tokenizer = _tokenizer(tokenizer_dir)
    if tokenizer_dir is None:  # SmolLM2's, saved where model_dir copies it from
        tokenizer_dir = tempfile.mkdtemp(prefix="nanovllm-tokenizer-")
        tokenizer.save_pretrained(tokenizer_dir)
    vocab = vocab or len(tokenizer)
    path = model_dir(dict(SMALL, vocab_size=vocab, torch_dtype="float32", eos_token_id=tokenizer.eos_token_id),
                     tokenizer_dir)
    prompts, params = workload(batch, CPU_ROUNDS_PROMPT, CPU_ROUNDS_TOKENS)
    runs = {"unconstrained": params, "half_json": half_constrained(params)}
    result = {}
    for steps in (1, CPU_ROUNDS_STEPS):
        print(f"num_scheduler_steps={steps}:")
        with LLM(path, load_format="dummy", device="cpu", dtype="float32", max_model_len=1024,
                 num_kvcache_blocks=256, num_scheduler_steps=steps, max_num_seqs=batch) as llm:
            breakdown = StepBreakdown(llm)
            warm_up(llm)
            pairs = [timed_runs(llm, prompts, runs, breakdown, histories) for _ in range(repeats)]
        mode = {name: pairs[-1][name] for name in runs}  # the last pair's figures and breakdown
        for name in runs:
            for key in ("tok_per_s", "tok_per_cpu_s"):
                mode[name][f"{key}_median"] = statistics.median(p[name][key] for p in pairs)
        for key in ("tok_per_s", "tok_per_cpu_s"):
            ratios = [round(p["half_json"][key] / p["unconstrained"][key], 3) for p in pairs]
            mode[f"ratios_{key}"], mode[f"ratio_{key}"] = ratios, statistics.median(ratios)
            print(f"  half-constrained / unconstrained, {key}: median {mode[f'ratio_{key}']} of {ratios}")
        result[f"steps_{steps}"] = mode
    return result


def cpu_mask(tokenizer_dir: str | None, vocab: int | None) -> dict:
    from nanovllm.engine.sampling_metadata import fill_token_bitmask
    from nanovllm.layers.sampler import apply_token_bitmask
    from nanovllm.structured_outputs.manager import StructuredOutputManager
    tokenizer = _tokenizer(tokenizer_dir)
    vocab = vocab or len(tokenizer)
    manager = StructuredOutputManager(tokenizer, vocab, {tokenizer.eos_token_id})
    params = StructuredOutputsParams(json=UNBOUNDED)
    seqs = [Sequence([1]) for _ in range(MASK_BATCH)]
    for seq in seqs:
        seq.grammar = manager.grammar_for(params, frozenset())
    seqs[0].grammar.compiled.result()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(MASK_BATCH, vocab, generator=gen)
    fill, apply, accept, copy = [], [], [], []
    for _ in range(MASK_STEPS):
        t = time.perf_counter()
        logits.clone()  # a reference on the same machine: one pass over the logits
        copy.append(time.perf_counter() - t)
        t0 = time.perf_counter()
        bitmask = fill_token_bitmask(seqs, vocab, torch.device("cpu"))
        t1 = time.perf_counter()
        masked = apply_token_bitmask(logits, bitmask)
        t2 = time.perf_counter()
        tokens = torch.multinomial(torch.softmax(masked, -1), 1, generator=gen).squeeze(1).tolist()
        t3 = time.perf_counter()
        for seq, token in zip(seqs, tokens):
            seq.grammar.accept(token)
        t4 = time.perf_counter()
        fill.append(t1 - t0), apply.append(t2 - t1), accept.append(t4 - t3)
    manager.shutdown()
    result = {name: round(statistics.median(values) * 1e3, 3) for name, values in
              (("fill_ms", fill), ("apply_ms", apply), ("accept_ms", accept), ("logits_copy_ms", copy))}
    result.update(batch=MASK_BATCH, vocab=vocab, steps=MASK_STEPS, threads=torch.get_num_threads())
    print(f"per step at batch {MASK_BATCH}, vocab {vocab} (medians of {MASK_STEPS} steps): fill "
          f"{result['fill_ms']} ms, apply {result['apply_ms']} ms, accept {result['accept_ms']} ms "
          f"(a copy of the logits: {result['logits_copy_ms']} ms)")
    return result


def _tokenizer(directory: str | None):
    """The tokenizer of DIR, else SmolLM2's from the embedded GGUF."""
    if directory is not None:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(directory)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from smollm2_tokenizer import smollm2_tokenizer
    return smollm2_tokenizer()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=None, help="an HF tokenizer directory (Qwen3's for B1)")
    ap.add_argument("--cpu-mask", action="store_true", help="the CPU per-step mask cost at batch 64")
    ap.add_argument("--vocab", type=int, default=None,
                    help="--cpu-mask, --cpu-rounds: the logits' width (the model's vocabulary; Qwen3: 151936)")
    ap.add_argument("--cpu-rounds", action="store_true",
                    help="free vs half constrained on a tiny CPU model, one-step vs multi-step rounds")
    ap.add_argument("--repeats", type=int, default=3, help="--cpu-rounds: alternating pairs of runs per mode")
    ap.add_argument("--batch", type=int, default=CPU_ROUNDS_BATCH, help="--cpu-rounds: requests per run")
    ap.add_argument("--small", action="store_true", help="a tiny GPU smoke run")
    ap.add_argument("--fill-threads", type=int, default=None,
                    help="threads filling each step's bitmasks (default: the engine's)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads before the engine starts (default: torch's, one per core)")
    ap.add_argument("--full-bitmask-first", action="store_true",
                    help="a torch.full of the batch's bitmask before each fill (the order before the ninth session)")
    ap.add_argument("--save-histories", default=None, metavar="FILE",
                    help="write the half-constrained run's constrained outputs (token ids, JSON) to FILE, "
                         "for bench_bitmask_fill.py --histories")
    args = ap.parse_args()
    if args.fill_threads is not None:
        from nanovllm.structured_outputs.backend import set_fill_threads
        set_fill_threads(args.fill_threads)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    if args.full_bitmask_first:
        full_bitmask_first()
    histories = {} if args.save_histories else None
    if args.cpu_mask:
        result = {"benchmark": "structured_cpu_mask", **cpu_mask(args.tokenizer, args.vocab)}
    elif args.cpu_rounds:
        result = {"benchmark": "structured_cpu_rounds",
                  **cpu_rounds(args.tokenizer, args.vocab, args.repeats, args.batch, histories)}
    else:
        if args.tokenizer is None:
            ap.error("the GPU run needs --tokenizer DIR (the grammar is compiled against its vocabulary)")
        result = {"benchmark": "structured_b1", **gpu_b1(args.tokenizer, args.small, histories)}
    if histories:
        with open(args.save_histories, "w") as f:
            json.dump({"schema": UNBOUNDED, "histories": histories.get("half_json", [])}, f)
    print(json.dumps({**result, "fill_threads": args.fill_threads, "torch_threads": torch.get_num_threads(),
                      "full_bitmask_first": args.full_bitmask_first}))


if __name__ == "__main__":
    main()
