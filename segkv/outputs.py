"""Result value objects returned by the engine (vLLM-like names and fields)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's log-probability and, if asked, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One generated continuation.

    ``finish_reason``: ``"stop"`` (EOS, a stop token id or a stop string) or ``"length"``
    (``max_tokens`` or the model length). ``stop_reason`` is the stop string or token id
    that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    """The outputs of one prompt; ``num_cached_tokens`` of the prompt were not recomputed.

    ``prompt_logprobs`` (when the request's ``prompt_logprobs`` is set): one entry per prompt
    token, ``None`` for the first (nothing precedes it), else the token's log-probability given
    the tokens before it and the asked number of alternatives (as vLLM reports them).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class TurnStats:
    """What one conversation turn cost in the KV cache."""

    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    generated_tokens: int
    pages_added: int
    bytes_added: int
    bytes_copied: int
    segments: int
    routes: dict[str, int]
