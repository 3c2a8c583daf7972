"""StructuredOutputsParams: the constraint a request's output must follow (vLLM's API).

Exactly one of `json` (a JSON schema, as a dict or its text), `regex`, `choice` (a list of
strings), `grammar` (EBNF / GBNF text, as xgrammar and llama.cpp read it) or `json_object`
(any JSON object) is set; anything else is a ValueError naming the fields. The sizes are
bounded here, before any grammar is built, so that one request cannot make the engine
spend seconds or gigabytes compiling it:

- a schema, regex or grammar of at most MAX_GRAMMAR_CHARS characters,
- a JSON schema nested at most MAX_SCHEMA_DEPTH objects / arrays deep,
- at most MAX_CHOICES choices of at most MAX_GRAMMAR_CHARS characters in all.

`start_after_token_id`: the constraint starts after this token appears in the output (the
end-of-thinking token of a reasoning model, which the server's reasoning parser names);
until then the output is free.
"""
import json
from dataclasses import dataclass

MAX_GRAMMAR_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 1024
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens (compact output)
    start_after_token_id: int | None = None

    def __post_init__(self):
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if isinstance(self.choice, (list, tuple)):
            object.__setattr__(self, "choice", list(self.choice))
        self._validate()

    def _validate(self) -> None:
        if self.json is not None:
            _check_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check_text(name, value)
        if self.choice is not None:
            _check_choice(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"json_object must be True or None, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}")
        t = self.start_after_token_id
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
            raise ValueError(f"start_after_token_id must be a token id (an int >= 0), got {t!r}")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def schema_text(self) -> str | None:
        """The JSON schema as text (None for the other kinds)."""
        if self.json is None:
            return None
        return self.json if isinstance(self.json, str) else json.dumps(self.json)

    @property
    def cache_key(self) -> tuple:
        """What identifies the compiled grammar: equal keys compile to the same grammar."""
        value = {"json": self.schema_text, "choice": tuple(self.choice or ())}.get(self.kind, getattr(self, self.kind))
        return self.kind, value, self.disable_any_whitespace


def _check_text(name: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{name} is {len(value)} characters long; the limit is {MAX_GRAMMAR_CHARS}")


def _check_schema(schema) -> None:
    if isinstance(schema, str):
        _check_text("json", schema)
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json: the schema is not valid JSON ({e})") from None
    elif isinstance(schema, dict):
        _check_text("json", json.dumps(schema))
    else:
        raise ValueError(f"json must be a JSON schema (a dict or its text), got {type(schema).__name__}")
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json: a JSON schema is an object, got {type(schema).__name__}")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"json: the schema is nested {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")


def _depth(value) -> int:
    """Nesting depth of dicts and lists in a parsed JSON value (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_SCHEMA_DEPTH:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _check_choice(choice) -> None:
    if not isinstance(choice, list) or not choice:
        raise ValueError(f"choice must be a non-empty list of strings, got {choice!r}")
    if len(choice) > MAX_CHOICES:
        raise ValueError(f"choice may hold at most {MAX_CHOICES} strings, got {len(choice)}")
    for entry in choice:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"choice entries must be non-empty strings, got {entry!r}")
    total = sum(map(len, choice))
    if total > MAX_GRAMMAR_CHARS:
        raise ValueError(f"choice holds {total} characters in all; the limit is {MAX_GRAMMAR_CHARS}")
