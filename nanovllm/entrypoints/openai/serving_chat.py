"""POST /v1/chat/completions: the conversation rendered by the chat template, then generated.

The stream starts with one `{"role": "assistant"}` delta per choice, then content
deltas; the choice's last chunk carries its `finish_reason`. The non-streaming
response is that stream folded into one message per choice.
"""
import time
from typing import AsyncIterator

from nanovllm.entrypoints.openai.chat_template import ChatTemplate
from nanovllm.entrypoints.openai.errors import bad_request
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest
from nanovllm.entrypoints.openai.serving_engine import ChunkStream, OpenAIServing, Usage, collect, new_request_id
from nanovllm.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    chunk_object = "chat.completion.chunk"

    def __init__(self, async_llm, served_model_names: list[str], metrics: ServerMetrics,
                 chat_template: ChatTemplate | None):
        super().__init__(async_llm, served_model_names, metrics)
        self.chat_template = chat_template

    def render(self, messages: list[dict], add_generation_prompt: bool = True, add_special_tokens: bool = False,
               **kwargs) -> list[int]:
        """Token ids of a conversation (the template writes its special tokens itself, so by default
        the tokenizer adds none: no doubled BOS)."""
        if self.chat_template is None:
            raise bad_request("this model has no chat template; start the server with --chat-template FILE",
                              "messages")
        text = self.chat_template.render(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens)

    async def create_chat_completion(self, req: ChatCompletionRequest) -> ChunkStream | dict:
        """The chunks of a streaming request, or the folded response. Raises APIError."""
        self.check_model(req.model)
        params = self.sampling_params(req.sampling)
        token_ids = self.render(req.messages, **req.chat_template_kwargs)
        request_id = new_request_id("chatcmpl")
        streams = await self.submit(request_id, [token_ids], params)
        include_usage = req.include_usage or not req.stream
        chunks = self._chunks(request_id, req, len(token_ids), self.merged(streams), params.n, include_usage)
        if req.stream:
            return ChunkStream(chunks, streams)
        return fold_chat(await collect(chunks))

    async def _chunks(self, request_id: str, req: ChatCompletionRequest, num_prompt_tokens: int,
                      outputs: AsyncIterator[tuple[int, RequestOutput]], n: int,
                      include_usage: bool) -> AsyncIterator[dict]:
        created = int(time.time())
        usage = Usage(prompt_tokens=num_prompt_tokens)
        try:
            for index in range(n):
                yield self.chunk(request_id, created, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}])
            async for _, output in outputs:
                for c in output.outputs:
                    usage.completion_tokens += len(c.token_ids)
                    logprobs = None
                    if req.top_logprobs is not None:
                        logprobs = {"content": self.chat_logprob_entries(c.token_ids, c.logprobs, req.top_logprobs)}
                    choice = {"index": c.index, "delta": {"content": c.text}, "logprobs": logprobs,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    yield self.chunk(request_id, created, [choice])
        finally:
            await outputs.aclose()
        if include_usage:
            yield self.chunk(request_id, created, [], usage)



def fold_chat(chunks: list[dict]) -> dict:
    """The non-streaming response: the stream's deltas folded into one message per choice."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            acc = choices.setdefault(c["index"], {"index": c["index"], "message": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None, "stop_reason": None})
            acc["message"]["content"] += c["delta"].get("content", "")
            if c["logprobs"] is not None:
                acc["logprobs"] = acc["logprobs"] or {"content": []}
                acc["logprobs"]["content"] += c["logprobs"]["content"]
            if c["finish_reason"] is not None:
                acc["finish_reason"], acc["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    last = chunks[-1]
    return {"id": last["id"], "object": "chat.completion", "created": last["created"], "model": last["model"],
            "choices": [choices[i] for i in sorted(choices)], "usage": last["usage"]}
