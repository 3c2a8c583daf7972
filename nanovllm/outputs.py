"""RequestOutput / CompletionOutput: results shaped like vLLM's.

Nano-vLLM's dict-style access keeps working: `out["text"]` and
`out["token_ids"]` read the first completion.
"""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None          # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None   # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


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
