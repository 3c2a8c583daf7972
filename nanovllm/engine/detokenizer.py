"""Incremental detokenization and stop strings, one sequence at a time.

Decoding each new token alone is wrong: byte-level BPE splits one character (a
Chinese character, an emoji) over several tokens, and SentencePiece drops a
token's leading space when it is decoded alone. Both paths below decode new
tokens in the context of the previous ones and hold text back while it ends in an
incomplete UTF-8 character, so a partial character is never emitted (one still
incomplete when the sequence ends is dropped, as in vLLM):
- fast: the Rust `tokenizers.decoders.DecodeStream` of an HF fast tokenizer
  (about 1 us per token);
- window: any tokenizer with `decode`, as vLLM (after TGI) does: decode a short
  window of tokens with and without the new one and take the difference, waiting
  while it ends in U+FFFD (about 25 us per token).

Stop strings are searched in the text around the new characters, so one that
spans several tokens is found. Streamed text stays `max(len(stop)) - 1`
characters behind, so a stop string's first characters are never sent before
the text is cut in front of it. The deltas, concatenated, equal the final text.
"""
try:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # no Rust tokenizers: the window path serves every tokenizer
    RustTokenizer = DecodeStream = None

# Prompt tokens decoded before the first new token: enough context for
# SentencePiece's leading-space rule and for a character split across the
# prompt/output boundary (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 use_decode_stream: bool = True):
        """`use_decode_stream=False` forces the window path (the fast path needs an HF fast tokenizer)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        # Streamed text lags behind by this much, so a partial stop string is never sent.
        self.stop_buffer_length = 0 if include_stop_str_in_output else max(map(len, self.stop), default=1) - 1
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        backend = getattr(tokenizer, "_tokenizer", None)  # an HF fast tokenizer's Rust tokenizer
        self._backend = backend if use_decode_stream and DecodeStream and isinstance(backend, RustTokenizer) else None
        self._stream = self._new_stream(context) if self._backend is not None else None
        self.token_ids = context          # window path: prompt context + output tokens
        self.prefix_offset = 0            # window path: start of the text already seen
        self.read_offset = len(context)   # window path: tokens before this are in output_text
        self.output_text = ""
        self.num_sent_chars = 0

    def _new_stream(self, context: list[int]):
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for token_id in context:  # prime it; the prompt's own text is not output
            stream.step(self._backend, token_id)
        return stream

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token's text; returns the stop string it completed, if any.

        When a stop string is found, `output_text` is cut just before it (or just
        after it with include_stop_str_in_output).
        """
        new_text = self._stream_text(token_id) if self._stream is not None else self._window_text(token_id)
        self.output_text += new_text
        if not (check_stop and self.stop and new_text):
            return None
        return self._find_stop_string(len(new_text))

    def _stream_text(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""  # None: an incomplete character

    def _window_text(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or an incomplete character: wait for more tokens
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text):]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _find_stop_string(self, num_new_chars: int) -> str | None:
        for stop in self.stop:
            # A match must end inside the new characters: search from just before them.
            start = max(0, len(self.output_text) - num_new_chars - len(stop) + 1)
            index = self.output_text.find(stop, start)
            if index != -1:
                end = index + len(stop) if self.include_stop_str_in_output else index
                self.output_text = self.output_text[:end]
                return stop
        return None

    def get_delta(self, finished: bool) -> str:
        """Text not sent yet; while running, the last `stop_buffer_length` characters wait."""
        end = len(self.output_text) if finished else max(
            self.num_sent_chars, len(self.output_text) - self.stop_buffer_length)
        delta = self.output_text[self.num_sent_chars:end]
        self.num_sent_chars = end
        return delta
