"""Incremental detokenization and stop strings, one sequence at a time.

Decoding each new token alone is wrong: byte-level BPE splits one character (a
Chinese character, an emoji) over several tokens, and SentencePiece drops a
token's leading space when it is decoded alone. So, as vLLM (after TGI) does, we
decode a short window of tokens twice, with and without the new ones, and take
the difference as the new text; while that text ends in U+FFFD (an incomplete
UTF-8 character) we hold it back and wait for the next token.

Stop strings are searched in the text around the new characters, so one that
spans several tokens is found. Streamed text stays `max(len(stop)) - 1`
characters behind, so a stop string's first characters are never sent before
the text is cut in front of it. The deltas, concatenated, always equal the
final text.
"""

# Prompt tokens decoded with the first new tokens: enough context for
# SentencePiece's leading-space rule and for a character split across the
# prompt/output boundary (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        # Streamed text lags behind by this much, so a partial stop string is never sent.
        self.stop_buffer_length = 0 if include_stop_str_in_output else max(map(len, self.stop), default=1) - 1
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        self.token_ids = list(context)  # the decoding window source: prompt context + output tokens
        self.prefix_offset = 0          # start of the window decoded as "already seen" text
        self.read_offset = len(context)  # tokens before this are turned into output text
        self.output_text = ""
        self.num_sent_chars = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token's text; returns the stop string it completed, if any.

        When a stop string is found, `output_text` is cut just before it (or just
        after it with include_stop_str_in_output).
        """
        self.token_ids.append(token_id)
        new_text = self._read_new_text(allow_partial=False)
        self.output_text += new_text
        if not (check_stop and self.stop and new_text):
            return None
        return self._find_stop_string(len(new_text))

    def flush(self) -> None:
        """At the end of a sequence: emit text still held back (an incomplete character)."""
        if self.read_offset < len(self.token_ids):
            self.output_text += self._read_new_text(allow_partial=True)

    def _read_new_text(self, allow_partial: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not allow_partial):
            return ""  # nothing new yet, or an incomplete character: wait for more tokens
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text):]

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
