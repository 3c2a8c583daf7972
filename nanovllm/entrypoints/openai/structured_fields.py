"""The request fields that constrain an output, read into one `StructuredOutputsParams`.

Clients send a constraint in one of three ways, all accepted (at most one per request):

- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`;
- vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...,
  "disable_any_whitespace": bool}`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, still sent by
  many clients.

Shapes are checked here (a 400 naming the field); what the constraint holds is checked by
`StructuredOutputsParams` (sizes, depth) and by the engine (does it compile).
"""
from typing import Any

from nanovllm.entrypoints.openai.errors import bad_request
from nanovllm.structured_outputs.params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)


def parse_structured_outputs(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (None, None when it has none)."""
    given = [(name, _read(name, body[name])) for name in FIELDS if name in body]
    given = [(name, kwargs) for name, kwargs in given if kwargs is not None]
    if not given:
        return None, None
    if len(given) > 1:
        names = ", ".join(f"'{name}'" for name, _ in given)
        raise bad_request(f"only one output constraint may be given, got {names}", given[1][0])
    name, kwargs = given[0]
    try:
        return StructuredOutputsParams(**kwargs), name
    except ValueError as e:
        raise bad_request(f"'{name}': {e}", name) from None


def _read(name: str, value: Any) -> dict | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    return {GUIDED_FIELDS[name]: value}


def _response_format(value: Any) -> dict | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                          "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
    return {"json": spec["schema"]}


def _structured_outputs(value: Any) -> dict:
    if not isinstance(value, dict):
        raise bad_request("'structured_outputs' must be an object", "structured_outputs")
    for key in value:
        if key not in STRUCTURED_KEYS:
            raise bad_request(f"'structured_outputs.{key}' is not supported by this server; "
                              f"it takes {', '.join(STRUCTURED_KEYS)}", "structured_outputs")
    return {k: v for k, v in value.items() if v is not None}
