"""LLM: the offline facade, as in vLLM.

    llm = LLM(model)
    outs = llm.generate(prompts, SamplingParams(...))          # final outputs, prompt order
    for delta in llm.stream(prompts, params): ...               # what each step added
    outs = llm.chat([{"role": "user", "content": "Hi"}], params)

`generate` folds the engine's per-step deltas into final outputs, so the
non-streaming result is exactly the stream folded. One `LLM` drives one call at a
time: a stream left unfinished is aborted when it is closed or garbage-collected.
"""
from typing import Iterator

from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import LLMEngine, PromptType
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

Conversation = list[dict]


class LLM:
    def __init__(self, model: str | None = None, **kwargs):  # None: the embedded default model
        self.llm_engine = LLMEngine(model, **kwargs)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams uses: the model's generation_config.json defaults."""
        return self.llm_engine.default_sampling_params()

    def shutdown(self) -> None:
        """Release the engine (CUDA graphs, tensor-parallel workers); also done at interpreter
        exit. Not for use afterwards."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, stream: bool = False) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Generate completions for `prompts`.

        Returns the final outputs in prompt order; with `stream=True`, an iterator of
        deltas instead (see `stream`). Raises ValueError, queuing nothing, if any
        prompt or setting is bad.
        """
        if stream:
            return self.stream(prompts, sampling_params)
        ids = self._add_all(prompts, sampling_params)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as bar:
            for deltas in self._steps(ids):
                for delta in deltas:
                    if delta.request_id in results:
                        results[delta.request_id].add(delta)
                    else:
                        results[delta.request_id] = RequestOutput.fold(delta)
                    bar.update(int(delta.finished))
                bar.set_postfix_str(self._throughput())
        return [results[i] for i in ids]

    def stream(self, prompts: PromptType | list[PromptType],
               sampling_params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Queue `prompts` now and return an iterator of their deltas, step by step.

        Each item is a `RequestOutput` with only what is new for one request (new
        text, token ids and logprobs of each advanced sample, `.index` telling which);
        its last item has `finished=True`. Closing the iterator early aborts the
        requests still running. Raises ValueError at the call (nothing queued) for bad input.
        """
        return _flatten(self._steps(self._add_all(prompts, sampling_params)))

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             stream: bool = False, tools: list[dict] | None = None) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template.

        `messages` is one conversation (a list of {"role", "content"} dicts) or a list
        of them (a batch). `chat_template_kwargs` go to the template (for example
        Qwen3's `enable_thinking`); `tools` (OpenAI function tools) go to it as HF's `tools=`.
        Returns as `generate` does.
        """
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        prompts = [self._chat_prompt(c, add_generation_prompt, kwargs)
                   for c in _as_conversations(messages)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, stream=stream)

    def _chat_prompt(self, conversation: Conversation, add_generation_prompt: bool, kwargs: dict) -> dict:
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM runs with skip_tokenizer_init=True")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # raise_exception(), an undefined field, a type error on the messages' values
            raise ValueError(f"the chat template could not render these messages: {e}") from e
        # The template writes the special tokens (BOS included) itself.
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    def _add_all(self, prompts, sampling_params) -> list[str]:
        """Queue every prompt, or none: a bad one aborts those already queued."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params or self.get_default_sampling_params(), len(prompts))
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.llm_engine.add_request(None, prompt, p))
        except Exception:
            for request_id in ids:
                self.llm_engine.abort(request_id)
            raise
        return ids

    def _steps(self, ids: list[str]) -> Iterator[list[RequestOutput]]:
        """Step the engine until the requests `ids` finish; yields each step's deltas of them."""
        pending = set(ids)
        try:
            while pending and self.llm_engine.has_unfinished_requests():
                deltas = [d for d in self.llm_engine.step() if d.request_id in pending]
                pending -= {d.request_id for d in deltas if d.finished}
                yield deltas
        finally:  # closed early: stop what still runs
            for request_id in pending:
                self.llm_engine.abort(request_id)

    def _throughput(self) -> str:
        prefill, decode, seconds = self.llm_engine.last_step_stats
        if seconds <= 0:
            return ""
        kind, n = ("Prefill", prefill) if prefill else ("Decode", decode)
        return f"{kind}: {n / seconds:.0f} tok/s"


def _flatten(steps: Iterator[list[RequestOutput]]) -> Iterator[RequestOutput]:
    try:
        for deltas in steps:
            yield from deltas
    finally:
        steps.close()  # runs the aborts of `LLM._steps` now, not at garbage collection


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    try:
        return list(prompts)
    except TypeError:
        raise ValueError("a prompt must be a string, a list of token ids or a dict, "
                         f"got {type(prompts).__name__}") from None


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {params!r:.80}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)


def _as_conversations(messages) -> list[Conversation]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)")
    conversations = [messages] if isinstance(messages[0], dict) else messages
    for conversation in conversations:
        if (not isinstance(conversation, list) or not conversation
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in conversation)):
            raise ValueError(f"a conversation must be a non-empty list of dicts with a 'role', got {conversation!r}")
    return conversations
