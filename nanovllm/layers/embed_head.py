"""Token embedding and LM head, split across ranks by vocabulary.

The vocabulary is padded up to a multiple of the tensor-parallel size; each rank
holds a contiguous range of rows. Padded rows are zero in the embedding and are
cut from the logits. With tied embeddings the LM head shares the embedding's
shard, so each rank still holds one copy of its rows only.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.cpu_gemm import dense_linear
from nanovllm.layers.linear import read_shard
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

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        size = max(min(self.shard_size, self.vocab_size - self.vocab_start), 0)  # 0: all padding
        param.data.zero_()
        if size:
            param.data[:size].copy_(read_shard(loaded, 0, self.vocab_start, size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden] -> logits [num_rows, vocab_size] (on rank 0; None elsewhere)."""
        # [num_rows, shard_size]; on the CPU by a oneDNN-packed copy for batches (kernels/cpu_gemm.py)
        logits = dense_linear(hidden, self.weight, None, getattr(self, "packed_weight", None),
                              getattr(self, "int8_weight", None))
        if self.tp_size > 1:
            parts = gather_to_rank0(logits, self.tp_rank, self.tp_size)
            if parts is None:
                return None
            logits = torch.cat(parts, -1)  # [num_rows, shard_size * tp_size]: padded vocab
        return logits[:, :self.vocab_size]
