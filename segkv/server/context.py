"""The output limit of a request checked against the model's context length (vLLM's wording)."""

from __future__ import annotations

from segkv.server.errors import APIError


def fit_max_tokens(prompt_lengths: list[int], requested: int | None, *, default: int, max_model_len: int,
                   where: str = "prompt") -> int:
    """The ``max_tokens`` to run prompts of ``prompt_lengths`` tokens with.

    A ``requested`` limit that does not fit beside the longest prompt is a 400, worded as vLLM
    words it (``where`` is "prompt" or "messages"). An omitted one is ``default``, clamped to
    the room the shortest prompt leaves; the engine stops each longer prompt at the context
    length (finish reason "length"). A prompt that leaves no room at all is a 400 either way.
    """
    longest = max(prompt_lengths)
    if requested is not None and longest + requested > max_model_len:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                 f"{longest + requested} tokens ({longest} in the {where}, {requested} in the completion). "
                 f"Please reduce the length of the {where} or completion.",
            "invalid_request_error", param="max_tokens", code="context_length_exceeded")
    if longest >= max_model_len:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                 f"{longest} tokens in the {where}, which leaves no room for the completion. "
                 f"Please reduce the length of the {where}.",
            "invalid_request_error", param=where, code="context_length_exceeded")
    if requested is not None:
        return requested
    return max(1, min(default, max_model_len - min(prompt_lengths)))
