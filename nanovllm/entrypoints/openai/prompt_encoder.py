"""Prompt text to token ids on the server's event loop, without letting go of the GIL.

The event loop shares the GIL with the engine thread. HF's `tokenizer.encode` runs the Rust
tokenizer's `encode_batch`, which releases the GIL while it works; the event loop must then
win the GIL back from the engine thread, which (busy with a step) keeps it for up to the
interpreter's switch interval (5 ms). With a busy engine thread, HF's encode of a short chat
prompt took ~540 us against ~75 us for the Rust tokenizer's single `encode`, which keeps the
GIL (benchmarks/RESULTS.md, "Ninth session: serving overhead"). In a burst of 64 requests
every request waits for the encodes of those before it.

`PromptEncoder` calls the Rust `encode` directly where that gives HF's ids: an HF fast
tokenizer whose class keeps the base encode path, with no truncation, padding or split
special tokens set. Any other tokenizer goes through its own `encode`.
"""
try:
    from tokenizers import Tokenizer as RustTokenizer
except ImportError:  # no Rust tokenizers: every tokenizer takes its own encode
    RustTokenizer = None


class PromptEncoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._backend = _rust_backend(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _rust_backend(tokenizer):
    """The Rust tokenizer behind an HF fast tokenizer whose encode adds nothing to it, else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if RustTokenizer is None or not isinstance(backend, RustTokenizer):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or any(
            getattr(cls, name) is not getattr(TokenizersBackend, name) for name in ("encode", "_encode_plus")):
        return None
    if (backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens
            or getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend
