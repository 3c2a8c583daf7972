"""TPModelRunner: what LLMEngine holds when tensor_parallel_size > 1.

It looks like a `ModelRunner` to the engine (`run`, `num_kvcache_blocks`,
`shutdown`) but runs every step on all ranks through a `RankGroup`. Rank 0 gets
the real `Sequence`s (it samples); the workers get `StepSeq`s: only what
`ModelRunner.run` reads there (offsets, block table, sampling params, and the
scheduled token ids, not the whole history), so a step's command stays small
however long the sequences are.
"""
import inspect

from nanovllm.config import Config
from nanovllm.distributed.rank_group import RankGroup
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.model_source import ModelSource
from nanovllm.engine.sampling_metadata import ModelRunnerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.model_config import ModelConfig
from nanovllm.layers.linear import kv_heads_per_rank
from nanovllm.utils.device import resolve_device
from nanovllm.utils.parallel import divide


def make_model_runner(config: Config, source: ModelSource, model_config: ModelConfig, max_model_len: int):
    """A plain ModelRunner for one rank; a TPModelRunner (N processes) for tensor_parallel_size N > 1."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, source, model_config, max_model_len)
    check_splittable(model_config, config.tensor_parallel_size)
    return TPModelRunner(config, source, model_config, max_model_len)


def check_splittable(model_config: ModelConfig, tp_size: int) -> None:
    """The layers' own checks, made before any process starts: a ValueError naming the count."""
    divide(model_config.num_attention_heads, tp_size, "num_attention_heads")
    kv_heads_per_rank(model_config.num_key_value_heads, tp_size)
    if model_config.has_dense_layers:
        divide(model_config.intermediate_size, tp_size, "intermediate_size")
    if model_config.num_experts:  # every rank holds a slice of every expert (layers/fused_moe.py)
        divide(model_config.moe_intermediate_size, tp_size, "moe_intermediate_size")


class TPModelRunner:
    def __init__(self, config: Config, source: ModelSource, model_config: ModelConfig, max_model_len: int):
        device = resolve_device(config.device)
        self.group = RankGroup(config.tensor_parallel_size, device, ModelRunner,
                               config, source, model_config, max_model_len)
        self.driver: ModelRunner = self.group.driver  # rank 0's runner

    def __getattr__(self, name: str):
        """Data attributes (num_kvcache_blocks, device, dtype, ...) are rank 0's. Methods are
        not forwarded: one run on rank 0 alone would wait forever for the other ranks."""
        driver = self.__dict__.get("driver")
        if driver is None:
            raise AttributeError(name)
        value = getattr(driver, name)
        if inspect.ismethod(value):
            raise AttributeError(f"{name!r}: call ModelRunner methods on every rank, through "
                                 f"TPModelRunner.group.call({name!r}, ...)")
        return value

    def run(self, seqs: list[Sequence]) -> ModelRunnerOutput:
        """One scheduled step on every rank; returns rank 0's output (only rank 0 samples)."""
        return self.group.call("run", (seqs,), (StepSeqs(seqs),))

    def shutdown(self) -> None:
        self.group.shutdown()


# What a worker rank's `ModelRunner.run` may read of each scheduled sequence.
STEP_FIELDS = ("seq_id", "num_computed_tokens", "num_scheduled_tokens", "num_tokens", "num_prompt_tokens",
               "block_table", "sampling_params")


class StepSeq:
    """A Sequence as a worker rank sees it: the STEP_FIELDS, and its token ids from the first
    scheduled one through the one after the last (the target of a prompt logprob)."""
    __slots__ = STEP_FIELDS + ("token_ids",)

    def __init__(self, seq_id, num_computed_tokens, num_scheduled_tokens, num_tokens, num_prompt_tokens,
                 block_table, sampling_params, token_ids):
        self.seq_id, self.num_computed_tokens, self.num_scheduled_tokens = seq_id, num_computed_tokens, \
            num_scheduled_tokens
        self.num_tokens, self.num_prompt_tokens, self.block_table = num_tokens, num_prompt_tokens, block_table
        self.sampling_params, self.token_ids = sampling_params, token_ids


class StepSeqs:
    """One step's sequences, packed column by column for the trip to the workers (pickling
    a few long lists is about twice as fast as many small objects). Unpickles as list[StepSeq]."""

    def __init__(self, seqs: list[Sequence]):
        self.columns = tuple([getattr(seq, name) for seq in seqs] for name in STEP_FIELDS)
        self.windows = [_window(seq) for seq in seqs]

    def __reduce__(self):
        return _unpack_step_seqs, (self.columns, self.windows)


def _window(seq: Sequence) -> tuple[int, list[int]]:
    start = seq.num_computed_tokens
    return start, seq.token_ids[start:min(start + seq.num_scheduled_tokens + 1, seq.num_tokens)]


def _unpack_step_seqs(columns: tuple, windows: list) -> list[StepSeq]:
    return [StepSeq(*values, TokenWindow(start, ids, values[3]))  # values[3]: num_tokens
            for values, (start, ids) in zip(zip(*columns), windows)]


class TokenWindow:
    """Some consecutive token ids of a sequence, indexed by absolute position like the full list.

    Reading outside the window is an IndexError naming it, never a silent wrong token.
    """
    __slots__ = ("start", "ids", "length")

    def __init__(self, start: int, ids: list[int], length: int):
        self.start, self.ids, self.length = start, ids, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            lo, hi, step = index.indices(self.length)
            if step != 1 or (hi > lo and not self.start <= lo <= hi <= self.start + len(self.ids)):
                raise self._outside(index)
            return self.ids[lo - self.start:hi - self.start]
        position = index + self.length if index < 0 else index
        if not self.start <= position < self.start + len(self.ids):
            raise self._outside(index)
        return self.ids[position - self.start]

    def _outside(self, index) -> IndexError:
        return IndexError(f"a worker rank has tokens [{self.start}, {self.start + len(self.ids)}) of this "
                          f"sequence only, not {index}: send more in nanovllm/distributed/tp_runner.py")
