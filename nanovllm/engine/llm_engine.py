"""LLMEngine: wires tokenizer, scheduler, block manager and model runner. No math here.

`add_request` validates and queues a request, `step` runs one scheduled batch and
returns what is new for each request it advanced (vLLM's DELTA outputs), `abort`
drops a request and frees its blocks at once. `LLM` (llm.py) drives `step` for
scripts: streamed, or with the deltas folded into final outputs.
"""
import atexit
import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from itertools import count

from nanovllm.config import ARRIVAL_ROUND_STEPS, DEFAULT_GPU_SCHEDULER_STEPS, MIN_CLIPPED_ROUND_STEPS, Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.distributed import make_model_runner
from nanovllm.engine.decode_round import DecodeRound
from nanovllm.engine.model_source import ModelSource, resolve_model
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.sampling_metadata import ModelRunnerOutput
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.warmup import log_startup_phase
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_outputs.manager import StructuredOutputManager
from nanovllm.utils.device import resolve_device

PromptType = str | list[int] | dict
GRAMMAR_WAIT_S = 0.05  # longest wait for a grammar to compile when nothing else can run

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (the model, tokenizer, torch's and transformers'
    own) out of the garbage collector's view, as vLLM does once it has started: a full
    collection otherwise walks all of them, one pause of ~100 ms on B1 that the GPU waited
    out (benchmarks/RESULTS.md). Objects made later are collected as usual; frozen ones are
    still freed by reference counting; cycles among them are collected when the next engine
    starts (an earlier engine dropped since, say), or at exit (native extensions such as
    Triton's report their objects as leaked otherwise)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # one exit hook, however many engines start
    atexit.register(gc.unfreeze)


class LLMEngine:
    def __init__(self, model: str | None = None, **kwargs):
        model = resolve_model(model)  # None: the embedded default model
        self.config = Config.from_kwargs(model, **kwargs)
        source = ModelSource.resolve(model, self.config.load_format)
        self.model_config = source.model_config()
        self.generation_defaults = self._generation_defaults(source)
        self.max_model_len = self._max_model_len()
        self.num_scheduler_steps = self._num_scheduler_steps()
        self.async_scheduling = self._async_scheduling()
        if self.config.adaptive_rounds:
            self._check_multi_step("adaptive_rounds shapes multi-step decode rounds")
        # Rounds launched (prefill steps included) since the last request was added; None once
        # the rounds have grown back to full length (config.ARRIVAL_ROUND_STEPS).
        self._rounds_since_arrival: int | None = None
        self._next_round: DecodeRound | None = None  # launched ahead of the host (async scheduling)
        # Set by `serve_online`, for a caller that queues requests outside the engine (AsyncLLM):
        # while it returns True no round is chained, so newcomers join at the next round boundary.
        self.requests_arriving: Callable[[], bool] = lambda: False
        tokenizer = self._load_tokenizer_in_background(source)
        self.model_runner = make_model_runner(self.config, source, self.model_config, self.max_model_len)
        self.tokenizer = tokenizer.result()
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, self.config.kvcache_block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens)
        self.eos_token_ids = self._eos_token_ids()
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.structured_outputs: StructuredOutputManager | None = None  # made by the first constrained request
        self._request_counter = count()
        self.last_step_stats = (0, 0, 0.0)  # prefill tokens, decode tokens, seconds
        freeze_startup_heap()

    def _load_tokenizer_in_background(self, source: ModelSource) -> Future:
        """The tokenizer (None with skip_tokenizer_init), loaded in a thread while the model runner
        builds, which waits much of the time on weight files, native code or the device with the GIL
        let go. On CPU `LLM(...)` of a dummy Qwen3-0.6B took a median 4.39 s against 5.81; a GGUF
        model, whose build holds the GIL, gained nothing (benchmarks/RESULTS.md, "Thirtieth session").
        A load that fails raises from `result()`, after the model runner is built."""
        future: Future = Future()
        if self.config.skip_tokenizer_init:
            future.set_result(None)
            return future
        load = source.tokenizer_loader(self.config.tokenizer)   # imports here, in this thread

        def run():
            start = time.perf_counter()
            try:
                future.set_result(load())
            except BaseException as e:
                future.set_exception(e)
                return
            log_startup_phase(0, "tokenizer loaded beside the model runner", start)
        threading.Thread(target=run, name="nanovllm-tokenizer-load", daemon=True).start()
        return future

    @staticmethod
    def _generation_defaults(source: ModelSource) -> dict:
        """What a request that leaves sampling fields out gets (the model's generation_config.json)."""
        defaults = source.generation_defaults()
        if defaults:
            try:
                SamplingParams(**defaults)
            except ValueError as e:
                raise ValueError(f"generation_config.json of {source.path}: {e}") from None
            logger.info("sampling defaults from the model's generation_config.json: %s", defaults)
        return defaults

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (vLLM's
        get_default_sampling_params): what a call without SamplingParams uses."""
        return SamplingParams(**self.generation_defaults)

    def _max_model_len(self) -> int:
        """Config.max_model_len, or the model's max_position_embeddings; never beyond what the
        model supports (its positions, with rope scaling; and its sliding window)."""
        mc, limit = self.model_config, self.model_config.max_model_len_limit
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            window = "" if mc.sliding_window is None else (
                f"; sliding window {mc.sliding_window}: sliding-window attention runs only on "
                "contexts that fit in the window")
            raise ValueError(f"max_model_len {self.config.max_model_len} is beyond this model's limit {limit}: "
                             f"max_position_embeddings {mc.max_position_embeddings} (with rope scaling: "
                             f"{mc.max_rope_positions}){window}")
        return self.config.max_model_len or min(mc.max_position_embeddings, limit)

    def _num_scheduler_steps(self) -> int:
        steps, tp = self.config.num_scheduler_steps, self.config.tensor_parallel_size
        if steps is None:
            on_gpu = resolve_device(self.config.device).type == "cuda"
            return DEFAULT_GPU_SCHEDULER_STEPS if on_gpu and tp == 1 else 1
        if steps > 1 and tp > 1:
            raise ValueError(f"num_scheduler_steps {steps} needs tensor_parallel_size 1, got {tp}")
        return steps

    def _async_scheduling(self) -> bool:
        """On by default where multi-step rounds run on a GPU: there the next round's launch
        overlaps the current one. On a CPU every launch runs to the end at once, so chaining
        gains nothing there and wastes the rows of sequences that stop."""
        wanted = self.config.async_scheduling
        if wanted:
            self._check_multi_step("async_scheduling chains multi-step decode rounds")
        if wanted is None:
            return self.num_scheduler_steps > 1 and resolve_device(self.config.device).type == "cuda"
        return wanted

    def _check_multi_step(self, what: str) -> None:
        """ValueError (`what` names the option) unless decode rounds are multi-step."""
        if self.num_scheduler_steps == 1:
            how = "given" if self.config.num_scheduler_steps else "the default on this device and tensor_parallel_size"
            raise ValueError(f"{what}: it needs num_scheduler_steps > 1, got 1 ({how})")

    @property
    def adaptive_rounds(self) -> bool:
        """Whether rounds follow arrivals and ends of requests (Config.adaptive_rounds,
        config.ARRIVAL_ROUND_STEPS; start-up refused it without multi-step rounds)."""
        return self.config.adaptive_rounds

    def _eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests -------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptType,
                    sampling_params: SamplingParams | None = None) -> str:
        """Validate and queue one request. Returns its id.

        Args:
            request_id: a string unique among unfinished requests; None picks one.
            prompt: text, a list of token ids, or a dict with "prompt" and/or "prompt_token_ids".
            sampling_params: the request's settings (default: SamplingParams()). With n > 1 the
                request runs n sequences that share the prompt's KV blocks.

        Raises ValueError (and queues nothing) for a bad prompt or settings.
        """
        request_id = self._new_request_id() if request_id is None else request_id
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, token_ids = self._tokenize(prompt)
        params = self._fit_params(token_ids, sampling_params or self.default_sampling_params())
        block_size = self.config.kvcache_block_size
        seqs = [Sequence(token_ids, self._sample_params(params, i), block_size) for i in range(params.n)]
        self._attach_grammars(seqs, params)
        self.scheduler.add(seqs[0])  # raises before anything is queued; the others are the same size
        for seq in seqs[1:]:
            self.scheduler.add(seq, prefill_parent=seqs[0])
        self.output_processor.add_request(request_id, prompt_text, seqs)
        if self.adaptive_rounds:
            self._rounds_since_arrival = 0   # short rounds again while the batch has room
        return request_id

    def serve_online(self, requests_arriving: Callable[[], bool]) -> None:
        """For a caller that adds requests while the engine runs (AsyncLLM, the engine process):
        `requests_arriving` says whether it holds requests not added yet (no round is chained
        past them)."""
        self.requests_arriving = requests_arriving

    def _new_request_id(self) -> str:
        request_id = str(next(self._request_counter))
        while request_id in self.output_processor:
            request_id = str(next(self._request_counter))
        return request_id

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            text = prompt.get("prompt")
            prompt = prompt.get("prompt_token_ids", text)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine runs with skip_tokenizer_init=True")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        self._check_token_ids(token_ids)
        return text, token_ids

    def _check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        # checked at C speed (types, then min and max); the first bad id is looked up only on error
        if (any(not issubclass(t, int) or issubclass(t, bool) for t in set(map(type, token_ids)))
                or min(token_ids) < 0 or max(token_ids) >= vocab):
            bad = next(t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab)
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                             "(room for at least one new token is needed)")

    def _fit_params(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check `params` against this engine; returns a copy with max_tokens filled in."""
        if params.n > self.config.max_n:
            raise ValueError(f"n must be <= max_n ({self.config.max_n}), got {params.n}")
        vocab = self.model_config.vocab_size
        for name, named_ids in params.named_token_ids.items():
            bad = next((t for t in named_ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
        self._check_min_tokens_reachable(params)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine runs with skip_tokenizer_init=True")
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        if params.min_tokens > room:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + min_tokens ({params.min_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        return replace(params, max_tokens=params.max_tokens or room)

    def _check_min_tokens_reachable(self, params: SamplingParams) -> None:
        """min_tokens bans the stop tokens; if they are all allowed_token_ids leaves, every logit
        of the row would be -inf and the sampler would emit a token outside the allowed set."""
        if params.min_tokens == 0 or params.allowed_token_ids is None:
            return
        if params.stop_token_ids_with(self.eos_token_ids).issuperset(params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids: every allowed token ({sorted(set(params.allowed_token_ids))}) "
                             f"is EOS or a stop token, so min_tokens={params.min_tokens} cannot be reached")

    def _sample_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """The params of sample `index` of a request: as vLLM, sample i of a seeded request uses seed + i."""
        seed = None if params.seed is None else params.seed + index
        sample_params = replace(params, n=1, seed=seed)
        sample_params.set_eos_token_ids(self.eos_token_ids)
        return sample_params

    def _attach_grammars(self, seqs: list[Sequence], params: SamplingParams) -> None:
        """Structured outputs: a grammar (compiled in the background) per sequence; ValueError
        for a constraint that does not parse."""
        if params.structured_outputs is None:
            return
        if self.structured_outputs is None:
            self.structured_outputs = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                              self.eos_token_ids)
        for seq in seqs:
            seq.grammar = self.structured_outputs.grammar_for(params.structured_outputs,
                                                              frozenset(params.stop_token_ids))

    def abort(self, request_id: str) -> None:
        """Drop a request; its KV blocks are freed at once. Unknown or finished ids are ignored."""
        state = self.output_processor.pop_request(request_id)
        if state is None:
            return
        for seq_state in state.seqs:
            if not seq_state.seq.is_finished:
                self.scheduler.finish(seq_state.seq, "abort")

    def shutdown(self) -> None:
        """Release the model runner: its CUDA graphs, and its worker processes under tensor
        parallelism; idempotent. Not for use afterwards (one GPU would run eager, a
        tensor-parallel engine raises)."""
        self.model_runner.shutdown()
        if self.structured_outputs is not None:
            self.structured_outputs.shutdown()

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    # ---- stepping -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return a delta for each request that got tokens or finished.

        Each `RequestOutput` carries only what is new since that request's previous
        output (vLLM's RequestOutputKind.DELTA): per advanced sample (`.index`) the new
        text, token ids and logprobs, and finish_reason/stop_reason once it ends;
        `prompt_logprobs` come with the request's first output; `finished` is True
        on the last output of a request.
        """
        start = time.perf_counter()
        decode_round, self._next_round = self._next_round, None  # launched by the previous step
        if decode_round is not None and any(not seq.is_finished for seq in decode_round.seqs):
            return self._finish_round(decode_round, start)
        # a round whose sequences all ended is dropped unread: what it writes lands on
        # the device before anything launched later, and its pinned copies keep their memory
        failed = self._drop_failed_grammars()
        if failed:
            return failed
        seqs = self.scheduler.schedule()
        if not seqs:
            self._wait_for_grammars()
            return []
        num_steps = self._decode_steps(seqs)
        self._count_round()
        if num_steps > 1:
            return self._finish_round(self.model_runner.launch_decode_round(seqs, num_steps), start)
        num_decode = sum(1 for s in seqs if not s.is_prefilling)
        num_prefill = sum(s.num_scheduled_tokens for s in seqs) - num_decode
        output = self._postprocess(seqs, self.model_runner.run(seqs))
        advanced = [seq for seq, token in zip(seqs, output.sampled_token_ids) if token is not None]
        self.last_step_stats = (num_prefill, num_decode, time.perf_counter() - start)
        return self.output_processor.make_outputs(advanced)

    def _drop_failed_grammars(self) -> list[RequestOutput]:
        """Finish ("abort") waiting sequences whose grammar parsed but failed to compile."""
        if self.structured_outputs is None:
            return []
        failed = [seq for seq in self.scheduler.waiting if seq.grammar is not None and seq.grammar.failed]
        for seq in failed:
            logger.error("request of sequence %d: its grammar does not compile: %s", seq.seq_id,
                         seq.grammar.compiled.exception())
            self.scheduler.finish(seq, "abort")
        return self.output_processor.make_outputs(failed)

    def _wait_for_grammars(self) -> None:
        """Nothing could run: wait (a little) for a grammar that holds a sequence back."""
        compiling = [seq.grammar for seq in self.scheduler.waiting if seq.waiting_for_grammar]
        if compiling:
            StructuredOutputManager.wait_for_any(compiling, GRAMMAR_WAIT_S)

    def _finish_round(self, decode_round: DecodeRound, start: float) -> list[RequestOutput]:
        """Take a launched decode round's tokens step by step as the device produces them.

        With async scheduling, the next round is launched once only this round's last
        step is outstanding, so the device goes on while the host finishes this one.
        A chained round may carry sequences that finished (or were aborted) since its
        launch: their rows are computed and dropped. A lazy round (grammar, penalties,
        min_tokens rows) queues each step's sampling once the step before is
        postprocessed here (its matchers have accepted its tokens): engine/decode_round.py.
        """
        seqs = decode_round.seqs
        live = [seq for seq in seqs if not seq.is_finished]
        num_tokens = sum(seq.num_tokens for seq in live)

        def chain() -> None:
            self._next_round = self._chain(decode_round)
        for output in decode_round.outputs(on_last_step=chain if self.async_scheduling else None):
            for seq in seqs:
                seq.num_scheduled_tokens = 1  # postprocess consumes one token a step
            self._postprocess(seqs, output)
        num_new = sum(seq.num_tokens for seq in live) - num_tokens  # dropped rows not counted
        self.last_step_stats = (0, num_new, time.perf_counter() - start)
        return self.output_processor.make_outputs(live)

    def _chain(self, decode_round: DecodeRound) -> DecodeRound | None:
        """Launch the round after `decode_round`, whose last step the host has not seen yet;
        None when the next round needs the scheduler (newcomers that could join, a running sequence
        outside this round, too few free blocks, one-step rounds)."""
        in_round = {seq.seq_id for seq in decode_round.seqs if not seq.is_finished}
        if self.requests_arriving() or any(s.seq_id not in in_round for s in self.scheduler.running):
            return None
        # sequences that the outstanding token ends for sure are left out, and a waiting sequence
        # takes the slot of one (a round clipped to max_tokens ends there); a stop token or string
        # ends others only once seen, and their rows in the next round are dropped
        seqs = [s for s in self.scheduler.running if not self.output_processor.reaches_length(s, 1)]
        if not seqs or self.scheduler.can_admit(num_leaving=len(self.scheduler.running) - len(seqs)):
            return None
        num_steps = self._decode_steps(seqs, num_pending=1)
        if num_steps == 1:
            return None
        for seq in seqs:
            seq.num_scheduled_tokens = 1
        self._count_round()
        return self.model_runner.launch_decode_round(seqs, num_steps, after=decode_round)

    def _decode_steps(self, seqs: list[Sequence], num_pending: int = 0) -> int:
        """Decode steps to run back to back this round (1: a plain step), after `num_pending`
        tokens not seen by the host yet; the scheduler reserves their blocks.

        A row whose sampling follows its own new tokens (a structured-output grammar,
        penalties, min_tokens pending) makes the round lazy: each step's sampling is
        built as the host takes the step before (engine/decode_round.py), so every
        batch of decodes runs multi-step and chains.
        """
        if self.num_scheduler_steps == 1:
            return 1
        return self.scheduler.extend_decode(seqs, self._max_round_steps(seqs, num_pending), self.max_model_len,
                                            num_pending)

    def _max_round_steps(self, seqs: list[Sequence], num_pending: int) -> int:
        """The most decode steps a round of `seqs` may run: num_scheduler_steps, never more than the
        longest of them still needs (a step past every row's max_tokens would only be dropped), and
        with adaptive rounds fewer (config.ARRIVAL_ROUND_STEPS): while the rounds after an arrival
        grow back and the batch has room, and up to where a sequence reaches max_tokens."""
        to_length = [s.sampling_params.max_tokens - s.num_completion_tokens - num_pending for s in seqs]
        steps = min(self.num_scheduler_steps, max(to_length))
        if not self.adaptive_rounds:
            return steps
        if self._rounds_since_arrival is not None and len(seqs) < self.config.max_num_seqs:
            steps = min(steps, ARRIVAL_ROUND_STEPS << self._rounds_since_arrival)
        first_end = min(to_length)
        return first_end if MIN_CLIPPED_ROUND_STEPS <= first_end < steps else steps

    def _count_round(self) -> None:
        """One more round (or plain step) launched since the last arrival."""
        if self._rounds_since_arrival is not None:
            self._rounds_since_arrival += 1
            if ARRIVAL_ROUND_STEPS << self._rounds_since_arrival >= self.num_scheduler_steps:
                self._rounds_since_arrival = None

    def _postprocess(self, seqs: list[Sequence], output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Apply one step's sampled tokens; sequences that finished earlier in a multi-step
        round ignore the rest of it."""
        live = [i for i, seq in enumerate(seqs) if not seq.is_finished]
        if len(live) < len(seqs):
            finished_ids = {seq.seq_id for seq in seqs if seq.is_finished}
            output.logprobs = {k: v for k, v in output.logprobs.items() if k not in finished_ids}
            seqs, output.sampled_token_ids = [seqs[i] for i in live], [output.sampled_token_ids[i] for i in live]
        self.output_processor.record(output)
        self.scheduler.postprocess(seqs, output.sampled_token_ids, self._check_stop)
        return output

    def _check_stop(self, seq: Sequence) -> str | None:
        """The output processor's stop checks; a constrained sequence follows its new token in
        its grammar too, and stops ("stop") once the grammar is complete."""
        reason = self.output_processor.check_stop(seq)
        if seq.grammar is not None and seq.grammar.accept(seq.last_token) and reason is None:
            reason = "stop"
        return reason
