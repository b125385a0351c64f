"""Per-request sampling settings (OpenAI/vLLM-compatible), validated on construction."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MAX_LOGPROBS = 20  # most alternatives one token may report (OpenAI's top_logprobs limit)
GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them would overflow)
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed's accepted range
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one logit_bias value
_STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


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


def _literal(text: str) -> str:
    """``text`` as one EBNF string literal (JSON's escapes are xgrammar's)."""
    return json.dumps(text, ensure_ascii=False)


@functools.lru_cache(maxsize=64)
def _build_grammar(kind: str, spec: str, prefix: str, suffix: str):
    """The ``xgrammar.Grammar`` of one constraint (``spec``: the schema as canonical JSON, the
    regex, the EBNF, or the choices as a JSON list), with ``prefix``/``suffix`` concatenated as
    literals; RuntimeError from xgrammar for an invalid spec. Cached: a request's constraint is
    validated on construction and compiled later from the same object."""
    import xgrammar

    if kind == "json_schema":
        core = xgrammar.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
    elif kind == "json_object":
        core = xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    elif kind == "regex":
        core = xgrammar.Grammar.from_regex(spec)
    elif kind == "choice":
        core = xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(_literal(c) for c in json.loads(spec)))
    else:
        core = xgrammar.Grammar.from_ebnf(spec)
    parts = [xgrammar.Grammar.from_ebnf("root ::= " + _literal(t)) if t else None for t in (prefix, suffix)]
    if not any(parts):
        return core
    return xgrammar.Grammar.concat(*[g for g in (parts[0], core, parts[1]) if g is not None])


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A constraint on a request's output, enforced by constrained decoding (xgrammar).

    Exactly one of ``json_schema`` (a JSON schema object), ``json_object`` (True: any JSON
    object), ``regex``, ``choice`` (one of these strings exactly) or ``grammar`` (EBNF in
    xgrammar's syntax, root rule ``root``). ``prefix`` and ``suffix`` are literal text forced
    before and after the constrained part; after the suffix the output ends. JSON is generated
    compactly (no free whitespace), so a model cannot pad it forever. An invalid schema, regex
    or grammar raises ValueError on construction (the grammar is built then, and cached).
    """

    json_schema: dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    prefix: str = ""
    suffix: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        given = self._given()
        if len(given) != 1:
            raise ValueError("structured output takes exactly one of json_schema, json_object, regex, choice "
                             f"or grammar, got {given or 'none'}")
        for name in ("prefix", "suffix"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"structured output {name} must be a str, got {getattr(self, name)!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured output {name} must be a non-empty str, got {value!r}")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, Mapping):
                raise ValueError(f"json_schema must be a JSON schema object (a dict), "
                                 f"got {self.json_schema!r}")
            try:
                json.dumps(self.json_schema)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"json_schema is not JSON-serialisable: {exc}") from None
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else self.choice
            if not isinstance(choice, Iterable) or not (choice := tuple(choice)):
                raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")
            if any(not isinstance(c, str) or not c for c in choice):
                raise ValueError(f"every choice must be a non-empty str, got {list(choice)!r}")
            object.__setattr__(self, "choice", choice)
        try:
            self.to_grammar()
        except Exception as exc:  # noqa: BLE001 -- xgrammar raises RuntimeError and its own types
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
            raise ValueError(f"invalid {self.kind}: {message.split(': ', 1)[-1]}") from None

    @property
    def kind(self) -> str:
        """Which constraint this is: ``json_schema``, ``json_object``, ``regex``, ``choice``, ``grammar``."""
        return self._given()[0]

    def _given(self) -> list[str]:
        """The constraint fields that are set (``json_object`` counts when True)."""
        return [k for k in _STRUCTURED_KINDS
                if (self.json_object if k == "json_object" else getattr(self, k) is not None)]

    @property
    def key(self) -> tuple[str, str, str, str]:
        """``(kind, spec, prefix, suffix)``: equal for equal constraints (a schema as compact JSON)."""
        kind = self.kind
        if kind == "json_schema":
            spec = json.dumps(self.json_schema, separators=(",", ":"))  # key order is the output's order
        elif kind == "choice":
            spec = json.dumps(list(self.choice))
        else:
            spec = "" if kind == "json_object" else getattr(self, kind)
        return kind, spec, self.prefix, self.suffix

    def __hash__(self) -> int:
        return hash(self.key)

    def to_grammar(self):
        """The ``xgrammar.Grammar`` of this constraint (cached per :attr:`key`)."""
        return _build_grammar(*self.key)


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

    ``structured`` constrains the output (:class:`StructuredOutput`). ``logit_bias`` maps token
    ids to values in ``[-100, 100]`` added to the model's raw logits before anything else
    (OpenAI's semantics; ids are checked against the vocabulary when the request is added).
    ``prompt_logprobs`` ``k`` in ``0..20`` reports each prompt token's log-probability and its
    ``k`` most likely alternatives (the first prompt token has none; a cached prefix of the
    prompt is recomputed to score it). ``max_tokens`` may be 0
    only with ``prompt_logprobs`` (prompt scoring: nothing is generated).
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
    structured: StructuredOutput | None = None
    logit_bias: Mapping[int, float] | None = None
    prompt_logprobs: int | None = None

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
        plp = self.prompt_logprobs
        if plp is not None and (not _is_int(plp) or not 0 <= plp <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {plp!r}")
        if plp is None:
            _integer("max_tokens", self.max_tokens, 1, ">= 1")
        else:
            _integer("max_tokens", self.max_tokens, 0, ">= 0")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {self.structured!r}")
        put(self, "logit_bias", self._logit_bias(self.logit_bias))
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
    def _logit_bias(bias: Mapping[int, float] | None) -> Mapping[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {bias!r}")
        out = {}
        for token, value in bias.items():
            if isinstance(token, str) and token.strip().isdigit():  # JSON object keys are strings
                token = int(token)
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            value = _number(f"logit_bias[{token}]", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
            out[token] = value
        return out or None

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the first ``logit_bias`` token id outside ``[0, vocab_size)``."""
        for token in self.logit_bias or ():
            if token >= vocab_size:
                raise ValueError(f"logit_bias token id {token} is out of the vocabulary (size {vocab_size})")

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

    @property
    def constrained(self) -> bool:
        """True when a grammar constrains the output."""
        return self.structured is not None

    def replace(self, **changes) -> SamplingParams:
        """A copy with ``changes`` applied, validated like a new instance."""
        return dataclasses.replace(self, **changes)
