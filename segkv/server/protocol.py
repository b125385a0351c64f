"""OpenAI-compatible request models and the JSON bodies of responses, chunks and errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from segkv.outputs import CompletionOutput, RequestOutput
from segkv.sampling_params import SamplingParams


MAX_SAMPLES_PER_PROMPT = 128


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI request fields this server does not implement, and when a value asks for the feature
# (a client library may send the neutral value): rejected with a clear error, never ignored
UNSUPPORTED_FIELDS = {
    "logit_bias": bool,
    "tools": bool,
    "functions": bool,
    "tool_choice": lambda v: v not in (None, "none", "auto"),
    "function_call": lambda v: v not in (None, "none", "auto"),
    "response_format": lambda v: not (v is None or (isinstance(v, dict) and v.get("type") == "text")),
    "echo": bool,
    "suffix": bool,
    "best_of": lambda v: v not in (None, 1),
}


class _Request(BaseModel):
    """Fields shared by completions and chat. Unknown fields are ignored, as OpenAI does, except
    the OpenAI features this server lacks (:data:`UNSUPPORTED_FIELDS`), which are refused."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    # samples per prompt; bounded as OpenAI bounds it, so one request cannot hold the engine
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES_PER_PROMPT)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, *, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's settings (ValueError with a clear message for invalid values and for
        features this server does not implement)."""
        extra = self.model_extra or {}
        for name, asks in UNSUPPORTED_FIELDS.items():
            if name in extra and asks(extra[name]):
                raise ValueError(f"`{name}` is not supported by this server")
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
        }
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return SamplingParams(
            **{k: v for k, v in given.items() if v is not None},
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            n=self.n, stop=self.stop, stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def plain(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise ValueError("only text content parts are supported")
            content = "".join(str(part.get("text", "")) for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]

    @classmethod
    def of(cls, outputs: list[RequestOutput]) -> Usage:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details={"cached_tokens": cached})


ErrorType = Literal["invalid_request_error", "not_found_error", "service_unavailable_error", "server_error"]


def error_body(message: str, type_: ErrorType, *, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def finish_reason(output: CompletionOutput) -> str | None:
    reason = output.finish_reason
    return reason if reason in (None, "stop", "length") else "stop"


def completion_logprobs(output: CompletionOutput, start: int, decode, offset: int) -> dict | None:
    """The legacy completions ``logprobs`` object for tokens ``start:`` of ``output``."""
    if output.logprobs is None:
        return None
    entries = output.logprobs[start:]
    tokens = [decode(e.token_id) for e in entries]
    offsets, pos = [], offset
    for token in tokens:
        offsets.append(pos)
        pos += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode(t): lp for t, lp in (e.top or [])} for e in entries],
            "text_offset": offsets}


def chat_logprobs(output: CompletionOutput, start: int, decode) -> dict | None:
    """The chat ``logprobs`` object ({"content": [...]}) for tokens ``start:`` of ``output``."""
    if output.logprobs is None:
        return None

    def item(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in (e.top or [])]}
                        for e in output.logprobs[start:]]}
