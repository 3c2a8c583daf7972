"""Structured outputs: a request's output constrained to a JSON schema, regex, choice or grammar.

`params.py` holds the request's side (`StructuredOutputsParams`, validated, no imports
beyond the standard library); `backend.py` wraps xgrammar (imported lazily); `manager.py`
is the engine's side (compile pool, cache, one matcher per sequence).
"""
from nanovllm.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
