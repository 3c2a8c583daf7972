"""CPU weight layout: linear weights stored column-major for one-row products, and
packed by oneDNN for batches (kernels/cpu_gemm.py).

`F.linear(x, W)` multiplies by `W.t()`. With `W` stored row-major (`[out, in]`
contiguous, as checkpoints are), MKL runs a transposed product; with the same
values stored column-major (`W.t()` contiguous) it runs a plain one. On this AVX2
CPU a decode step of one sequence (one matrix-vector product per weight, bound by
memory bandwidth) takes about 25% less time that way: SmolLM2-135M's weights in
fp32, 35 ms against 45 ms per token on one thread. Products of 64 rows and more
run at the same speed either way, and both layouts give the same values there.

Only the storage changes: shapes, names and weight loaders stay as they are. Only
dense weights are re-laid (a layer whose quantization method says `is_dense`): packed
or quantized weights keep the layout their kernels expect. A
tied LM head shares its weight with the token embedding, whose row lookups get
slower in this layout (about 0.4 ms for 64 tokens, 26 ms for 2,560), a small
price against the LM head's 113 MB read per decode step.

Each of those dense fp32 weights also gets a oneDNN-packed copy (`packed_weight`, an
attribute of the layer, not a parameter), which products of 3 rows and more run on:
faster than either layout there (kernels/cpu_gemm.py has the figures). Where the engine
runs bf16 (CPUs with fast bf16: AVX512-BF16, AMX) its bf16 weights are packed too, and
the packed product takes every row count there, one row included. The copy is made
once, after loading: code that changed a weight later would have to pack it again
(nothing in the engine does).

A layer whose quantization method runs its own kernel for small batches (GGUF 4-bit and
`quantization="int4"/"int8"` layers: `own_kernel_max_rows`) up to where the packed product
takes over reads its dense weight for no batch at all: it keeps only the packed copy
(`layer.weight` becomes None), and the dense fp32 bytes are freed (SmolLM2's embedded
Q4_1 file: 424 MB; benchmarks/RESULTS.md "B2 CPU, round 4"). Likewise a layer whose
batches from some row count run an int8 copy (`int8_weight`, kernels/cpu_int8_dynamic.py)
gets no packed copy where no batch would read it, and drops its dense weight where the
method's own kernel takes every batch below that count (the LM head keeps its weight: a
tied one is the token embedding's, unless that embedding reads its rows from Q8_0 blocks,
`q8_weight` of layers/embed_head.py: then nothing reads the dense weight and both drop it; an
untied embedding that reads Q8_0 blocks drops its dense weight too).
"""
import torch
from torch import nn

from nanovllm.kernels import cpu_gemm
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import LinearBase


def use_column_major_weights(model: nn.Module) -> None:
    """Re-lay the dense weight of every linear layer and of the LM head column-major, in place,
    and give each fp32 one (bf16 where the CPU multiplies bf16 fast) its oneDNN-packed copy
    (`module.packed_weight`); drop the dense weight of a layer whose batches all run its own
    kernel or the packed copy (a tied LM head's is the embedding's: kept, in its row-major
    layout, which the embedding's row lookups read fastest)."""
    done = set()
    for module in model.modules():
        dense = isinstance(module, ParallelLMHead) or (isinstance(module, LinearBase)
                                                        and module.quant_method.is_dense)
        if not dense:
            continue
        packs, packed_from = cpu_gemm.packs(module.weight.dtype), cpu_gemm.packed_min_rows(module.weight.dtype)
        own, int8_from = _own_rows(module)
        packed_read = packs and max(own + 1, packed_from) < int8_from
        dense_read = own + 1 < (min(packed_from, int8_from) if packed_read else int8_from)
        if packed_read:
            module.packed_weight = cpu_gemm.pack(module.weight.data)
        if not dense_read:  # every batch: the method's own kernel, the int8 or the packed copy
            if not isinstance(module, ParallelLMHead):
                module.weight = None
            else:  # the head's may be the embedding's too
                _drop_head_weight(model, module)
            continue
        if id(module.weight) not in done:
            done.add(id(module.weight))
            module.weight.data = _column_major(module.weight.data)
    _drop_untied_embedding_weights(model)


def _drop_head_weight(model: nn.Module, head: ParallelLMHead) -> None:
    """Drop the LM head's dense weight and every embedding's that shares it, where those
    embeddings all read their rows from Q8_0 blocks (else it is kept)."""
    sharing = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and m is not head
               and m.weight is head.weight]
    if all(m.q8_weight is not None for m in sharing):
        for m in [head, *sharing]:
            m.weight = None


def _drop_untied_embedding_weights(model: nn.Module) -> None:
    """An embedding that reads its rows from Q8_0 blocks and shares its weight with no LM head
    that reads it has no use for its dense weight: dropped."""
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead) and m.weight is not None]
    for m in model.modules():
        if (type(m) is VocabParallelEmbedding and m.q8_weight is not None and m.weight is not None
                and not any(h.weight is m.weight for h in heads)):
            m.weight = None


def _own_rows(module: nn.Module) -> tuple[int, float]:
    """(batches of up to this many rows run the layer's method's own kernel, batches from this
    many rows its int8 copy: kernels/cpu_int8_dynamic.py; inf without one)."""
    method = getattr(module, "quant_method", None)
    int8 = getattr(module, "int8_weight", None)
    return (0 if method is None else method.own_kernel_max_rows), (float("inf") if int8 is None else int8.min_rows)


def _column_major(w: torch.Tensor) -> torch.Tensor:
    """The same [out, in] values, stored as a contiguous [in, out] seen transposed."""
    return w.t().contiguous().t()
