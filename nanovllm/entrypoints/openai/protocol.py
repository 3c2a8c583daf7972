"""Request bodies of the OpenAI API, validated before the engine sees them.

Each `parse_*` function takes the decoded JSON object and returns a small
dataclass, or raises a 400 `APIError` naming the field at fault. This module
checks shapes and types; value ranges (top_p in (0, 1], ...) are checked once, by
`SamplingParams`, whose ValueError the server passes on as a 400. A field the
server does not support is a 400 naming it: nothing a client sends is silently
ignored. Output constraints (`response_format`, `structured_outputs`, `guided_*`) are
read by structured_fields.py, `tools` and `tool_choice` by tool_fields.py. A JSON `null` means "the
default", as in OpenAI's API.
"""
from dataclasses import dataclass, field
from typing import Any, Callable

from nanovllm.entrypoints.openai import structured_fields, tool_fields
from nanovllm.entrypoints.openai.errors import bad_request

# OpenAI allows up to 20 top logprobs per token (chat's `top_logprobs`); vLLM
# applies the same cap to the completions API's `logprobs`.
MAX_LOGPROBS = 20
# Chat roles a template can render.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
# The completions API's default `max_tokens`, as OpenAI and vLLM (chat has no default cap).
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Longest repr of a bad value quoted back in an error message.
MAX_QUOTED_CHARS = 80


# ---- field checkers: (param name, value) -> converted value, or a 400 ---------------

def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS] + "..."


def check_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"'{name}' must be an integer, got {_quote(value)}", name)
    return value


def check_number(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad_request(f"'{name}' must be a number, got {_quote(value)}", name)
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {_quote(value)}", name)
    return value


def check_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, got {_quote(value)}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"'{name}' is not valid UTF-8 (it contains a lone surrogate)", name) from None
    return value


