"""POST /v1/chat/completions: the conversation rendered by the chat template, then generated.

The stream starts with one `{"role": "assistant"}` delta per choice, then content
deltas; the choice's last chunk carries its `finish_reason`. The non-streaming
response is that stream folded into one message per choice.

With a reasoning parser the thinking streams as `reasoning_content` deltas; with tools,
each tool call streams as OpenAI streams them (a delta with its id and name, then deltas of
its arguments as they are written) and the choice ends with finish_reason "tool_calls"
(chat_output.py).
"""
import logging
import time
from dataclasses import replace
from typing import AsyncIterator

from nanovllm.entrypoints.openai.chat_output import ChoiceParser, fold_tool_call
from nanovllm.entrypoints.openai.chat_template import ChatTemplate
from nanovllm.entrypoints.openai.errors import bad_request
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest
from nanovllm.entrypoints.openai.reasoning_parsers import ReasoningConfig
from nanovllm.entrypoints.openai.serving_engine import ChunkStream, OpenAIServing, Usage, collect, new_request_id
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")


class OpenAIServingChat(OpenAIServing):
    chunk_object = "chat.completion.chunk"

    def __init__(self, async_llm, served_model_names: list[str], metrics: ServerMetrics,
                 chat_template: ChatTemplate | None, tool_parser: str | None = None,
                 reasoning: ReasoningConfig | None = None):
        """`tool_parser`: the --tool-call-parser for tool_choice "auto" (None: "auto" is refused);
        `reasoning`: the --reasoning-parser's tags."""
        super().__init__(async_llm, served_model_names, metrics)
        self.chat_template = chat_template
        self.tool_parser = tool_parser
        self.reasoning = reasoning
        self._warned_tools = False

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
        if req.tools is not None and req.tools.choice == "auto" and self.tool_parser is None:
            raise bad_request("tool_choice 'auto' needs the server started with --enable-auto-tool-choice and "
                              "--tool-call-parser NAME; 'required' or a named function work without", "tool_choice")
        token_ids = self.render(req.messages, **self._template_kwargs(req))
        params = self._constraint_after_reasoning(params, token_ids)
        request_id = new_request_id("chatcmpl")
        streams = await self.submit(request_id, [token_ids], params, req.structured_param)
        include_usage = req.include_usage or not req.stream
        parsers = [ChoiceParser.of(req.tools, self.tool_parser, self.reasoning, token_ids) for _ in range(params.n)]
        chunks = self._chunks(request_id, req, len(token_ids), self.merged(streams), parsers, include_usage)
        if req.stream:
            return ChunkStream(chunks, streams, params.n)
        return fold_chat(await collect(chunks))

    def _template_kwargs(self, req: ChatCompletionRequest) -> dict:
        """chat_template_kwargs, with the tools (HF's `tools=`) when the model may call them."""
        kwargs = dict(req.chat_template_kwargs)
        if req.tools is not None:
            kwargs.setdefault("tools", req.tools.tools)
            if not self.chat_template.mentions_tools and not self._warned_tools:
                self._warned_tools = True
                logger.warning("the chat template ignores 'tools': the model is not shown them; tool_choice "
                               "'required' and named functions still work through an output constraint")
        return kwargs

    def _constraint_after_reasoning(self, params: SamplingParams, token_ids: list[int]) -> SamplingParams:
        """A reasoning model thinks freely: its output constraint starts after the end tag."""
        if self.reasoning is None or params.structured_outputs is None \
                or self.reasoning.prompt_ends_reasoning(token_ids):
            return params
        constraint = replace(params.structured_outputs, start_after_token_id=self.reasoning.end_token_id)
        return replace(params, structured_outputs=constraint)

    async def _chunks(self, request_id: str, req: ChatCompletionRequest, num_prompt_tokens: int,
                      outputs: AsyncIterator[tuple[int, RequestOutput]], parsers: list[ChoiceParser],
                      include_usage: bool) -> AsyncIterator[dict]:
        created = int(time.time())
        usage = Usage(prompt_tokens=num_prompt_tokens)
        try:
            for index in range(len(parsers)):
                yield self.chunk(request_id, created, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}])
            async for _, output in outputs:
                for c in output.outputs:
                    usage.completion_tokens += len(c.token_ids)
                    logprobs = None
                    if req.top_logprobs is not None:
                        logprobs = {"content": self.chat_logprob_entries(c.token_ids, c.logprobs, req.top_logprobs)}
                    for choice in parsers[c.index].choices(c, logprobs):
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
            message, delta = acc["message"], c["delta"]
            message["content"] += delta.get("content", "")
            if "reasoning_content" in delta:
                message["reasoning_content"] = message.get("reasoning_content", "") + delta["reasoning_content"]
            for call in delta.get("tool_calls", ()):
                fold_tool_call(message.setdefault("tool_calls", []), call)
            if c["logprobs"] is not None:
                acc["logprobs"] = acc["logprobs"] or {"content": []}
                acc["logprobs"]["content"] += c["logprobs"]["content"]
            if c["finish_reason"] is not None:
                acc["finish_reason"], acc["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    for acc in choices.values():
        if acc["message"].get("tool_calls") and not acc["message"]["content"]:
            acc["message"]["content"] = None  # as OpenAI: a reply of calls only has no content
    last = chunks[-1]
    return {"id": last["id"], "object": "chat.completion", "created": last["created"], "model": last["model"],
            "choices": [choices[i] for i in sorted(choices)], "usage": last["usage"]}
