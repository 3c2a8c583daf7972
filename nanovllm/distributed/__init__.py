"""Tensor parallelism across processes, as Nano-vLLM does it.

Rank 0 (the engine's process) and one spawned process per other rank each hold a
`ModelRunner` with their shard of the weights. Rank 0 broadcasts every call
through shared memory (`shm_channel.py`), all ranks run it together (their
collectives meet through torch.distributed: gloo on CPU, NCCL on GPU) and only
rank 0 samples. `rank_group.py` spawns, supervises and stops the processes;
`tp_runner.py` is what the engine holds.
"""
from nanovllm.distributed.rank_group import RankGroup, TensorParallelError
from nanovllm.distributed.tp_runner import TPModelRunner, make_model_runner

__all__ = ["RankGroup", "TensorParallelError", "TPModelRunner", "make_model_runner"]
