"""RequestOutput / CompletionOutput: results shaped like vLLM's.

`LLMEngine.step()` returns deltas (vLLM's `RequestOutputKind.DELTA`): each
output carries only what is new since the request's previous output. A final
result is those deltas folded with `RequestOutput.add`, so the non-streaming
result is, by construction, the stream folded.

Nano-vLLM's dict-style access keeps working: `out["text"]` and
`out["token_ids"]` read the first completion.
"""
from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None          # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int                         # which of the request's n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with `logprobs` set)
    logprobs: list[dict[int, Logprob]] | None = None  # per token: sampled + top alternatives
    finish_reason: str | None = None   # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: "CompletionOutput") -> None:
        """Fold the next delta of the same sample into this one."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def copy(self) -> "CompletionOutput":
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative_logprob,
                                None if self.logprobs is None else list(self.logprobs),
                                self.finish_reason, self.stop_reason)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __getitem__(self, key: str):
        """Nano-vLLM compatibility: out["text"], out["token_ids"]."""
        if key in ("text", "token_ids"):
            return getattr(self.outputs[0], key)
        raise KeyError(key)

    def add(self, delta: "RequestOutput") -> None:
        """Fold the next delta of the same request into this output (in place)."""
        assert delta.request_id == self.request_id, (delta.request_id, self.request_id)
        by_index = {c.index: c for c in self.outputs}
        for completion in delta.outputs:
            if completion.index in by_index:
                by_index[completion.index].add(completion)
            else:
                self.outputs.append(completion.copy())
        self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    @classmethod
    def fold(cls, first: "RequestOutput") -> "RequestOutput":
        """A fresh accumulator that starts from `first` (which stays untouched)."""
        return cls(first.request_id, first.prompt, first.prompt_token_ids, [c.copy() for c in first.outputs],
                   first.finished, first.num_cached_tokens, first.prompt_logprobs)
