"""Attention metadata of one forward pass, published to the layers.

`ModelRunner` builds a `Context` for each step and installs it with
`set_context(...)`, a context manager around the forward pass: this is the only
place it is written. Attention layers read it with `get_context()`; a linear method that
treats decode steps apart (layers/quantization/gguf.py) asks `in_decode_step()`.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Context:
    """Everything attention needs besides q, k and v.

    A step is a flat batch of `num_tokens` query tokens from `num_seqs` sequences;
    each sequence contributes a run of consecutive tokens (a prefill chunk, or one
    decode token) whose keys attend to the whole context stored in the KV cache.
    """
    slot_mapping: torch.Tensor      # [num_tokens] int64, flat KV-cache slot of each token (-1: skip)
    cu_seqlens_q: torch.Tensor      # [num_seqs + 1] int32, query offsets into the flat batch
    seq_lens_k: torch.Tensor        # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32, -1 padded
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode_only: bool = False    # every sequence has exactly one query token
    logits_indices: torch.Tensor | None = None  # [num_seqs] rows whose logits are sampled


_CONTEXT: Context | None = None


def get_context() -> Context:
    assert _CONTEXT is not None, "attention called outside set_context()"
    return _CONTEXT


def in_decode_step() -> bool:
    """Whether a forward pass of decode tokens only is running (False outside any step)."""
    return _CONTEXT is not None and _CONTEXT.is_decode_only


@contextmanager
def set_context(context: Context):
    """Publish `context` for the duration of one forward pass."""
    global _CONTEXT
    assert _CONTEXT is None, "set_context() does not nest"
    _CONTEXT = context
    try:
        yield context
    finally:
        _CONTEXT = None