def check_object(name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object, got {_quote(value)}", name)
    return value


def check_list(name: str, value: Any) -> list:
    if not isinstance(value, list):
        raise bad_request(f"'{name}' must be an array, got {_quote(value)}", name)
    return value


def check_int_list(name: str, value: Any) -> list[int]:
    return [check_int(f"{name}[{i}]", v) for i, v in enumerate(check_list(name, value))]


def check_stop(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [check_str(name, value)]
    return [check_str(f"{name}[{i}]", v) for i, v in enumerate(check_list(name, value))]


def check_logit_bias(name: str, value: Any) -> dict[int, float]:
    """OpenAI's logit_bias: an object of token id (a JSON key, so a string) -> bias."""
    return {_token_id_key(name, key): check_number(f"{name}[{key}]", v)
            for key, v in check_object(name, value).items()}


def _token_id_key(name: str, key: Any) -> int:
    """A token id written as an object key: ASCII decimal digits ("42"). str.isdigit alone
    also passes "²" (int() rejects it) and "١" (int() reads it as 1)."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        try:
            return int(key)
        except ValueError:  # longer than Python's limit on int() of a string
            pass
    raise bad_request(f"'{name}' keys must be token ids, got {_quote(key)}", name)


def check_logprobs_count(name: str, value: Any) -> int:
    value = check_int(name, value)
    if not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"'{name}' must be in [0, {MAX_LOGPROBS}], got {value}", name)
    return value


# Fields that map one-to-one onto SamplingParams (vLLM's extra sampling fields included).
SAMPLING_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "n": check_int, "temperature": check_number, "top_p": check_number, "top_k": check_int,
    "min_p": check_number, "presence_penalty": check_number, "frequency_penalty": check_number,
    "repetition_penalty": check_number, "seed": check_int, "stop": check_stop,
    "stop_token_ids": check_int_list, "ignore_eos": check_bool, "min_tokens": check_int,
    "include_stop_str_in_output": check_bool, "skip_special_tokens": check_bool,
    "logit_bias": check_logit_bias, "allowed_token_ids": check_int_list,
}
COMMON_FIELDS = ("model", "stream", "stream_options", "max_tokens", *SAMPLING_FIELDS, *structured_fields.FIELDS)
COMPLETION_FIELDS = frozenset((*COMMON_FIELDS, "prompt", "echo", "logprobs"))
CHAT_FIELDS = frozenset((*COMMON_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
                         "chat_template_kwargs", *tool_fields.FIELDS))


# ---- parsed requests -------------------------------------------------------------

@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]     # one entry per prompt of a batch
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None        # top alternatives per token; None: no logprobs
    sampling: dict = field(default_factory=dict)   # SamplingParams keyword arguments
    structured_param: str | None = None  # the field the output constraint came from


@dataclass
class ChatCompletionRequest:
    model: str | None
    messages: list[dict]
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None    # None: no logprobs
    chat_template_kwargs: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    structured_param: str | None = None
    tools: tool_fields.ToolRequest | None = None  # None: no tools, or tool_choice "none"


def parse_completion_request(body: dict) -> CompletionRequest:
    body = _present(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt")
    req = CompletionRequest(_model(body), _prompts(body["prompt"]))
    req.stream, req.include_usage = _stream(body)
    req.echo = check_bool("echo", body.get("echo", False))
    if "logprobs" in body:
        req.logprobs = check_logprobs_count("logprobs", body["logprobs"])
    req.sampling = _sampling(body, body.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS), req.logprobs)
    if req.echo and req.logprobs is not None:
        req.sampling["prompt_logprobs"] = req.logprobs
    req.structured_param = _add_constraint(body, req.sampling)
    return req


def parse_chat_request(body: dict) -> ChatCompletionRequest:
    body = _present(body, CHAT_FIELDS)
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages")
    req = ChatCompletionRequest(_model(body), check_messages(body["messages"]))
    req.stream, req.include_usage = _stream(body)
    req.top_logprobs = _chat_logprobs(body)
    req.chat_template_kwargs = check_template_kwargs(body.get("chat_template_kwargs", {}))
    # No default cap for chat (as OpenAI): None lets the engine fill the context.
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    req.sampling = _sampling(body, max_tokens, req.top_logprobs)
    req.structured_param = _add_constraint(body, req.sampling)
    req.tools = tool_fields.parse_tools(body)
    if req.tools is not None and req.tools.constraint is not None:
        if req.structured_param is not None:
            raise bad_request(f"tool_choice {req.tools.choice!r} constrains the output: it cannot be combined "
                              f"with '{req.structured_param}'", "tool_choice")
        req.sampling["structured_outputs"], req.structured_param = req.tools.constraint, "tool_choice"
    return req


def _add_constraint(body: dict, sampling: dict) -> str | None:
    """Put the body's output constraint into the SamplingParams kwargs; returns its field."""
    constraint, param = structured_fields.parse_structured_outputs(body)
    if constraint is not None:
        sampling["structured_outputs"] = constraint
    return param


def _present(body: dict, known: frozenset) -> dict:
    """The fields that are set (JSON null means default); unknown fields are a 400."""
    for name in body:
        if name not in known:
            raise bad_request(f"'{name}' is not supported by this server", name)
    return {k: v for k, v in body.items() if v is not None}


def _model(body: dict) -> str | None:
    return check_str("model", body["model"]) if "model" in body else None


def _stream(body: dict) -> tuple[bool, bool]:
    stream = check_bool("stream", body.get("stream", False))
    if "stream_options" not in body:
        return stream, False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    options = check_object("stream_options", body["stream_options"])
    for name in options:
        if name != "include_usage":
            raise bad_request(f"'stream_options.{name}' is not supported by this server", "stream_options")
    return stream, check_bool("stream_options.include_usage", options.get("include_usage", False))


def _chat_logprobs(body: dict) -> int | None:
    wanted = check_bool("logprobs", body.get("logprobs", False))
    if "top_logprobs" in body and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs' to be true", "top_logprobs")
    return check_logprobs_count("top_logprobs", body.get("top_logprobs", 0)) if wanted else None


def _sampling(body: dict, max_tokens: Any, logprobs: int | None) -> dict:
    """SamplingParams keyword arguments from the body's sampling fields."""
    kwargs = {name: check(name, body[name]) for name, check in SAMPLING_FIELDS.items() if name in body}
    kwargs["max_tokens"] = None if max_tokens is None else check_int("max_tokens", max_tokens)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    return kwargs


# ---- prompts and messages -----------------------------------------------------------

def _prompts(value: Any) -> list[str | list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of those lists."""
    if isinstance(value, str):
        return [check_str("prompt", value)]
    check_list("prompt", value)
    if not value:
        raise bad_request("'prompt' must not be empty", "prompt")
    if all(isinstance(v, str) for v in value):
        return [check_str(f"prompt[{i}]", v) for i, v in enumerate(value)]
    if all(isinstance(v, list) for v in value):
        return [check_int_list(f"prompt[{i}]", v) for i, v in enumerate(value)]
    return [check_int_list("prompt", value)]


def check_messages(value: Any) -> list[dict]:
    """`messages`: a non-empty list of {role, content[, name]}; content may be text parts."""
    check_list("messages", value)
    if not value:
        raise bad_request("'messages' must not be empty", "messages")
    return [_message(f"messages[{i}]", m) for i, m in enumerate(value)]


def _message(name: str, value: Any) -> dict:
    check_object(name, value)
    for key in value:
        if key not in MESSAGE_KEYS:
            raise bad_request(f"'{name}.{key}' is not supported by this server", f"{name}.{key}")
    role = check_str(f"{name}.role", value.get("role"))
    if role not in CHAT_ROLES:
        raise bad_request(f"'{name}.role' must be one of {', '.join(CHAT_ROLES)}; got {_quote(role)}",
                          f"{name}.role")
    calls = tool_fields.check_message_tool_calls(f"{name}.tool_calls", value.get("tool_calls"), role)
    content = value.get("content")
    message = {"role": role, "content": "" if content is None and calls else _content(f"{name}.content", content)}
    if "name" in value:
        message["name"] = check_str(f"{name}.name", value["name"])
    if calls:
        message["tool_calls"] = calls
    if role == "tool":
        message["tool_call_id"] = check_str(f"{name}.tool_call_id", value.get("tool_call_id"))
    elif "tool_call_id" in value:
        raise bad_request(f"'{name}.tool_call_id' belongs to tool messages only", f"{name}.tool_call_id")
    return message


def _content(name: str, value: Any) -> str:
    """Message content: a string, or a list of {"type": "text", "text": ...} parts (joined by newlines)."""
    if isinstance(value, str):
        return check_str(name, value)
    if value is None:
        raise bad_request(f"'{name}' is required", name)
    if not isinstance(value, list):
        raise bad_request(f"'{name}' must be a string or an array of text parts, got {_quote(value)}", name)
    texts = []
    for i, part in enumerate(value):
        check_object(f"{name}[{i}]", part)
        if part.get("type") != "text" or set(part) != {"type", "text"}:
            raise bad_request(f"'{name}[{i}]': only text parts {{\"type\": \"text\", \"text\": ...}} "
                              "are supported", f"{name}[{i}]")
        texts.append(check_str(f"{name}[{i}].text", part["text"]))
    return "\n".join(texts)


def check_template_kwargs(value: Any) -> dict:
    kwargs = check_object("chat_template_kwargs", value)
    if "messages" in kwargs:
        raise bad_request("'chat_template_kwargs.messages' would replace the conversation", "chat_template_kwargs")
    return kwargs


# ---- tokenize / detokenize ----------------------------------------------------------

@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)


def parse_tokenize_request(body: dict) -> TokenizeRequest:
    """Either {"prompt": str, "add_special_tokens"} or {"messages": [...], "add_generation_prompt", ...}."""
    if "messages" in body:
        body = _present(body, frozenset(("model", "messages", "add_special_tokens", "add_generation_prompt",
                                         "chat_template_kwargs")))
        return TokenizeRequest(_model(body), messages=check_messages(body["messages"]),
                               add_special_tokens=check_bool("add_special_tokens",
                                                             body.get("add_special_tokens", False)),
                               add_generation_prompt=check_bool("add_generation_prompt",
                                                                body.get("add_generation_prompt", True)),
                               chat_template_kwargs=check_template_kwargs(body.get("chat_template_kwargs", {})))
    body = _present(body, frozenset(("model", "prompt", "add_special_tokens")))
    if "prompt" not in body:
        raise bad_request("'prompt' or 'messages' is required", "prompt")
    return TokenizeRequest(_model(body), prompt=check_str("prompt", body["prompt"]),
                           add_special_tokens=check_bool("add_special_tokens", body.get("add_special_tokens", True)))


def parse_detokenize_request(body: dict) -> tuple[str | None, list[int]]:
    body = _present(body, frozenset(("model", "tokens")))
    if "tokens" not in body:
        raise bad_request("'tokens' is required", "tokens")
    return _model(body), check_int_list("tokens", body["tokens"])
