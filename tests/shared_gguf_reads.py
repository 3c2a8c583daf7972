"""HF transformers' GGUF loading for the test references, without re-parsing the same file.

HF's `from_pretrained(dir, gguf_file=...)` builds a new `gguf.GGUFReader` at each of its passes
over a file (SmolLM2's tokenizer, config and weights: three, ~8 s each on a 2-core machine, most of
it the 49k-token vocabulary's string fields), and rebuilds `gguf.get_tensor_name_map` for every
module of the model (~27 ms each, ~400 for SmolLM2). Inside `shared_gguf_reads()` both are
memoized for the test process: the reader per file version (path, size, mtime; read-only memmap),
the name map per (architecture, blocks). HF still reads, maps and dequantizes the file itself
with the `gguf` package; only the repeated parsing of an unchanged file is skipped.
"""
import contextlib
import functools
import os

import gguf
import pytest

_real_reader = gguf.GGUFReader
_real_name_map = gguf.get_tensor_name_map


@functools.cache
def _reader(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    return _real_reader(path, "r")


def _shared_reader(path, mode: str = "r") -> gguf.GGUFReader:
    if mode != "r":  # a writable view must not be shared
        return _real_reader(path, mode)
    stat = os.stat(path)
    return _reader(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _name_map(arch, n_blocks: int):
    return _real_name_map(arch, n_blocks)


@contextlib.contextmanager
def shared_gguf_reads():
    """HF's GGUF loads inside this block share one parse of each file (see the module docstring)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _shared_reader)
        patch.setattr(gguf, "get_tensor_name_map", _name_map)
        yield
