"""SpeculativeConfig: the speculative decoding settings, parsed from vLLM's ``--speculative-config``."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("mtp", "ngram", "draft_model", "eagle3")
# methods that read ``model``: a draft model's directory, an EAGLE-3 head's
MODEL_METHODS = ("draft_model", "eagle3")
OFF = "none"
MAX_SPECULATIVE_TOKENS = 16
# vLLM's defaults when neither n-gram size is given (one given: the other takes its value)
DEFAULT_PROMPT_LOOKUP = 5
# DeepSeek-V3 / R1 ship one multi-token-prediction layer (num_nextn_predict_layers); vLLM takes
# k from that count when it is not given
DEFAULT_MTP_TOKENS = 1
NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
# EAGLE-3 tree drafts (SGLang's speculative_eagle_topk and speculative_num_draft_tokens)
TREE_KEYS = ("topk", "num_draft_tokens")
OPTIONAL_INT_KEYS = (*NGRAM_KEYS, "disable_by_batch_size", *TREE_KEYS)
MAX_TOPK = 16
# the most draft nodes of a tree (a verify window of the pending token and 64 nodes)
MAX_TREE_NODES = 64
# SGLang's name for num_speculative_tokens (the tree's depth), accepted by ``parse``
STEPS_ALIAS = "num_steps"


def tree_capacity(depth: int, topk: int) -> int:
    """The most nodes a draft tree of ``depth`` levels can have when each level expands the ``topk``
    best nodes of the one before into ``topk`` children each: ``topk`` at depth 1, then ``topk ** 2``
    candidates per level."""
    return topk + (depth - 1) * topk * topk


def default_draft_tokens(depth: int, topk: int) -> int:
    """``num_draft_tokens`` when not given: the pending token and ``topk`` nodes per level
    (``depth + 1``, the chain's window, at topk 1), at most the tree's capacity and 64 nodes."""
    return 1 + min(depth * topk, tree_capacity(depth, topk), MAX_TREE_NODES)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How a sequence's next tokens are drafted and verified in one window.

    ``method``: ``"mtp"`` (the model's own multi-token-prediction layers), ``"ngram"`` (prompt
    lookup over the sequence's own tokens) or ``"draft_model"`` (a smaller model with the same
    tokenizer, from the directory ``model``) or ``"eagle3"`` (an EAGLE-3 draft head over the
    target's hidden states, from the directory ``model``, or ``"default"``, also when ``model`` is
    not given: the built-in head of a built-in target). ``num_speculative_tokens`` (k, 1..16): tokens drafted
    per step (an ``eagle3`` tree's depth, SGLang's ``num_steps``, which ``parse`` accepts as an
    alias); required except for ``mtp`` (default 1). ``prompt_lookup_min`` /
    ``prompt_lookup_max``: the n-gram sizes tried, ``ngram`` only (vLLM's defaults: both 5 when
    neither is given, else the missing one takes the other's value). ``disable_by_batch_size``:
    steps running more requests than this do not speculate (default: always speculate).

    ``eagle3`` only (SGLang's meanings): ``topk`` (1..16, default 1): the children drafted per
    expanded node, and the nodes expanded per level; 1 drafts one greedy chain of k tokens.
    ``num_draft_tokens``: the verify window's rows, the pending token included, so a tree of
    ``num_draft_tokens - 1`` nodes; with topk 1 it is ``k + 1`` (the chain; another value is an
    error), else between 2 and ``1 + tree_capacity(k, topk)`` and at most 65 (64 nodes), default
    :func:`default_draft_tokens` (``1 + k * topk``, capped so). Other methods leave both ``None``.

    Build it with :meth:`parse` from a JSON string or dict (vLLM's keys); speculation off is
    ``None``, not a config.
    """

    method: str
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative config: method must be one of {', '.join(METHODS)} "
                             f"(or {OFF!r} for no speculation), got {self.method!r}")
        for key in ("num_speculative_tokens", *OPTIONAL_INT_KEYS):
            _check_int(key, getattr(self, key))
        k = self.num_speculative_tokens
        if k is None:
            if self.method != "mtp":
                raise ValueError(f"speculative config: num_speculative_tokens is required for method "
                                 f"{self.method!r}")
            object.__setattr__(self, "num_speculative_tokens", k := DEFAULT_MTP_TOKENS)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative config: num_speculative_tokens must be between 1 and "
                             f"{MAX_SPECULATIVE_TOKENS}, got {k}")
        self._check_ngram_sizes()
        self._check_tree()
        self._check_model()
        limit = self.disable_by_batch_size
        if limit is not None and limit < 1:
            raise ValueError(f"speculative config: disable_by_batch_size must be >= 1, got {limit}")

    def _check_ngram_sizes(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            for key in NGRAM_KEYS:
                if getattr(self, key) is not None:
                    raise ValueError(f"speculative config: {key} applies to method 'ngram' only, "
                                     f"not {self.method!r}")
            return
        for key, value in zip(NGRAM_KEYS, (low, high)):
            if value is not None and value < 1:
                raise ValueError(f"speculative config: {key} must be >= 1, got {value}")
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        if low > high:
            raise ValueError(f"speculative config: prompt_lookup_min ({low}) must not exceed "
                             f"prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    def _check_tree(self) -> None:
        if self.method != "eagle3":
            for key in TREE_KEYS:
                if getattr(self, key) is not None:
                    raise ValueError(f"speculative config: {key} applies to method 'eagle3' only, "
                                     f"not {self.method!r}")
            return
        depth, topk = self.num_speculative_tokens, self.topk
        if topk is None:
            object.__setattr__(self, "topk", topk := 1)
        if not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"speculative config: topk must be between 1 and {MAX_TOPK}, got {topk}")
        n = self.num_draft_tokens
        if n is None:
            object.__setattr__(self, "num_draft_tokens", default_draft_tokens(depth, topk))
            return
        if topk == 1:
            if n != depth + 1:
                raise ValueError(f"speculative config: num_draft_tokens must be num_speculative_tokens + 1 "
                                 f"({depth + 1}) with topk 1 (a chain of {depth} drafts and the pending "
                                 f"token), got {n}")
            return
        capacity = tree_capacity(depth, topk)
        most = 1 + min(capacity, MAX_TREE_NODES)
        if not 2 <= n <= most:
            raise ValueError(f"speculative config: num_draft_tokens must be between 2 and {most} (the pending "
                             f"token and at most {min(capacity, MAX_TREE_NODES)} nodes: a tree of depth {depth} "
                             f"and topk {topk} has at most {capacity}, and no tree more than "
                             f"{MAX_TREE_NODES}), got {n}")

    def _check_model(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative config: model must be a string (a directory), "
                             f"got {type(self.model).__name__}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative config: method 'draft_model' needs model, the draft "
                             "model's directory")
        if self.method == "eagle3" and self.model is None:  # the built-in head of a built-in target
            object.__setattr__(self, "model", "default")
        if self.method == "eagle3" and not self.model:
            raise ValueError("speculative config: method 'eagle3' needs model, the EAGLE-3 head's "
                             "directory (or 'default': the built-in head of a built-in target)")
        if self.method not in MODEL_METHODS and self.model is not None:
            raise ValueError(f"speculative config: model applies to methods {' and '.join(MODEL_METHODS)} "
                             f"only, not {self.method!r}")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The config for ``value``: a JSON object string, a dict of vLLM's keys, or a config
        (returned as it is). ``None``, JSON ``null`` and ``{"method": "none"}`` turn speculation
        off and give ``None``. Unknown keys, wrong types and out-of-range values are ValueErrors
        naming the key.

        >>> SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').describe()
        {'method': 'ngram', 'num_speculative_tokens': 3, 'prompt_lookup_min': 5, 'prompt_lookup_max': 5}
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config: not valid JSON ({exc.msg} at character "
                                 f"{exc.pos}): {value!r}") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config: expected a JSON object (a dict), "
                             f"got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(key) for key in value if key not in known and key != STEPS_ALIAS)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"the keys are {', '.join(known)}")
        if STEPS_ALIAS in value:
            value = dict(value)
            steps = value.pop(STEPS_ALIAS)
            if value.setdefault("num_speculative_tokens", steps) != steps:
                raise ValueError(f"speculative config: {STEPS_ALIAS} is another name for num_speculative_tokens; "
                                 f"they differ ({steps!r} and {value['num_speculative_tokens']!r})")
        if "method" not in value:
            raise ValueError(f"speculative config: method is required: one of {', '.join(METHODS)} "
                             f"or {OFF!r}")
        method = value["method"]
        if not isinstance(method, str):
            raise ValueError(f"speculative config: method must be a string, got {type(method).__name__}")
        if method == OFF:
            others = sorted(key for key in value if key != "method")
            if others:
                raise ValueError(f"speculative config: method 'none' turns speculation off and takes "
                                 f"no other keys, got {', '.join(others)}")
            return None
        return cls(**value)

    @property
    def window_rows(self) -> int:
        """The most rows of one verify window: the pending token and every draft (a tree's nodes)."""
        return self.num_draft_tokens or self.num_speculative_tokens + 1

    def describe(self) -> dict[str, Any]:
        """The settings that apply to this method (for /health); ``parse`` of it gives this config back."""
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            out.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        if self.method == "eagle3":
            out.update(topk=self.topk, num_draft_tokens=self.num_draft_tokens)
        if self.model is not None:
            out["model"] = self.model
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        return out


def _check_int(key: str, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"speculative config: {key} must be an integer, got {value!r}")
