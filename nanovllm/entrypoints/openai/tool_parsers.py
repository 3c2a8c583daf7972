"""Tool-call parsers: a model's tool-call text -> OpenAI tool calls, per model family.

Each parser follows one choice's text as it streams: `feed(delta)` returns the text that
is plain content and can be sent now, and the tool calls completed so far; `finish()`
returns what is left once the output ended. The non-streaming response folds the same
stream, so both agree. Registry by `--tool-call-parser` name (vLLM's names):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as Hermes,
  Qwen2.5 and Qwen3 write them; text around them is content.
- `llama3_json`: a reply that is JSON, `{"name": ..., "parameters": {...}}` (several
  separated by `;`), optionally after `<|python_tag|>`, as Llama 3.1-3.3 write them.

`NamedCallParser` and `RequiredCallsParser` read the outputs that tool_choice "required"
and named functions constrain (tool_fields.py), whatever the model family.
"""
import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


Parsed = tuple[str, list[ToolCall]]  # content to send, completed calls


def _call(obj, arguments_key: str) -> ToolCall | None:
    """A ToolCall from a parsed {"name", arguments_key} object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                         ensure_ascii=False))


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag` (held back until known)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.pending, self.in_call = "", False

    def feed(self, delta: str) -> Parsed:
        self.pending += delta
        content, calls = "", []
        while True:
            tag = self.END if self.in_call else self.START
            i = self.pending.find(tag)
            if i < 0:
                break
            before, self.pending = self.pending[:i], self.pending[i + len(tag):]
            if self.in_call:
                content += self._call_or_text(before, calls)
            else:
                content += before
            self.in_call = not self.in_call
        if not self.in_call:
            keep = held_back(self.pending, self.START)
            content += self.pending[:len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
        return content, calls

    def finish(self) -> Parsed:
        calls: list[ToolCall] = []
        content = self._call_or_text(self.pending, calls, closed=False) if self.in_call else self.pending
        self.pending, self.in_call = "", False
        return content, calls

    def _call_or_text(self, body: str, calls: list[ToolCall], closed: bool = True) -> str:
        try:
            call = _call(json.loads(body, strict=False), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:  # not a call after all: the model's text, as it wrote it
            return self.START + body + (self.END if closed else "")
        calls.append(call)
        return ""


class Llama3JsonToolParser:
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self):
        self.text, self.is_json = "", None  # None: not known yet (only whitespace so far)

    def feed(self, delta: str) -> Parsed:
        self.text += delta
        if self.is_json is None:
            head = self.text.lstrip()
            if not head or (self.PYTHON_TAG.startswith(head)):
                return "", []
            self.is_json = head.startswith(("{", self.PYTHON_TAG))
            if not self.is_json:
                text, self.text = self.text, ""
                return text, []
        if self.is_json:
            return "", []
        text, self.text = self.text, ""
        return text, []

    def finish(self) -> Parsed:
        text, self.text = self.text, ""
        if not self.is_json:
            return text, []
        calls = _json_calls(text.strip().removeprefix(self.PYTHON_TAG))
        return ("", calls) if calls else (text, [])


def _json_calls(text: str) -> list[ToolCall]:
    """Calls from `{...}; {...}` text; [] if any part is not a call."""
    decoder, calls, i = json.JSONDecoder(strict=False), [], 0
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return []
        call = _call(obj, "parameters")
        if call is None:
            return []
        calls.append(call)
        while i < len(text) and text[i] in "; \n\t\r":
            i += 1
    return calls


class NamedCallParser:
    """tool_choice naming a function: the whole (constrained) output is its arguments."""

    def __init__(self, name: str):
        self.name, self.text = name, ""

    def feed(self, delta: str) -> Parsed:
        self.text += delta
        return "", []

    def finish(self) -> Parsed:
        return "", [ToolCall(self.name, self.text)]


class RequiredCallsParser:
    """tool_choice "required": the (constrained) output is a JSON array of {"name", "parameters"}."""

    def __init__(self):
        self.text = ""

    def feed(self, delta: str) -> Parsed:
        self.text += delta
        return "", []

    def finish(self) -> Parsed:
        try:
            calls = [_call(obj, "parameters") for obj in json.loads(self.text, strict=False)]
        except (json.JSONDecodeError, TypeError):
            calls = []
        if not calls or None in calls:  # cut by max_tokens: the text as it is
            return self.text, []
        return "", calls


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def check_tool_parser(name: str) -> str:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return name
