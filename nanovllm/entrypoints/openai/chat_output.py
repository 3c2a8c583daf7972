"""One chat choice's output as OpenAI deltas: reasoning, content and tool calls.

A `ChoiceParser` follows one choice's text: the reasoning parser (if any) takes the
thinking out, the tool parser (if any) takes tool calls out of the rest, and `choices`
turns each engine delta into the chat chunks' `choices` entries. A tool call streams as
OpenAI streams one: a delta with its index, id, type and name (arguments ""), then deltas
that append to its arguments as the model writes them; the choice then ends with
finish_reason "tool_calls" (unless max_tokens cut it: "length").
"""
from nanovllm.entrypoints.openai import tool_parsers
from nanovllm.entrypoints.openai.reasoning_parsers import ReasoningConfig, ReasoningParser
from nanovllm.outputs import CompletionOutput


class ChoiceParser:
    def __init__(self, reasoning: ReasoningParser | None, tools):
        self.reasoning, self.tools = reasoning, tools
        self.num_calls = 0

    @classmethod
    def of(cls, tool_request, tool_parser: str | None, reasoning: ReasoningConfig | None,
           prompt_token_ids: list[int]) -> "ChoiceParser":
        """The parser of one choice of a request with these tools (None: none) and server parsers."""
        tools = None
        if tool_request is not None:
            if tool_request.choice == "named":
                tools = tool_parsers.NamedCallParser(tool_request.named)
            elif tool_request.choice == "required":
                tools = tool_parsers.RequiredCallsParser()
            else:
                tools = tool_parsers.TOOL_PARSERS[tool_parser]()
        return cls(None if reasoning is None else reasoning.parser(prompt_token_ids), tools)

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[tool_parsers.ToolCallDelta]]:
        """(reasoning, content, tool-call deltas) of a new piece of the choice's text."""
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if finished and self.reasoning is not None:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                more_content, more_calls = self.tools.finish()
                content, calls = content + more_content, calls + more_calls
        return reasoning, content, calls

    def choices(self, c: CompletionOutput, logprobs: dict | None) -> list[dict]:
        """The chunks' choice entries for one engine delta of this choice."""
        reasoning, content, calls = self.feed(c.text, c.finish_reason is not None)
        delta = {"content": content}
        if reasoning:
            delta["reasoning_content"] = reasoning
        finish = c.finish_reason
        if finish == "stop" and (calls or self.num_calls):
            finish = "tool_calls"
        if not calls:
            return [_entry(c.index, delta, logprobs, finish, c.stop_reason)]
        entries = [_entry(c.index, delta, logprobs, None, None)] if content or reasoning or logprobs else []
        for call in calls:
            if call.name is not None:  # a call's first delta
                self.num_calls += 1
                head = {"index": call.index, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}}
                entries.append(_entry(c.index, {"tool_calls": [head]}, None, None, None))
            if call.arguments:
                arguments = {"index": call.index, "function": {"arguments": call.arguments}}
                entries.append(_entry(c.index, {"tool_calls": [arguments]}, None, None, None))
        if finish is not None:
            entries.append(_entry(c.index, {}, None, finish, c.stop_reason))
        return entries


def _entry(index: int, delta: dict, logprobs, finish_reason, stop_reason) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def fold_tool_call(calls: list[dict], delta: dict) -> None:
    """Fold one streamed tool-call delta into a message's `tool_calls`."""
    index = delta["index"]
    if index == len(calls):
        calls.append({"id": delta.get("id"), "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[index]
    function = delta.get("function", {})
    call["function"]["name"] += function.get("name", "")
    call["function"]["arguments"] += function.get("arguments", "")
