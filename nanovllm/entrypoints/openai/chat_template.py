"""Chat templates, rendered in a sandboxed Jinja environment.

The template comes from `--chat-template FILE` or from the tokenizer. Rendering
uses `jinja2.sandbox.ImmutableSandboxedEnvironment` (as HF transformers does), so a
template cannot reach Python internals or mutate its inputs, with the helpers HF
templates expect (`raise_exception`, `strftime_now`, the `tojson` filter). Any
failure while rendering a client's conversation is a 400, never a 500.
"""
import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanovllm.entrypoints.openai.errors import bad_request


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template does not compile: {e}") from e
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.mentions_tools = "tools" in source  # a template that never reads `tools` cannot show them

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text of a conversation; `kwargs` (chat_template_kwargs) may override the defaults."""
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                   "add_generation_prompt": add_generation_prompt, **kwargs, "messages": messages}
        try:
            return self.template.render(**context)
        except Exception as e:  # raise_exception(), a sandbox violation, or a type error on client data
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None


def load_chat_template(path: str | None, tokenizer) -> ChatTemplate | None:
    """The template of `--chat-template FILE`, else the tokenizer's; None when neither has one."""
    bos, eos = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None)
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                return ChatTemplate(f.read(), bos, eos)
        except OSError as e:
            raise ValueError(f"cannot read the chat template file {path!r}: {e.strerror}") from e
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):  # named templates: the default one serves chat
        source = source.get("default")
    return ChatTemplate(source, bos, eos) if source else None


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
