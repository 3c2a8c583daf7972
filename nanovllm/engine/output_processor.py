"""Output processing: stop checks, detokenization, logprobs, and the per-step deltas.

The engine registers each request here with its sequences (n of them for n > 1).
After a forward pass, `record` keeps the logprobs the runner computed; the
scheduler asks `check_stop(seq)` after each new token (this decodes the token and
answers "stop" for EOS, a stop token id or a stop string, "length" for
max_tokens or the model's length limit); `make_outputs` then returns one
`RequestOutput` per advanced request with only what is new since its previous
output (vLLM's `RequestOutputKind.DELTA`), and forgets finished requests.
"""
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.sampling_metadata import ModelRunnerOutput, TokenLogprobs
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput


class SequenceState:
    """One of a request's samples: its sequence, detokenizer and what is not reported yet."""

    def __init__(self, request: "RequestState", index: int, seq: Sequence, detokenizer):
        self.request, self.index, self.seq = request, index, seq
        self.detokenizer: IncrementalDetokenizer | None = detokenizer
        self.num_sent_tokens = 0
        self.new_logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = None if seq.sampling_params.logprobs is None else 0.0
        self.stop_reason: int | str | None = None


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, seqs: list[Sequence], tokenizer):
        self.request_id, self.prompt = request_id, prompt
        self.prompt_token_ids = seqs[0].prompt_token_ids
        self.seqs = [SequenceState(self, i, seq, _detokenizer(tokenizer, seq)) for i, seq in enumerate(seqs)]
        wants_prompt_logprobs = seqs[0].sampling_params.prompt_logprobs is not None
        # Position 0 has no logprob (nothing predicts it), as in vLLM.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = [None] if wants_prompt_logprobs else None
        self.prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        return all(s.seq.is_finished for s in self.seqs)


def _detokenizer(tokenizer, seq: Sequence) -> IncrementalDetokenizer | None:
    if tokenizer is None:
        return None
    p = seq.sampling_params
    return IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, p.skip_special_tokens, p.stop,
                                  p.include_stop_str_in_output)


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}
        self._seq_states: dict[int, SequenceState] = {}

    # ---- requests -------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def add_request(self, request_id: str, prompt: str | None, seqs: list[Sequence]) -> None:
        state = RequestState(request_id, prompt, seqs, self.tokenizer)
        self.requests[request_id] = state
        for seq_state in state.seqs:
            self._seq_states[seq_state.seq.seq_id] = seq_state

    def pop_request(self, request_id: str) -> RequestState | None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq_state in state.seqs:
                del self._seq_states[seq_state.seq.seq_id]
        return state

    # ---- after a forward pass ---------------------------------------------------

    def record(self, output: ModelRunnerOutput) -> None:
        """Keep the step's logprobs until the next `make_outputs`."""
        for seq_id, entry in output.logprobs.items():
            state = self._seq_states[seq_id]
            state.new_logprobs.append(self._logprob_dict(entry))
            state.cumulative_logprob += entry[1][0]
        for seq_id, (first, entries) in output.prompt_logprobs.items():
            request = self._seq_states[seq_id].request
            if self._seq_states[seq_id].index != 0:
                continue  # every sample shares the prompt: the first one reports it
            for position, entry in enumerate(entries, first):
                if position == len(request.prompt_logprobs):  # skips positions recomputed after preemption
                    request.prompt_logprobs.append(self._logprob_dict(entry))

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        """The chosen token (with its rank) then the top k (ranks 1..k), as vLLM builds it."""
        token_ids, logprobs, rank = entry
        ranks = [rank, *range(1, len(token_ids))]
        return {t: Logprob(lp, r, self._decode_one(t)) for t, lp, r in zip(token_ids, logprobs, ranks)}

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def check_stop(self, seq: Sequence) -> str | None:
        """Called once per new token of `seq`: the finish reason, or None to go on."""
        state = self._seq_states[seq.seq_id]
        params, token_id = seq.sampling_params, seq.last_token
        may_stop = seq.num_completion_tokens > params.min_tokens
        if may_stop and token_id in params.all_stop_token_ids:
            # EOS reports no stop_reason; a stop_token_ids entry reports itself (as vLLM).
            state.stop_reason = token_id if token_id in params.stop_token_ids else None
            if params.include_stop_str_in_output and state.detokenizer is not None:
                state.detokenizer.add_token(token_id, check_stop=False)
            return "stop"
        if state.detokenizer is not None:
            stop = state.detokenizer.add_token(token_id, check_stop=may_stop)
            if stop is not None:
                state.stop_reason = stop
                return "stop"
        return "length" if self.reaches_length(seq) else None

    def reaches_length(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        """Whether `seq` is at max_tokens or the model's length limit once it has
        `num_new_tokens` more tokens."""
        return (seq.num_completion_tokens + num_new_tokens >= seq.sampling_params.max_tokens
                or seq.num_tokens + num_new_tokens >= self.max_model_len)

    # ---- outputs ---------------------------------------------------------------

    def make_outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Deltas of the requests whose sequences in `seqs` got a token this step."""
        touched: dict[str, list[SequenceState]] = {}
        for seq in seqs:
            state = self._seq_states[seq.seq_id]
            touched.setdefault(state.request.request_id, []).append(state)
        outputs = []
        for request_id, states in touched.items():
            request = self.requests[request_id]
            outputs.append(self._request_delta(request, sorted(states, key=lambda s: s.index)))
            if request.finished:
                self.pop_request(request_id)
        return outputs

    def _request_delta(self, request: RequestState, states: list[SequenceState]) -> RequestOutput:
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [self._completion_delta(s) for s in states], finished=request.finished,
                             num_cached_tokens=request.seqs[0].seq.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _completion_delta(state: SequenceState) -> CompletionOutput:
        seq = state.seq
        text = ""
        if state.detokenizer is not None:
            text = state.detokenizer.get_delta(seq.is_finished)
        start = seq.num_prompt_tokens + state.num_sent_tokens
        token_ids = seq.token_ids[start:]
        state.num_sent_tokens += len(token_ids)
        logprobs = None
        if seq.sampling_params.logprobs is not None:
            logprobs, state.new_logprobs = state.new_logprobs, []
        return CompletionOutput(state.index, text, token_ids, state.cumulative_logprob, logprobs,
                                seq.finish_reason, state.stop_reason if seq.is_finished else None)
