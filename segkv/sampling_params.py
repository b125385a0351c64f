"""Per-request sampling settings (OpenAI/vLLM-compatible), validated on construction."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

MAX_LOGPROBS = 20  # most alternatives one token may report (OpenAI's top_logprobs limit)
GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them would overflow)
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed's accepted range


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(name: str, value: object, minimum: int, what: str) -> int:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer {what}, got {value!r}")
    return value


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to choose the tokens of one request.

    ``temperature`` 0 (anything below ``GREEDY_EPS``) is greedy: the argmax after penalties,
    and ``top_k``/``top_p``/``min_p``/``seed`` are then unused. Filters are off at their
    defaults: ``top_k`` 0 (``-1`` is accepted and stored as 0), ``top_p`` 1, ``min_p`` 0.
    ``repetition_penalty`` (1 = off) scales the logits of every token seen in the prompt or
    the output; ``presence_penalty`` and ``frequency_penalty`` (0 = off) subtract from the
    logits of tokens seen in the output only. A request with a ``seed`` draws from its own
    generator, so its tokens do not depend on the rest of the batch. ``stop`` strings and
    ``stop_token_ids`` end the output (the stop string itself is not returned); the
    tokenizer's end-of-sequence token also ends it unless ``ignore_eos``. ``logprobs``
    ``None`` reports no alternatives, ``k`` in ``0..20`` the ``k`` most likely ones.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    speculative: bool = True  # False: this request decodes one token per step when speculation is on

    def __post_init__(self) -> None:
        put = object.__setattr__
        temperature = _number("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        put(self, "temperature", temperature)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        put(self, "top_k", max(self.top_k, 0))
        top_p = _number("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 is off), got {top_p}")
        put(self, "top_p", top_p)
        min_p = _number("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 is off), got {min_p}")
        put(self, "min_p", min_p)
        repetition = _number("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off), got {repetition}")
        put(self, "repetition_penalty", repetition)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 is off), got {value}")
            put(self, name, value)
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}")
        _integer("max_tokens", self.max_tokens, 1, ">= 1")
        _integer("n", self.n, 1, ">= 1")
        put(self, "stop", self._stop_strings(self.stop))
        put(self, "stop_token_ids", self._token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {lp!r}")

    @staticmethod
    def _stop_strings(stop: str | Iterable[str] | None) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Iterable):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        stop = tuple(stop)
        for item in stop:
            if not isinstance(item, str) or not item:
                raise ValueError(f"every stop string must be a non-empty str, got {item!r}")
        return stop

    @staticmethod
    def _token_ids(ids: Iterable[int] | None) -> tuple[int, ...]:
        if ids is None:
            return ()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
        ids = tuple(ids)
        for item in ids:
            if not _is_int(item) or item < 0:
                raise ValueError(f"every stop token id must be an integer >= 0, got {item!r}")
        return ids

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0)."""
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def replace(self, **changes) -> SamplingParams:
        """A copy with ``changes`` applied, validated like a new instance."""
        return dataclasses.replace(self, **changes)
