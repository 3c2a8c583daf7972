"""Output processing: decides when a sequence is finished and builds RequestOutputs.

The scheduler asks `check_stop(seq)` after each new token; this module owns the
answer (EOS ids, max_tokens, the model's length limit) and turns sequences into
vLLM-shaped outputs.
"""
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import CompletionOutput, RequestOutput


class RequestState:
    """One request: its id, prompt text and the sequence that serves it."""

    def __init__(self, request_id: str, prompt: str | None, seq: Sequence):
        self.request_id = request_id
        self.prompt = prompt
        self.seq = seq


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check_stop(self, seq: Sequence) -> str | None:
        params = seq.sampling_params
        if not params.ignore_eos and seq.last_token in self.eos_token_ids:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def make_output(self, state: RequestState) -> RequestOutput:
        seq = state.seq
        token_ids = seq.completion_token_ids
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""
        completion = CompletionOutput(0, text, token_ids, finish_reason=seq.finish_reason)
        return RequestOutput(state.request_id, state.prompt, seq.prompt_token_ids, [completion],
                             finished=seq.is_finished, num_cached_tokens=seq.num_cached_tokens)
