"""xgrammar behind three calls: parse a constraint, compile it for a vocabulary, match tokens.

xgrammar (imported here only, when a request first asks for a constraint: it imports
pydantic and tvm-ffi, which a GPU machine may lack) parses JSON schemas, regexes and EBNF
grammars into a `Grammar`, compiles one against the tokenizer's vocabulary into a
`CompiledGrammar` (tens of milliseconds for a schema), and a `GrammarMatcher` per sequence
follows the output token by token and fills a token bitmask: int32 words, bit j of word i
set when token 32 i + j may come next.

Its errors are RuntimeErrors that start with a time and a C++ file path; `plain_error`
turns them into a ValueError that names the request field and the problem alone.
"""
import json
import os
import re
import threading

from nanovllm.structured_outputs.params import StructuredOutputsParams

BITS_PER_WORD = 32
# JSON: the longest run of whitespace between two tokens (llama.cpp's JSON grammar allows
# 20 too): models, and random ones always, can loop on whitespace where any is allowed
MAX_JSON_WHITESPACE = 20
# "[12:34:56] /project/cpp/regex_converter.cc:94: " and xgrammar's check prefix
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+\.(cc|h|cpp):\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured outputs need the xgrammar package (pip install 'nano-vllm[structured]'); "
                         f"it failed to import: {e}") from None
    return xgrammar


def plain_error(field: str, error: Exception) -> ValueError:
    """xgrammar's `error` as a ValueError naming `field`, without C++ paths or times."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(error).strip().splitlines()]
    message = next((line for line in lines if line), type(error).__name__)
    message = message.split(". The JSON string is:")[0]
    return ValueError(f"{field}: {message}")


def parse_grammar(params: StructuredOutputsParams):
    """The constraint as an xgrammar `Grammar`; ValueError naming the field if it is invalid."""
    xgr, kind = _xgrammar(), params.kind
    try:
        if kind in ("json", "json_object"):  # json_object: any object, as vLLM compiles it
            schema = params.schema_text if kind == "json" else '{"type": "object"}'
            return xgr.Grammar.from_json_schema(schema, any_whitespace=not params.disable_any_whitespace,
                                                strict_mode=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise plain_error(kind, e) from None


class GrammarCompiler:
    """Compiles parsed grammars for one vocabulary. The tokenizer's vocabulary is read
    (about 0.5 s for 50k tokens) on the first compile, in the caller's thread."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int):
        self.tokenizer, self.vocab_size, self.max_threads = tokenizer, vocab_size, max_threads
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, grammar):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
        return self._compiler.compile_grammar(grammar)


def new_matcher(compiled_grammar, stop_token_ids: list[int]):
    """A matcher at the start of `compiled_grammar`; it ends on any of `stop_token_ids`."""
    return _xgrammar().GrammarMatcher(compiled_grammar, override_stop_tokens=stop_token_ids)


_batch_matcher = None  # xgrammar's threaded bitmask filler, made at first use
_fill_threads: int | None = None  # set_fill_threads; None: one per core


def set_fill_threads(num_threads: int | None) -> None:
    """Threads that fill a step's bitmasks (None: one per core). The engine loop waits for
    the fill, so while it runs every core may take part: 128 rows of Qwen3's vocabulary
    inside JSON strings filled in 1.41 ms on 16 threads against 1.62 ms on 8, 5.9 ms on one
    (an H200's 16-core host, benchmarks/bench_bitmask_fill.py)."""
    global _batch_matcher, _fill_threads
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"the bitmask fill needs at least one thread, got {num_threads}")
    _fill_threads, _batch_matcher = num_threads, None


def fill_bitmasks(matchers: list, bitmask, rows: list[int]) -> None:
    """Write each matcher's next-token bitmask into its row of `bitmask` ([rows, words] int32,
    CPU), on xgrammar's threads (set_fill_threads)."""
    global _batch_matcher
    if _batch_matcher is None:
        _batch_matcher = _xgrammar().BatchGrammarMatcher(max_threads=_fill_threads or os.cpu_count() or 1)
    _batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def apply_token_bitmask_inplace(logits, bitmask) -> None:
    """Set the logits of tokens the bitmask clears to -inf, in place (float32 CPU logits)."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask)
