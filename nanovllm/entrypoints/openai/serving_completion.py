"""POST /v1/completions: text completions, streamed as chunks or folded into one response.

Each prompt of a batch is one engine request with `n` completions; choice
`index` is `prompt_index * n + completion_index`, as in OpenAI's API. `echo`
puts the prompt (and, with `logprobs`, its logprobs) before each choice's text.
"""
import time
from dataclasses import dataclass
from typing import AsyncIterator

from nanovllm.entrypoints.openai.protocol import CompletionRequest
from nanovllm.entrypoints.openai.serving_engine import ChunkStream, OpenAIServing, Usage, collect, new_request_id
from nanovllm.outputs import CompletionOutput, RequestOutput


@dataclass
class PromptInput:
    text: str | None          # None for a prompt given as token ids (decoded only if echoed)
    token_ids: list[int]


@dataclass
class ChoiceState:
    text_offset: int = 0     # characters of this choice's text sent so far (for logprobs' text_offset)
    echoed: bool = False


class OpenAIServingCompletion(OpenAIServing):
    chunk_object = "text_completion"

    async def create_completion(self, req: CompletionRequest) -> ChunkStream | dict:
        """The chunks of a streaming request, or the folded response. Raises APIError."""
        self.check_model(req.model)
        params = self.sampling_params(req.sampling)
        prompts = [self._prompt_input(p) for p in req.prompts]
        request_id = new_request_id("cmpl")
        streams = await self.submit(request_id, [p.token_ids for p in prompts], params, req.structured_param)
        include_usage = req.include_usage or not req.stream
        chunks = self._chunks(request_id, req, prompts, self.merged(streams), params.n, include_usage)
        if req.stream:
            return ChunkStream(chunks, streams, params.n * len(prompts))
        return fold_completion(await collect(chunks))

    def _prompt_input(self, prompt: str | list[int]) -> PromptInput:
        return PromptInput(prompt, self.encode(prompt)) if isinstance(prompt, str) else PromptInput(None, prompt)

    def _prompt_text(self, prompt: PromptInput) -> str:
        """The prompt as text, for echo (token ids are decoded once the engine has accepted them)."""
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""
        return prompt.text

    async def _chunks(self, request_id: str, req: CompletionRequest, prompts: list[PromptInput],
                      outputs: AsyncIterator[tuple[int, RequestOutput]], n: int,
                      include_usage: bool) -> AsyncIterator[dict]:
        created = int(time.time())
        choices: dict[int, ChoiceState] = {}
        usage = Usage(prompt_tokens=sum(len(p.token_ids) for p in prompts))
        try:
            async for prompt_index, output in outputs:
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    state = choices.setdefault(index, ChoiceState())
                    usage.completion_tokens += len(completion.token_ids)
                    choice = self._choice(req, state, index, prompts[prompt_index], output, completion)
                    yield self.chunk(request_id, created, [choice])
        finally:
            await outputs.aclose()
        if include_usage:
            yield self.chunk(request_id, created, [], usage)


    def _choice(self, req: CompletionRequest, state: ChoiceState, index: int, prompt: PromptInput,
                output: RequestOutput, completion: CompletionOutput) -> dict:
        text, logprobs = completion.text, None
        entries = []
        if req.echo and not state.echoed:
            state.echoed = True
            text = self._prompt_text(prompt) + text
            if req.logprobs is not None:
                entries += self.completion_logprob_entries(prompt.token_ids, output.prompt_logprobs, req.logprobs)
        if req.logprobs is not None:
            entries += self.completion_logprob_entries(completion.token_ids, completion.logprobs, req.logprobs)
            logprobs = self._logprobs_object(state, entries)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason}

    @staticmethod
    def _logprobs_object(state: ChoiceState, entries: list) -> dict:
        offsets = []
        for token, _, _ in entries:
            offsets.append(state.text_offset)
            state.text_offset += len(token)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": offsets}


def fold_completion(chunks: list[dict]) -> dict:
    """The non-streaming response: the stream's chunks folded into one object per choice."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            acc = choices.setdefault(c["index"], {"index": c["index"], "text": "", "logprobs": None,
                                                  "finish_reason": None, "stop_reason": None})
            acc["text"] += c["text"]
            if c["logprobs"] is not None:
                acc["logprobs"] = _fold_logprobs(acc["logprobs"], c["logprobs"])
            if c["finish_reason"] is not None:
                acc["finish_reason"], acc["stop_reason"] = c["finish_reason"], c["stop_reason"]
    last = chunks[-1]
    return {"id": last["id"], "object": "text_completion", "created": last["created"], "model": last["model"],
            "choices": [choices[i] for i in sorted(choices)], "usage": last["usage"]}


def _fold_logprobs(acc: dict | None, new: dict) -> dict:
    if acc is None:
        return {key: list(values) for key, values in new.items()}
    for key, values in new.items():
        acc[key].extend(values)
    return acc
