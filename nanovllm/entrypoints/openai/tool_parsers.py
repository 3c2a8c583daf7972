"""Tool-call parsers: a model's tool-call text -> OpenAI tool calls, per model family.

Each parser follows one choice's text as it streams: `feed(delta)` returns the text that
is plain content and can be sent now, and the tool-call deltas it can send now;
`finish()` returns what is left once the output ended. A call streams as OpenAI streams
one: a first delta with its index, id and name (once the name is known), then its
arguments' JSON text piece by piece, as the model writes it (`CallStream`: the call
object is scanned as far as it has come). The non-streaming response folds the same
stream, so both agree. Registry by `--tool-call-parser` name (vLLM's names):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as Hermes,
  Qwen2.5 and Qwen3 write them; text around them is content (a block that names no
  function is content too).
- `llama3_json`: a reply that is JSON, `{"name": ..., "parameters": {...}}` (several
  separated by `;`), optionally after `<|python_tag|>`, as Llama 3.1-3.3 write them.

`NamedCallParser` and `RequiredCallsParser` read the outputs that tool_choice "required"
and named functions constrain (tool_fields.py), whatever the model family. A call cut by
max_tokens keeps the arguments written so far (finish_reason "length"), as OpenAI's.
"""
import json
from dataclasses import dataclass

from nanovllm.utils.random_ids import random_hex

_WS = " \t\n\r"


def new_call_id() -> str:
    return f"call_{random_hex(24)}"


@dataclass
class ToolCallDelta:
    """One piece of a streamed tool call: the first has its `id` and `name` (arguments "" or
    more), the later ones only more `arguments` text."""
    index: int       # the call's position in the choice's calls
    arguments: str   # JSON text appended to the call's arguments
    name: str | None = None
    id: str | None = None


