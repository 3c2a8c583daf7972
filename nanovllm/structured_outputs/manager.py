"""The engine's side of structured outputs: compile off the loop, one matcher per sequence.

`StructuredOutputManager.grammar_for(params)` checks a request's constraint at once (a
ValueError for the caller) and starts compiling it in a thread pool, as vLLM does, so
the engine loop never waits for a compile; compiled grammars are cached by their text
(the same schema sent again compiles once, a compile under way is shared). Each sequence
gets a `SequenceGrammar` (n > 1: one per sample) on `Sequence.grammar`:

- the scheduler skips a waiting sequence while its grammar compiles (`is_ready`),
- the sampler's metadata fills the next token bitmasks from their matchers (all rows of a
  step in one threaded call, backend.fill_bitmasks),
- the engine feeds it every new token (`accept`), which says when the grammar is done.

Preemption needs nothing: a preempted sequence keeps its tokens, and its matcher has
accepted exactly those, so recompute samples the next token under the same state.
A grammar with `start_after_token_id` is off (no mask, tokens not matched) until that
token is in the output.
"""
import logging
import os
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from nanovllm.structured_outputs import backend
from nanovllm.structured_outputs.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used ones go first)
MAX_COMPILE_THREADS = 8


class SequenceGrammar:
    """One sequence's matcher over a (maybe still compiling) grammar."""

    def __init__(self, compiled: Future, stop_token_ids: list[int], start_after_token_id: int | None):
        self.compiled = compiled
        self.stop_token_ids = stop_token_ids
        self.start_after_token_id = start_after_token_id
        self.started = start_after_token_id is None
        self._matcher = None

    @property
    def is_ready(self) -> bool:
        """False while the grammar compiles, and after it failed to (the engine then ends it)."""
        return self.compiled.done() and self.compiled.exception() is None

    @property
    def failed(self) -> bool:
        """True once the grammar has failed to compile (the engine then ends the request)."""
        return self.compiled.done() and self.compiled.exception() is not None

    @property
    def is_active(self) -> bool:
        """Whether the next token is constrained."""
        return self.started and not self.matcher.is_terminated()

    @property
    def matcher(self):
        if self._matcher is None:
            self._matcher = backend.new_matcher(self.compiled.result(), self.stop_token_ids)
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Follow `token_id`; True once the grammar is complete (its stop token accepted).
        A token the grammar refuses (only possible when every token was masked) ends it too."""
        if not self.started:
            self.started = token_id == self.start_after_token_id
            return False
        if self.matcher.is_terminated():
            return True
        if not self.matcher.accept_token(token_id):
            logger.warning("token %d does not follow the grammar; the output ends here", token_id)
            return True
        return self.matcher.is_terminated()


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this engine runs with skip_tokenizer_init=True")
        threads = max(1, min(MAX_COMPILE_THREADS, os.cpu_count() or 1))
        self.compiler = backend.GrammarCompiler(tokenizer, vocab_size, threads)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self.stop_token_ids = stop_token_ids
        self._cache: OrderedDict[tuple, Future] = OrderedDict()

    def grammar_for(self, params: StructuredOutputsParams, request_stop_ids: frozenset[int]) -> SequenceGrammar:
        """A new sequence's grammar; ValueError (nothing compiled) if the constraint is invalid.
        `request_stop_ids`: the request's stop_token_ids; with the model's EOS ids they end the grammar."""
        return SequenceGrammar(self._compiled(params), sorted(self.stop_token_ids | request_stop_ids),
                               params.start_after_token_id)

    def _compiled(self, params: StructuredOutputsParams) -> Future:
        key = params.cache_key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        grammar = backend.parse_grammar(params)  # the caller's mistakes show here, at once
        future = self.pool.submit(self._compile, params.kind, grammar)
        self._cache[key] = future
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    def _compile(self, kind: str, grammar):
        try:
            return self.compiler.compile(grammar)
        except Exception as e:  # a grammar that parsed but does not compile
            raise backend.plain_error(kind, e) from None

    @staticmethod
    def wait_for_any(grammars: list[SequenceGrammar], timeout_s: float) -> None:
        """Block until one of `grammars` is compiled (or `timeout_s` passes): the engine's
        wait when every schedulable sequence is waiting for its grammar."""
        wait([g.compiled for g in grammars], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
