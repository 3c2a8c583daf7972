"""Start-up warm-up: every Triton kernel variant the engine can launch is compiled (or loaded
from Triton's on-disk cache) while the engine starts, never in the middle of user traffic.

Triton compiles a kernel once per *variant*: per value of its `tl.constexpr` arguments, per
argument dtype, and per implicit specialization of its int and pointer arguments (`== 1`,
divisibility by 16) unless the kernel opts out with `do_not_specialize`. A variant first met
by a request costs it seconds (tens of seconds for a server under load).

The warm-up does not list kernels. It drives the runner's own step paths (`ModelRunner.run`,
`ModelRunner.launch_decode_round`) with scratch sequences whose shapes cover every kind of
step the scheduler makes, so whatever the model's forward and the sampler reach is compiled,
including kernels added later:

- prefill: a short prompt, a whole chunk of `max_num_batched_tokens`, a chunk that stops
  mid-prompt (no sampling), a few tokens over a long cached prefix (split-KV), and one of
  each token count at which a product kernel changes its tile (`_product_row_bounds`: the
  batches between the CUDA-graph sizes, up to `max_num_batched_tokens`; several prompts where
  one prompt cannot hold that many);
- a mixed step (a decode beside a prefill chunk);
- decodes at every CUDA-graph batch size (or, eager, at the same sizes) and one decode at
  the longest context (split-KV);
- one decode per sampling profile (`SAMPLING_PROFILES`): each option that changes what the
  sampler launches, since a batch's options pick its path; and the profiles whose path
  changes under a structured-output grammar (`GRAMMAR_PROFILES`) once more with an
  allow-all token bitmask (a real matcher needs xgrammar and a tokenizer; the kernels see
  only the mask's shape and dtype);
- multi-step decode rounds, plain and chained (tensor_parallel_size 1: the only case
  that runs them). A lazy round (grammar, penalties, min_tokens rows: engine/decode_round.py)
  launches the same forwards and, per step, the sampler with metadata built on the host:
  the kernels see the shapes and dtypes of the sampling and grammar profiles' steps, so
  those cover it.

The scratch sequences' block tables point into the first `SCRATCH_BLOCKS` blocks of the
KV cache (zeroed before and after; entries repeat, so any context length fits in them).
No scheduler or block manager is involved, and the global RNG states are restored after.
`compile_progress` prints a line on stderr as each variant starts compiling, over the whole
start-up (the memory-sizing step and the CUDA-graph captures compile most of them first).

Rules for kernels, so that this covers them:
1. No `tl.constexpr` may take a value that varies at run time (token count, batch size,
   context length, split count): pass it as a plain int and list it in `do_not_specialize`
   if Triton would specialize it (`== 1`, `% 16`). Constexprs come from the model config,
   the engine config or a fixed table.
2. A kernel reached from the model's forward is covered as long as every variant it has
   is reached by one of the step shapes above; one whose variant depends on a new kind of
   step (or a new SamplingParams option) adds that step or profile here.
3. `tests/test_warmup_gpu.py` counts kernel variants first met after start-up over a
   workload of every path, and asserts none.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanovllm.engine.cuda_graph import capture_sizes
from nanovllm.engine.sampling_metadata import SamplingMetadata
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels import kv_quant
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_outputs.backend import BITS_PER_WORD
from nanovllm.utils.context import set_context

if TYPE_CHECKING:  # model_runner imports this module
    from nanovllm.engine.model_runner import ModelRunner

SCRATCH_BLOCKS = 4          # KV blocks the scratch sequences write into
SHORT_PROMPT = 32           # tokens of a short prompt
PREFIX_QUERY_TOKENS = 16    # new tokens of a prefill over a long cached prefix
MULTI_STEP_BATCH = 2        # sequences of the warm-up's multi-step rounds
MULTI_STEP_STEPS = 2        # steps of each warm-up round
WARMUP_TEMPERATURE = 0.8
MIN_CONTEXT = 2             # the shortest prompt or context a step uses

# SamplingParams of one row that pick a different sampler path (the sampler's module
# docstring): an option added to SamplingParams that changes what is launched adds a
# profile here. Stop token 0 makes min_tokens ban a token.
SAMPLING_PROFILES: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=WARMUP_TEMPERATURE),
    "seeded": SamplingParams(temperature=WARMUP_TEMPERATURE, seed=0),
    "top-k": SamplingParams(temperature=WARMUP_TEMPERATURE, top_k=5),
    "top-p": SamplingParams(temperature=WARMUP_TEMPERATURE, top_p=0.9),
    "min-p": SamplingParams(temperature=WARMUP_TEMPERATURE, min_p=0.1),
    "penalties": SamplingParams(temperature=WARMUP_TEMPERATURE, repetition_penalty=1.1,
                                frequency_penalty=0.1, presence_penalty=0.1),
    "greedy penalties": SamplingParams(temperature=0.0, repetition_penalty=1.1),
    "logit bias": SamplingParams(temperature=WARMUP_TEMPERATURE, logit_bias={0: -1.0}),
    "min tokens": SamplingParams(temperature=WARMUP_TEMPERATURE, min_tokens=4, stop_token_ids=[0]),
    "allowed tokens": SamplingParams(temperature=WARMUP_TEMPERATURE, allowed_token_ids=[0, 1]),
    "logprobs": SamplingParams(temperature=WARMUP_TEMPERATURE, logprobs=5),
    "greedy logprobs": SamplingParams(temperature=0.0, logprobs=5),
}
# Profiles whose sampler path differs with a grammar bitmask: the fused draw reads the mask
# (greedy and random rows), the other transforms take it applied to float32 logits first.
GRAMMAR_PROFILES = ("greedy", "temperature", "top-k", "penalties")
PROMPT_LOGPROBS = SamplingParams(temperature=WARMUP_TEMPERATURE, prompt_logprobs=5)
RANDOM = SAMPLING_PROFILES["temperature"]


@dataclass(frozen=True)
class ScratchSeq:
    """One scratch sequence of a warm-up step: `computed` tokens already in the cache,
    `scheduled` computed by the step, `total` tokens in all (prompt + `generated`)."""
    computed: int
    scheduled: int
    total: int
    generated: int
    params: SamplingParams


@dataclass(frozen=True)
class WarmupStep:
    name: str
    seqs: tuple[ScratchSeq, ...]
    decode_round: bool = False  # a multi-step round (and a chained one) instead of one step
    grammar_bitmask: bool = False  # sample under an allow-all structured-output bitmask


def _prefill(prompt: int, computed: int = 0, scheduled: int | None = None,
             params: SamplingParams = RANDOM) -> ScratchSeq:
    return ScratchSeq(computed, prompt - computed if scheduled is None else scheduled, prompt, 0, params)


def _decode(context: int, params: SamplingParams = RANDOM) -> ScratchSeq:
    """A decode of the token at position context - 1 (one generated token so far)."""
    return ScratchSeq(context - 1, 1, context, 1, params)


def warmup_steps(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
                 multi_step: bool) -> list[WarmupStep]:
    """The steps of the warm-up, for an engine of these limits."""
    # room after the longest context for a round and a chained one (positions < max_model_len)
    longest = max(MIN_CONTEXT + 1, max_model_len - 2 * MULTI_STEP_STEPS - 1)
    chunk = max(MIN_CONTEXT, min(max_num_batched_tokens, longest))
    short = max(MIN_CONTEXT, min(SHORT_PROMPT, chunk))
    prefix_queries = max(1, min(PREFIX_QUERY_TOKENS, chunk, longest - 1))
    steps = [
        WarmupStep("prefill, short prompt", (_prefill(short),)),
        WarmupStep("prefill, one whole chunk", (_prefill(chunk),)),
        WarmupStep("prefill, a chunk ending mid-prompt", (_prefill(longest + 1, 0, min(chunk, longest)),)),
        WarmupStep("prefill over a long cached prefix", (_prefill(longest, longest - prefix_queries),)),
        WarmupStep("mixed prefill and decode", (_decode(longest), _prefill(short))),
        WarmupStep("decode, longest context", (_decode(longest),)),
        WarmupStep("prompt logprobs", (_prefill(short, params=PROMPT_LOGPROBS),)),
    ]
    for rows in _product_row_bounds():
        prompts = _prompts_of(rows, chunk)  # a step of more tokens than one prompt holds: several prompts
        if rows <= max_num_batched_tokens and len(prompts) <= max_num_seqs:
            steps.append(WarmupStep(f"prefill, {rows} tokens (a product tile's bound)",
                                    tuple(_prefill(n) for n in prompts)))
    for size in sorted(set(capture_sizes(max_num_seqs)) | {max_num_seqs}):
        steps.append(WarmupStep(f"decode, batch {size}", tuple(_decode(short) for _ in range(size))))
    for name, params in SAMPLING_PROFILES.items():
        steps.append(WarmupStep(f"sampling: {name}", (_decode(short, params),)))
    for name in GRAMMAR_PROFILES:
        steps.append(WarmupStep(f"sampling under a grammar: {name}", (_decode(short, SAMPLING_PROFILES[name]),),
                                grammar_bitmask=True))
    if multi_step:
        batch = min(MULTI_STEP_BATCH, max_num_seqs)
        steps.append(WarmupStep("multi-step rounds", tuple(_decode(short) for _ in range(batch)), True))
        steps.append(WarmupStep("multi-step rounds, longest context", (_decode(longest),), True))
    return steps


def _prompts_of(tokens: int, most: int) -> list[int]:
    """Prompt lengths of at most `most` tokens (each at least MIN_CONTEXT) that add up to `tokens`."""
    count = -(-tokens // most)
    if tokens - (count - 1) * most < MIN_CONTEXT and count > 1:  # a last prompt too short: spread them
        return [tokens // count + (i < tokens % count) for i in range(count)]
    return [most] * (count - 1) + [tokens - (count - 1) * most]


def _product_row_bounds() -> list[int]:
    """Token counts up to which a product kernel keeps one tile (kernels/triton_batch_gemm.py's
    table); none without Triton."""
    try:
        from nanovllm.kernels import triton_batch_gemm
    except ImportError:
        return []
    return triton_batch_gemm.row_bounds()


def _sequence(shape: ScratchSeq, block_size: int, vocab_size: int, blocks: int) -> Sequence:
    token_ids = [(7 * i + 3) % vocab_size for i in range(shape.total)]
    seq = Sequence(token_ids[:shape.total - shape.generated], shape.params, block_size)
    for token in token_ids[shape.total - shape.generated:]:
        seq.append_token(token)
    seq.num_computed_tokens = shape.computed
    seq.num_scheduled_tokens = shape.scheduled
    # cover a multi-step round and a chained one after the scheduled token
    needed = -(-(shape.total + 2 * MULTI_STEP_STEPS + 1) // block_size)
    seq.block_table = [i % blocks for i in range(needed)]
    return seq


def run_step(runner: ModelRunner, step: WarmupStep) -> None:
    """Run one warm-up step on `runner` (every rank runs the same steps, in the same order)."""
    seqs = [_sequence(s, runner.block_size, runner.model_config.vocab_size,
                      min(SCRATCH_BLOCKS, runner.num_kvcache_blocks)) for s in step.seqs]
    if step.grammar_bitmask:
        _sample_under_bitmask(runner, seqs)
        return
    if not step.decode_round:
        runner.run(seqs)
        return
    first = runner.launch_decode_round(seqs, MULTI_STEP_STEPS)
    chained = runner.launch_decode_round(seqs, MULTI_STEP_STEPS, after=first)
    for decode_round in (first, chained):
        for _ in decode_round.outputs():
            pass


@torch.inference_mode()
def _sample_under_bitmask(runner: ModelRunner, seqs: list[Sequence]) -> None:
    """One decode step of `seqs` whose sampling takes an allow-all grammar bitmask, as
    `ModelRunner.run` samples (every rank runs the forward; rank 0 alone has logits)."""
    input_ids, positions, context, _ = runner.prepare(seqs)
    with set_context(context):
        logits = runner.model.compute_logits(runner.model(input_ids, positions))
    if logits is None:
        return
    vocab_size = runner.model_config.vocab_size
    metadata = SamplingMetadata.build(seqs, vocab_size, logits.device)
    metadata.token_bitmask = torch.full((len(seqs), -(-vocab_size // BITS_PER_WORD)), -1,
                                        dtype=torch.int32, device=logits.device)  # [num_seqs, words]
    runner.sampler(logits, metadata)


class VariantCounter:
    """Counts the Triton kernel variants a process meets for the first time (compiled, or
    loaded from the on-disk cache), through Triton's `jit_cache_hook`; `names`: each one's
    kernel and specialized signature, in order.
    Chains to a hook already installed. `available` is False where this Triton has no hook
    (then nothing is counted)."""

    def __init__(self, on_new: Callable[[str, int], None] | None = None):
        """`on_new(kernel name, count so far)`: called as each new variant starts compiling."""
        self.names: list[str] = []
        self._on_new = on_new
        self._knobs = _runtime_knobs()
        self.available = self._knobs is not None

    def __enter__(self) -> VariantCounter:
        if self.available:
            self._previous = self._knobs.jit_cache_hook
            self._knobs.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        if self.available:
            self._knobs.jit_cache_hook = self._previous

    def _hook(self, *args, **kwargs):
        self.names.append(str(kwargs.get("repr")))
        if self._on_new is not None:
            self._on_new(getattr(kwargs.get("fn"), "name", "?"), len(self.names))
        return self._previous(*args, **kwargs) if self._previous is not None else False


def _runtime_knobs():
    try:
        import triton
    except ImportError:
        return None
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    return knobs if knobs is not None and hasattr(knobs, "jit_cache_hook") else None


@contextmanager
def _rng_kept(device: torch.device):
    """The global RNG states (CPU and the device's) as they were before."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def _zero_scratch(runner: ModelRunner) -> None:
    for attn in runner._attention_layers():  # as bytes: an fp8 cache too (0 bytes are fp8 0.0)
        kv_quant.as_bytes(attn.k_cache)[:SCRATCH_BLOCKS].zero_()
        kv_quant.as_bytes(attn.v_cache)[:SCRATCH_BLOCKS].zero_()


@contextmanager
def compile_progress(rank: int):
    """While the engine starts: a line on stderr (rank 0) as each Triton kernel variant starts
    compiling or loading from the disk cache, so a cold start does not look hung."""
    start = time.perf_counter()

    def on_new(name: str, count: int) -> None:
        if rank == 0:
            _stderr(f"compiling kernels: {count} so far, {time.perf_counter() - start:.1f} s ({name})")
    with VariantCounter(on_new) as counter:
        yield counter


def log_startup_phase(rank: int, what: str, start: float) -> None:
    """A line on stderr (rank 0) saying that one phase of start-up, begun at `start`
    (time.perf_counter()), is done and how long it took."""
    if rank == 0:
        _stderr(f"start-up: {what} in {time.perf_counter() - start:.1f} s")


def warm_up_kernels(runner: ModelRunner, log: Callable[[str], None] | None = None) -> int:
    """Run every warm-up step on `runner`; returns the kernel variants met (0 where not counted).
    `log`: the steps that met new variants, and a summary (default: stderr on rank 0)."""
    if log is None:
        log = _stderr if runner.rank == 0 else (lambda line: None)
    config = runner.config
    steps = warmup_steps(runner.max_model_len, config.max_num_batched_tokens, config.max_num_seqs,
                         multi_step=runner.tp_size == 1)
    start = time.perf_counter()
    _zero_scratch(runner)
    with _rng_kept(runner.device), VariantCounter() as counter:
        for i, step in enumerate(steps, 1):
            before = len(counter.names)
            run_step(runner, step)
            new = len(counter.names) - before
            if new:
                log(f"kernel warm-up: step {i}/{len(steps)} ({step.name}) met {new}, "
                    f"{len(counter.names)} so far, {time.perf_counter() - start:.1f} s")
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    _zero_scratch(runner)
    counted = f"{len(counter.names)} kernel variants" if counter.available else "kernel variants not counted"
    log(f"kernel warm-up: {len(steps)} steps, {counted}, {time.perf_counter() - start:.1f} s")
    return len(counter.names)


def _stderr(line: str) -> None:
    print(f"nanovllm: {line}", file=sys.stderr, flush=True)
