"""SamplingParams: the per-request generation settings, validated at construction.

Field names, defaults and meanings follow vLLM's `SamplingParams`. Every value is
checked when the object is built, so a bad request fails (with a `ValueError`
naming the value) before it reaches the scheduler. Two values are normalized as
vLLM does: `top_k=-1` becomes 0 (off), and `stop` given as one string becomes a list.

The engine fills in what only it knows (the model's EOS ids, the room left for
`max_tokens`) on a copy, with `dataclasses.replace` and `set_eos_token_ids`.
"""
import math
from dataclasses import dataclass, field

from nanovllm.structured_outputs.params import StructuredOutputsParams

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS): dividing by a
# smaller temperature overflows float32 logits, and the result is argmax anyway.
SAMPLING_EPS = 1e-5
# vLLM's default `max_logprobs`: alternatives per position a request may ask for.
MAX_LOGPROBS = 20
# Stop strings are searched in the new text of every step; a few dozen covers
# every real use (OpenAI allows 4) and bounds the per-token cost of a request.
MAX_STOP_STRINGS = 64
# OpenAI's bound on presence and frequency penalties, which vLLM enforces too.
MAX_ABS_PENALTY = 2.0
# OpenAI's bound on a logit_bias value (-100 bans a token, +100 all but forces it).
MAX_ABS_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16         # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None         # top alternatives per generated token (+ the sampled one)
    prompt_logprobs: int | None = None  # the same for each prompt token
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar
    # Filled by the engine: EOS ids that end this request (empty with ignore_eos).
    _eos_token_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)
    _all_stop_token_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop, "strings")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, "token ids")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids, "token ids")
        if isinstance(self.logit_bias, dict):  # a copy, as the lists: the caller's later edits skip validation
            self.logit_bias = dict(self.logit_bias)
        self._validate()
        self._all_stop_token_ids = frozenset(self.stop_token_ids)

    # ---- validation -----------------------------------------------------------

    def _validate(self) -> None:
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lengths()
        self._validate_stops()
        self._validate_logprobs()
        self._validate_token_constraints()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")

    def _validate_sampling(self) -> None:
        _check_int("n", self.n, minimum=1)
        t = _check_number("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {t!r}")
        if not 0 < _check_number("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, minimum=0, hint="-1 or 0 (off), or at least 1")
        if not 0 <= _check_number("min_p", self.min_p) <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed)

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_number(name, getattr(self, name))
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {value!r}")
        if _check_number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_STRINGS} ids, "
                             f"got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t, minimum=0)

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")

    def _validate_token_constraints(self) -> None:
        """logit_bias and allowed_token_ids; the engine checks the ids against its vocabulary."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for token_id, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token_id, minimum=0)
                if not -MAX_ABS_LOGIT_BIAS <= _check_number("logit_bias value", bias) <= MAX_ABS_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be in [-{MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}], "
                                     f"got {bias!r} for token {token_id}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None: every token is allowed)")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids entry", t, minimum=0)

    @property
    def named_token_ids(self) -> dict[str, list[int]]:
        """The token ids the request names, by option, for the engine's vocabulary check."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias or ()),
                "allowed_token_ids": self.allowed_token_ids or []}

    # ---- derived values -------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Token ids that end the request: EOS (unless ignore_eos) and stop_token_ids."""
        return self._all_stop_token_ids

    def set_eos_token_ids(self, eos_token_ids) -> None:
        """Engine side: record the model's EOS ids (none when ignore_eos)."""
        self._eos_token_ids = self._stopping_eos(eos_token_ids)
        self._all_stop_token_ids = self.stop_token_ids_with(eos_token_ids)

    def stop_token_ids_with(self, eos_token_ids) -> frozenset[int]:
        """The ids that would end this request given the model's EOS ids: what
        `all_stop_token_ids` holds once the engine has called `set_eos_token_ids`."""
        return self._stopping_eos(eos_token_ids) | frozenset(self.stop_token_ids)

    def _stopping_eos(self, eos_token_ids) -> frozenset[int]:
        return frozenset() if self.ignore_eos else frozenset(eos_token_ids)


def _as_list(name: str, value, entries: str) -> list:
    """`value` (None, a list, tuple or set) as a list; anything else is a ValueError naming it."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"{name} must be a list of {entries}, got {value!r}")
    return list(value)


def _check_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _check_int(name: str, value, minimum: int | None = None, hint: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {hint or f'>= {minimum}'}, got {value!r}")
    return value
