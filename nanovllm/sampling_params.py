"""SamplingParams: the per-request generation settings, validated at construction.

Field names and meanings follow vLLM's `SamplingParams`. Every value is checked
when the object is built, so a bad request fails before it reaches the scheduler.
"""
import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int | None = 16
    ignore_eos: bool = False

    def __post_init__(self):
        self._validate()

    def _validate(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
