"""LLMEngine: wires tokenizer, scheduler, block manager and model runner. No math here.

`add_request` validates and queues a request, `step` runs one scheduled batch and
returns the outputs of the requests it advanced, `abort` drops a request and frees
its blocks at once. `generate` drives `step` until every request is done.
"""
import time
from dataclasses import replace
from itertools import count

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.model_source import ModelSource, resolve_model
from nanovllm.engine.output_processor import OutputProcessor, RequestState
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLMEngine:
    def __init__(self, model: str | None = None, **kwargs):
        model = resolve_model(model)  # None: the embedded default model
        self.config = Config.from_kwargs(model, **kwargs)
        source = ModelSource.resolve(model, self.config.load_format)
        self.model_config = source.model_config()
        self.max_model_len = self.config.max_model_len or self.model_config.max_position_embeddings
        self.tokenizer = None if self.config.skip_tokenizer_init else source.tokenizer(self.config.tokenizer)
        self.model_runner = ModelRunner(self.config, source, self.model_config, self.max_model_len)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, self.config.kvcache_block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens)
        self.output_processor = OutputProcessor(self.tokenizer, self._eos_token_ids(), self.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self._request_of_seq: dict[int, str] = {}
        self._request_counter = count()
        self.last_step_stats = (0, 0, 0.0)  # prefill tokens, decode tokens, seconds

    def _eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests -------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptType,
                    sampling_params: SamplingParams | None = None) -> str:
        """Validate and queue one request. Returns its id.

        Raises ValueError (and queues nothing) for a bad prompt or settings.
        """
        request_id = str(next(self._request_counter)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        prompt_text, token_ids = self._tokenize(prompt)
        params = self._fit_params(token_ids, params)
        seq = Sequence(token_ids, params, self.config.kvcache_block_size)
        self.scheduler.add(seq)
        self.requests[request_id] = RequestState(request_id, prompt_text, seq)
        self._request_of_seq[seq.seq_id] = request_id
        return request_id

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine runs with skip_tokenizer_init=True")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        self._check_token_ids(token_ids)
        return text, token_ids

    def _check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                             "(room for at least one new token is needed)")

    def _fit_params(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None:
            return replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        return params

    def abort(self, request_id: str) -> None:
        """Drop a request; its KV blocks are freed at once. Unknown ids are ignored."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        del self._request_of_seq[state.seq.seq_id]
        if not state.seq.is_finished:
            self.scheduler.finish(state.seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    # ---- stepping -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for each request that got a token or finished."""
        start = time.perf_counter()
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        num_decode = sum(1 for s in seqs if not s.is_prefilling)
        num_prefill = sum(s.num_scheduled_tokens for s in seqs) - num_decode
        token_ids = self.model_runner.run(seqs)
        self.scheduler.postprocess(seqs, token_ids, self.output_processor.check_stop)
        outputs = [self._output_of(seq) for seq, tok in zip(seqs, token_ids) if tok is not None]
        self.last_step_stats = (num_prefill, num_decode, time.perf_counter() - start)
        return outputs

    def _output_of(self, seq: Sequence) -> RequestOutput:
        state = self.requests[self._request_of_seq[seq.seq_id]]
        output = self.output_processor.make_output(state)
        if output.finished:
            del self.requests[state.request_id], self._request_of_seq[seq.seq_id]
        return output
