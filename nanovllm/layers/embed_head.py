"""Token embedding and LM head, split across ranks by vocabulary.

The vocabulary is padded up to a multiple of the tensor-parallel size; each rank
holds a contiguous range of rows. Padded rows are zero in the embedding and are
cut from the logits. With tied embeddings the LM head shares the embedding's
shard, so each rank still holds one copy of its rows only.

A GGUF Q8_0, Q6_K or Q5_K tensor loaded where the quantization keeps it (`keeps_q8_0_embedding`: the "gguf"
method on the CPU) also keeps this rank's rows of its blocks (`q8_weight`, kernels/cpu_q8_0.py):
the embedding reads its rows from them (the same values as the dense copy, which was rounded
from them alike), and the LM head runs batches of up to `q8_max_rows` rows by the Q8_0 kernel
(set after loading by layers/quantization/gguf.py; larger batches run the dense product).
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_q8_0
from nanovllm.kernels.cpu_gemm import dense_linear
from nanovllm.layers.linear import read_shard
from nanovllm.layers.quantization import keeps_q8_0_embedding
from nanovllm.utils.parallel import all_reduce, gather_to_rank0, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.keeps_q8_0 = keeps_q8_0_embedding()
        self.q8_weight: cpu_q8_0.Q8Weight | None = None  # this rank's rows, padded like `weight`
        self.q8_dtype: torch.dtype | None = None  # the dtype its rows are looked up in (`weight` may be dropped)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        size = max(min(self.shard_size, self.vocab_size - self.vocab_start), 0)  # 0: all padding
        param.data.zero_()
        if size:
            param.data[:size].copy_(read_shard(loaded, 0, self.vocab_start, size))
        type_name = getattr(loaded, "gguf_type", None)
        if (self.keeps_q8_0 and type_name in cpu_q8_0.BLOCK_OF and param.device.type == "cpu"
                and cpu_q8_0.built_for(param.dtype, type_name)):
            blocks = cpu_q8_0.from_gguf(loaded.gguf_raw.view(loaded.shape[0], -1), type_name)
            self.q8_weight = blocks.rows(self.vocab_start, size).padded(self.shard_size)
            self.q8_dtype = param.dtype

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] of this rank's shard -> [n, hidden]."""
        if self.q8_weight is not None:
            return cpu_q8_0.embedding(ids, self.q8_weight, self.q8_dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        y = self._lookup(local.clamp(0, self.shard_size - 1)) * in_shard.unsqueeze(1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    q8_max_rows = 0  # batches of up to this many rows run the Q8_0 kernel (where q8_weight is kept)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden] -> logits [num_rows, vocab_size] (on rank 0; None elsewhere)."""
        if self.q8_weight is not None and hidden.shape[0] <= self.q8_max_rows:
            logits = cpu_q8_0.q8_0_linear(hidden, self.q8_weight)  # [num_rows, shard_size]
        else:  # [num_rows, shard_size]; on the CPU by a oneDNN-packed copy for batches (kernels/cpu_gemm.py)
            logits = dense_linear(hidden, self.weight, None, getattr(self, "packed_weight", None),
                                  getattr(self, "int8_weight", None))
        if self.tp_size > 1:
            parts = gather_to_rank0(logits, self.tp_rank, self.tp_size)
            if parts is None:
                return None
            logits = torch.cat(parts, -1)  # [num_rows, shard_size * tp_size]: padded vocab
        return logits[:, :self.vocab_size]
