"""Chat's tool fields: `tools`, `tool_choice`, `parallel_tool_calls`, and tool calls in the history.

`parse_tools(body)` checks the shapes (a 400 naming the field) and decides how the calls
are made, as vLLM does:

- "none" (or no tools): the tools are not offered; the output is text;
- "auto" (the default with tools): the tools go to the chat template and the model's own
  tool-call text is parsed by the server's `--tool-call-parser` (tool_parsers.py);
- "required": the output is constrained to a JSON array of `{"name", "parameters"}` calls
  of the given tools (one unless `parallel_tool_calls`);
- a named function `{"type": "function", "function": {"name": ...}}`: the output is
  constrained to that function's parameters schema, and is its arguments.

So "required" and named calls are valid even from a model that knows nothing of tools.
Their JSON is compact (no whitespace between tokens): a model cannot stall in whitespace.
"""
import json
from dataclasses import dataclass
from typing import Any

from nanovllm.entrypoints.openai.errors import bad_request
from nanovllm.structured_outputs.params import StructuredOutputsParams

FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
MAX_TOOLS = 128
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]                 # as sent: {"type": "function", "function": {...}}
    choice: str                       # "auto", "required" or "named"
    named: str | None = None          # the function of a named choice
    parallel: bool = True
    constraint: StructuredOutputsParams | None = None  # "required" and named choices

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and how they are called; None when no tool may be called."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request(f"'parallel_tool_calls' must be true or false, got {parallel!r}", "parallel_tool_calls")
    choice, named = _tool_choice(body.get("tool_choice", "auto" if tools else "none"), tools)
    if choice == "none" or not tools:
        return None
    return ToolRequest(tools, choice, named, parallel, _constraint(tools, choice, named, parallel))


def _tools(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("'tools' must be an array of function tools", "tools")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' may hold at most {MAX_TOOLS} tools, got {len(value)}", "tools")
    names = set()
    for i, tool in enumerate(value):
        name = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"'{name}' must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        function = tool["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"'{name}.function.name' must be a non-empty string", "tools")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise bad_request(f"'{name}.function.parameters' must be a JSON schema object", "tools")
        if function["name"] in names:
            raise bad_request(f"'{name}': two tools are named {function['name']!r}", "tools")
        names.add(function["name"])
    return value


def _tool_choice(value: Any, tools: list[dict]) -> tuple[str, str | None]:
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad_request(f"'tool_choice' must be none, auto, required or a function, got {value!r}",
                              "tool_choice")
        if value != "none" and not tools:
            raise bad_request(f"'tool_choice' {value!r} needs 'tools'", "tool_choice")
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("'tool_choice' must be none, auto, required or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    known = [t["function"]["name"] for t in tools]
    if function["name"] not in known:
        raise bad_request(f"'tool_choice' names the function {function['name']!r}, which is not in 'tools' "
                          f"({', '.join(map(repr, known)) or 'none given'})", "tool_choice")
    return "named", function["name"]


def parameters_of(tools: list[dict], name: str) -> dict:
    return next(t["function"].get("parameters") or ANY_OBJECT for t in tools if t["function"]["name"] == name)


def _constraint(tools: list[dict], choice: str, named: str | None, parallel: bool) -> StructuredOutputsParams | None:
    """The output constraint that enforces a "required" or named choice (vLLM's schemas)."""
    if choice == "named":
        schema = parameters_of(tools, named)
    elif choice == "required":
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": parameters_of(tools, t["function"]["name"])}} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
    else:
        return None
    try:
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)  # arguments are data, not prose
    except ValueError as e:
        raise bad_request(f"'tools': {e}", "tools") from None


def check_message_tool_calls(name: str, value: Any, role: str) -> list[dict]:
    """An assistant message's `tool_calls`, with their arguments parsed into objects (chat
    templates write them out as JSON themselves, as HF's and vLLM's do)."""
    if value is None:
        return []
    if role != "assistant":
        raise bad_request(f"'{name}' belongs to assistant messages only", name)
    if not isinstance(value, list):
        raise bad_request(f"'{name}' must be an array", name)
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"'{name}[{i}]' must be {{\"id\", \"type\": \"function\", \"function\": "
                              "{\"name\", \"arguments\"}}", name)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise bad_request(f"'{name}[{i}].function.arguments' is not valid JSON", name) from None
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls
