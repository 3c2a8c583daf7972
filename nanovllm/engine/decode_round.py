"""Multi-step decode rounds: several decode steps of one batch, with no host sync between them.

A round runs `num_steps` decode steps of the same sequences: each step's sampled tokens
feed the next step's forward on the device (a CUDA graph's inputs advanced in place, or
`ModelRunner._advance_decode` when eager), positions and KV slots advance there too, and
the host takes each step's tokens as the device produces them (`DecodeRound.outputs`).
A round is launched in one of two ways:

- **eager** (no row of the kind below): every step's forward and sampling
  are queued at launch, so the device runs the round end to end while the host handles
  the steps already done.
- **lazy** (some row whose sampling follows its own new tokens: a structured-output
  grammar, whose token bitmask its matcher gives only once it has accepted the previous
  token; penalties, which count the output tokens; min_tokens still pending, which bans
  the stop tokens until then): the forward of step k is queued as soon as step k-1's
  sampling is (its input tokens are on the device); the host then waits for step k-1's
  tokens, hands them to the engine (which postprocesses them: the matchers accept them,
  stops are checked), builds step k's sampling metadata from the sequences as they now
  stand (bitmasks filled from the matchers, penalty counts, seeds by position; copied
  from pinned memory, non-blocking) and queues step k's sampling, then step k+1's
  forward. So the mask fill, the metadata and the host's postprocessing overlap the
  device's forward of the same step; the device waits only for the copies and the
  sampling's launch. Rows whose sequence finished earlier in the round (a stop, a
  complete grammar, an abort) are computed and dropped as in eager rounds; their bitmask
  rows allow every token and their matchers are not asked. When every sequence of a lazy
  round has finished, it launches nothing more.

Async scheduling chains a round onto one whose last step is outstanding (launched, not
seen by the host): `outputs(on_last_step=...)` calls the engine there. A lazy round
chains the same way: the next round's first forward is queued behind this round's last
sampling, and its first sampling waits (lazily) until the host has taken this round's last
tokens, so its masks follow them. Seeded draws depend on (seed, position) alone, so a
lazy round draws what one-step rounds draw.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanovllm.engine.sampling_metadata import ModelRunnerOutput, SamplingMetadata
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplerOutput
from nanovllm.utils.context import set_context

if TYPE_CHECKING:  # model_runner imports this module
    from nanovllm.engine.model_runner import ModelRunner


def follows_own_tokens(seq: Sequence) -> bool:
    """Whether `seq`'s sampling depends on the tokens it samples in a round: a grammar,
    penalties, or min_tokens not reached yet (a lazy round follows them step by step)."""
    params = seq.sampling_params
    return seq.grammar is not None or params.has_penalties or seq.num_completion_tokens < params.min_tokens


class StepLauncher:
    """Queues the forward and the sampling of each step of one round on `runner`'s device."""

    def __init__(self, runner: ModelRunner, seqs: list[Sequence], after: DecodeRound | None, lazy: bool):
        self.runner, self.seqs, self.lazy = runner, seqs, lazy
        self.num_pending = 0 if after is None else 1  # tokens of `after` the host has not seen
        self.input_ids, self.positions, self.context, _ = runner.prepare(seqs, after)
        self.vocab_size = runner.model_config.vocab_size
        # a lazy round builds each step's metadata when that step samples, not now
        self.metadata = None if lazy else SamplingMetadata.build(seqs, self.vocab_size, runner.device)
        graphs = runner.graph_runner
        self.in_graph = graphs is not None and graphs.can_run(self.context, len(seqs))
        self.token_ids: torch.Tensor | None = None  # [num_seqs] the last sampled step's tokens
        self.logits: torch.Tensor | None = None     # [num_seqs, vocab] the last forward's

    @torch.inference_mode()
    def forward(self, step: int) -> None:
        """Queue step `step`'s forward; its inputs are step `step - 1`'s samples on the device."""
        runner = self.runner
        if step > 0 and not self.in_graph:
            self.input_ids, self.positions, self.context = runner._advance_decode(
                self.token_ids, self.positions, self.context)
        with set_context(self.context):  # after step 0 in a graph, only its logits_indices is read
            if step > 0 and self.in_graph:  # the graph's input buffers advance in place, one launch
                hidden = runner.graph_runner.run_next_step(self.token_ids, runner.block_size)
            else:
                hidden = runner._forward(self.input_ids, self.positions, self.context)
            self.logits = runner.model.compute_logits(hidden)

    @torch.inference_mode()
    def sample(self, step: int) -> tuple[SamplerOutput, torch.cuda.Event | None]:
        """Queue step `step`'s sampling (after its forward); a lazy round builds its metadata now,
        from the sequences as the host has left them (it has taken every earlier step). Returns
        the step's output (token ids in pinned host memory on a GPU) and the event marking
        them ready (None on a CPU)."""
        if self.lazy:
            self.metadata = SamplingMetadata.build(self.seqs, self.vocab_size, self.runner.device)
        elif step + self.num_pending > 0:
            self.metadata.advance_seeds(self.seqs, step + self.num_pending)  # none appended: eager
        sample = self.runner.sampler(self.logits, self.metadata)
        self.token_ids, ready = sample.token_ids, None
        if self.runner.device.type == "cuda":
            host = torch.empty(self.token_ids.shape, dtype=self.token_ids.dtype, pin_memory=True)
            sample = replace(sample, token_ids=host.copy_(self.token_ids, non_blocking=True))
            ready = torch.cuda.Event()
            ready.record()
        return sample, ready


@dataclass
class DecodeRound:
    """The steps of one multi-step decode round, consumed by the engine in order."""
    seqs: list[Sequence]
    num_steps: int
    launcher: StepLauncher
    # per launched step: its sampler output (token ids in pinned host memory on a GPU) and
    # the event marking them ready (None on CPU); all of them at launch unless lazy
    steps: list[tuple[SamplerOutput, torch.cuda.Event | None]] = field(default_factory=list)

    @classmethod
    def launch(cls, runner: ModelRunner, seqs: list[Sequence], num_steps: int,
               after: DecodeRound | None = None) -> DecodeRound:
        """Queue the round: every step (eager), or the first forward only (lazy)."""
        lazy = any(follows_own_tokens(seq) for seq in seqs)
        decode_round = cls(seqs, num_steps, StepLauncher(runner, seqs, after, lazy))
        decode_round.launcher.forward(0)
        if not lazy:
            for step in range(num_steps):
                if step > 0:
                    decode_round.launcher.forward(step)
                decode_round.steps.append(decode_round.launcher.sample(step))
        return decode_round

    @property
    def lazy(self) -> bool:
        return self.launcher.lazy

    @property
    def last_token_ids(self) -> torch.Tensor:
        """[num_seqs] on the device: the last launched step's tokens (a chained round's inputs)."""
        return self.launcher.token_ids

    def outputs(self, on_last_step: Callable[[], None] | None = None) -> Iterator[ModelRunnerOutput]:
        """One output per step, each as soon as the device has it: the caller handles each
        (postprocesses its tokens) before asking for the next, and that handling overlaps
        the device's work on later steps. Tokens past a sequence's end are the caller's to
        drop. `on_last_step`: called once only the last step is outstanding (launched, not
        yet waited for), the point where async scheduling launches the next round."""
        rows = list(range(len(self.seqs)))
        for step in range(self.num_steps):
            if step == len(self.steps) and not self._launch_next(step):
                return
            if step == self.num_steps - 1 and step > 0 and on_last_step is not None:
                on_last_step()
            sample, ready = self.steps[step]
            if ready is not None:
                ready.synchronize()  # this step's tokens are in pinned host memory
            output = ModelRunnerOutput.empty(len(self.seqs))
            output.add_samples(rows, self.seqs, sample)
            yield output

    def _launch_next(self, step: int) -> bool:
        """Lazy: queue step `step`'s sampling and the next step's forward; False (nothing
        queued) once every sequence of the round has finished."""
        if all(seq.is_finished for seq in self.seqs):
            return False
        self.steps.append(self.launcher.sample(step))
        if step + 1 < self.num_steps:
            self.launcher.forward(step + 1)
        return True

    def rows_of(self, seqs: list[Sequence]) -> np.ndarray:
        """Row of each of `seqs` in this round.  # [len(seqs)] int64"""
        row = {seq.seq_id: i for i, seq in enumerate(self.seqs)}
        return np.fromiter((row[seq.seq_id] for seq in seqs), np.int64, len(seqs))