Parsed = tuple[str, list[ToolCallDelta]]  # content to send, tool-call deltas to send


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag` (held back until known)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---- scanning a call object as far as it has come -------------------------------------------

def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at text[i]; None while it is open."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i]; None while it is incomplete."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":  # a number or literal ends at a delimiter
        j = i
        while j < len(text) and text[j] not in ",}]" + _WS:
            j += 1
        return j if j < len(text) else None
    depth, j = 0, i
    while j < len(text):
        if text[j] == '"':
            j = _string_end(text, j)
            if j is None:
                return None
            continue
        depth += text[j] in "{["
        depth -= text[j] in "}]"
        j += 1
        if depth == 0:
            return j
    return None


@dataclass
class _Scan:
    name: str | None = None
    arguments: tuple[int, int | None] | None = None  # (start, end) of their text; end None: open
    end: int | None = None  # past the object's closing brace


def _scan_call(text: str, argument_keys: tuple[str, ...]) -> _Scan:
    """What the start of a `{"name": ..., <argument key>: ...}` object in `text` says so far."""
    scan, i = _Scan(), _skip_ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return scan
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text) or text[i] not in '",}':
            return scan
        if text[i] in ",}":
            if text[i] == "}":
                scan.end = i + 1
                return scan
            i += 1
            continue
        key_end = _string_end(text, i)
        colon = None if key_end is None else _skip_ws(text, key_end)
        if colon is None or colon >= len(text) or text[colon] != ":":
            return scan
        start = _skip_ws(text, colon + 1)
        if start >= len(text):
            return scan
        key, end = text[i + 1:key_end - 1], _value_end(text, start)
        if key in argument_keys and scan.arguments is None:
            scan.arguments = (start, end)
        if end is None:
            return scan
        if key == "name" and text[start] == '"':
            scan.name = _loads(text[start:end])
        i = end


def _loads(text: str):
    try:
        return json.loads(text, strict=False)
    except json.JSONDecodeError:
        return None


class CallStream:
    """One call object's text as it streams -> its deltas: the first once its name is known,
    then its arguments' text as far as it goes (whitespace at the very end held back: it may
    follow the value). Arguments given as a JSON string are sent whole, decoded, once
    complete; a call without arguments gets "{}"."""

    def __init__(self, index: int, argument_keys: tuple[str, ...]):
        self.index, self.argument_keys = index, argument_keys
        self.id = new_call_id()
        self.started, self.sent, self.end = False, 0, None

    def update(self, text: str, final: bool = False) -> list[ToolCallDelta]:
        """Deltas for the object text so far (`text`, from its opening brace); `final`: the
        text ends here (the object closed, or the output did)."""
        scan = _scan_call(text, self.argument_keys)
        self.end = scan.end
        if scan.name is None or not isinstance(scan.name, str):
            return []
        deltas = []
        if not self.started:
            self.started = True
            deltas.append(ToolCallDelta(self.index, "", scan.name, self.id))
        arguments = self._arguments(text, scan, final or scan.end is not None)
        if len(arguments) > self.sent:
            deltas.append(ToolCallDelta(self.index, arguments[self.sent:]))
            self.sent = len(arguments)
        return deltas

    @staticmethod
    def _arguments(text: str, scan: _Scan, final: bool) -> str:
        """The arguments' text known so far."""
        if scan.arguments is None:
            return "{}" if final else ""
        start, end = scan.arguments
        if text[start] == '"':  # arguments as a JSON string of their JSON
            value = _loads(text[start:end]) if end is not None else None
            return value if isinstance(value, str) else ""
        return text[start:end] if end is not None else text[start:].rstrip(_WS)


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.pending, self.in_call = "", False
        self.body, self.call, self.num_calls = "", None, 0

    def feed(self, delta: str) -> Parsed:
        self.pending += delta
        content, deltas = "", []
        while True:
            if self.in_call:
                i = self.pending.find(self.END)
                if i < 0:  # the body so far, but what may begin the end tag
                    keep = held_back(self.pending, self.END)
                    self.body += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    deltas += self.call.update(self.body)
                    break
                self.body += self.pending[:i]
                self.pending = self.pending[i + len(self.END):]
                content += self._close(deltas, closed=True)
            else:
                i = self.pending.find(self.START)
                if i < 0:
                    keep = held_back(self.pending, self.START)
                    content += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content += self.pending[:i]
                self.pending = self.pending[i + len(self.START):]
                self.in_call, self.body = True, ""
                self.call = CallStream(self.num_calls, ("arguments",))
        return content, deltas

    def finish(self) -> Parsed:
        deltas: list[ToolCallDelta] = []
        if not self.in_call:
            content, self.pending = self.pending, ""
            return content, deltas
        self.body += self.pending
        self.pending = ""
        return self._close(deltas, closed=False), deltas

    def _close(self, deltas: list[ToolCallDelta], closed: bool) -> str:
        """End the call block: its last deltas, or (no function named) its text as content."""
        deltas += self.call.update(self.body, final=True)
        self.in_call = False
        if self.call.started:
            self.num_calls += 1
            return ""
        return self.START + self.body + (self.END if closed else "")


class _CallSequence:
    """Call objects one after another (`{...}; {...}`, or the items of a JSON array when
    `opening` is "["), each streamed as it is written; anything else ends the calls."""

    def __init__(self, argument_keys: tuple[str, ...], separators: str, opening: str = ""):
        self.argument_keys, self.separators, self.opening = argument_keys, separators + _WS, opening
        self.text, self.offset, self.opened, self.broken = "", 0, not opening, False
        self.call: CallStream | None = None
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> list[ToolCallDelta]:
        self.text += delta
        deltas: list[ToolCallDelta] = []
        while not self.broken and (self.call is not None or self._next_object()):
            deltas += self.call.update(self.text[self.offset:], final)
            if self.call.end is None and not final:
                break
            self.offset += self.call.end or len(self.text) - self.offset
            self.num_calls += self.call.started
            self.call = None
        return deltas

    def _next_object(self) -> bool:
        """Move to the next object's opening brace; False while none has begun (or none will)."""
        i = _skip_ws(self.text, self.offset)
        if not self.opened and i < len(self.text):
            self.broken = self.text[i] != self.opening
            self.opened, i = True, i + 1
        while i < len(self.text) and self.text[i] in self.separators:
            i += 1
        self.offset = i
        if self.broken or i >= len(self.text):
            return False
        self.broken = self.text[i] != "{"
        if not self.broken:
            self.call = CallStream(self.num_calls, self.argument_keys)
        return not self.broken


class Llama3JsonToolParser:
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self):
        self.text, self.is_json = "", None  # None: not known yet (only whitespace so far)
        self.calls = _CallSequence(("parameters", "arguments"), ";")

    def feed(self, delta: str) -> Parsed:
        self.text += delta  # all of it: the content, if no call comes of it
        if self.is_json is None:
            head = self.text.lstrip()
            if not head or self.PYTHON_TAG.startswith(head):
                return "", []
            self.is_json = head.startswith(("{", self.PYTHON_TAG))
            if not self.is_json:
                return self.text, []
            delta = head.removeprefix(self.PYTHON_TAG)
        if not self.is_json:
            return delta, []
        return "", self.calls.feed(delta)

    def finish(self) -> Parsed:
        if not self.is_json:  # False: sent as it came; None: only whitespace or part of the tag
            return ("" if self.is_json is False else self.text), []
        deltas = self.calls.feed("", final=True)
        if self.calls.num_calls == 0:  # JSON that names no function: the text as it came
            return self.text, []
        return "", deltas


class NamedCallParser:
    """tool_choice naming a function: the whole (constrained) output is its arguments."""

    def __init__(self, name: str):
        self.name, self.started = name, False

    def feed(self, delta: str) -> Parsed:
        deltas = [] if self.started else [ToolCallDelta(0, "", self.name, new_call_id())]
        self.started = True
        if delta:
            deltas.append(ToolCallDelta(0, delta))
        return "", deltas

    def finish(self) -> Parsed:
        return self.feed("")


class RequiredCallsParser:
    """tool_choice "required": the (constrained) output is a JSON array of {"name", "parameters"}."""

    def __init__(self):
        self.calls = _CallSequence(("parameters",), ",]", opening="[")

    def feed(self, delta: str) -> Parsed:
        return "", self.calls.feed(delta)

    def finish(self) -> Parsed:
        return "", self.calls.feed("", final=True)


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def check_tool_parser(name: str) -> str:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return name
