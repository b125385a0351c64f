"""OpenAI-compatible request models and the JSON bodies of responses, chunks and errors."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from segkv.outputs import CompletionOutput, RequestOutput
from segkv.sampling_params import MAX_LOGPROBS, SamplingParams


MAX_SAMPLES_PER_PROMPT = 128
LOGIT_BIAS_LIMIT = 100  # OpenAI's range: -100 (ban) .. 100 (only choice)
# Strict as OpenAI's types are: a bool is not an integer, "yes" is not a bool, "2" is not a
# number (a float field still takes an integer)
STRICT = ConfigDict(strict=True)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list_of(check, what: str):
    """A validator for a list whose items all pass ``check``: one clear error for the first bad
    item, where pydantic would build an error per item (millions for a large bad list)."""
    def validate(value: object) -> object:
        if value is None:
            return value
        if not isinstance(value, list):
            raise ValueError(f"must be {what}")
        for i, item in enumerate(value):
            if not check(item):
                raise ValueError(f"must be {what} (item {i} is not)")
        return value

    return BeforeValidator(validate)


def _prompt(value: object) -> object:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(_is_int(t) for t in value) or all(isinstance(t, str) for t in value):
            return value
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in value):
            return value
    if isinstance(value, list) and not value:
        raise ValueError("prompt must not be empty")
    raise ValueError("must be a string, a list of strings, a list of token ids (integers) or a list of "
                     "token id lists")


def _content(value: object) -> object:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ValueError(f"only text content parts are supported (part {i} is not one)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {i}'s `text` must be a string")
    return value


_strings = _list_of(lambda s: isinstance(s, str), "a string or a list of strings").func
Stop = Annotated[str | list[str] | None, BeforeValidator(lambda v: v if isinstance(v, str) else _strings(v))]
TokenIds = Annotated[list[int] | None, _list_of(_is_int, "a list of token ids (integers)")]


class FieldError(ValueError):
    """Bad input in one request field; ``param`` names it in the 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def logit_bias(value: object, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token id strings to numbers in [-100, 100]) as token ids to
    floats, or None when empty (FieldError naming ``logit_bias``)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError("`logit_bias` must be an object of token ids to numbers", "logit_bias")
    bias = {}
    for key, number in value.items():
        token = key.strip() if isinstance(key, str) else ""
        if not (token.isascii() and token.isdigit() and len(token) <= 12 and int(token) < vocab_size):
            raise FieldError(f"`logit_bias` keys must be token ids in 0..{vocab_size - 1}, got {key[:40]!r}",
                             "logit_bias")
        if (isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number)
                or not -LOGIT_BIAS_LIMIT <= number <= LOGIT_BIAS_LIMIT):
            raise FieldError(f"`logit_bias` values must be numbers in [-{LOGIT_BIAS_LIMIT}, "
                             f"{LOGIT_BIAS_LIMIT}]", "logit_bias")
        bias[int(token)] = float(number)
    return bias or None


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


# OpenAI request fields this server does not implement, and when a value asks for the feature
# (a client library may send the neutral value): rejected with a clear error, never ignored
UNSUPPORTED_FIELDS = {
    "functions": bool,
    "function_call": lambda v: v not in (None, "none", "auto"),
    "suffix": bool,
    "best_of": lambda v: v not in (None, 1),
}
# chat's tool fields, refused on completions
COMPLETION_UNSUPPORTED = {
    **UNSUPPORTED_FIELDS,
    "tools": bool,
    "tool_choice": lambda v: v not in (None, "none", "auto"),
}


class _Request(BaseModel):
    """Fields shared by completions and chat. Unknown fields are ignored, as OpenAI does, except
    the OpenAI features this server lacks (:data:`UNSUPPORTED_FIELDS`), which are refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    unsupported: ClassVar[dict] = UNSUPPORTED_FIELDS

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's ranges; the engine's SamplingParams checks the rest (finite values, seed range)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    # samples per prompt; bounded as OpenAI bounds it, so one request cannot hold the engine
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES_PER_PROMPT)
    stop: Stop = None
    stop_token_ids: TokenIds = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool = False
    # extension: false makes this request decode one token per step on a speculative server
    speculative: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None

    def check_supported(self) -> None:
        """FieldError for a field asking for a feature this server does not implement."""
        extra = self.model_extra or {}
        for name, asks in self.unsupported.items():
            if name in extra and asks(extra[name]):
                raise FieldError(f"`{name}` is not supported by this server", name)

    def sampling_params(self, *, default_max_tokens: int, logprobs: int | None, vocab_size: int,
                        structured=None, prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's settings (ValueError with a clear message for invalid values and for
        features this server does not implement; FieldError naming the field where one is to
        blame). ``structured``: the StructuredOutput constraint, if any."""
        self.check_supported()
        extra = self.model_extra or {}
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
        }
        bias = logit_bias(extra.get("logit_bias"), vocab_size)
        # the engine's newer settings are passed only when asked for
        newer = {"structured": structured, "logit_bias": bias, "prompt_logprobs": prompt_logprobs}
        given.update({name: value for name, value in newer.items() if value is not None})
        max_tokens = self.requested_max_tokens
        return SamplingParams(
            **{k: v for k, v in given.items() if v is not None},
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            n=self.n, stop=self.stop, stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos, logprobs=logprobs, speculative=self.speculative,
        )

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's output limit (``max_completion_tokens`` first), None when omitted."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    unsupported: ClassVar[dict] = COMPLETION_UNSUPPORTED

    prompt: Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_prompt)]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # 0 with echo: prompt scoring (the prompt's logprobs, nothing generated)
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False


class ChatMessage(BaseModel):
    """One chat message. ``developer`` is OpenAI's newer name for ``system`` and is templated as
    one; ``tool`` messages carry a ``tool_call_id``, assistant messages may carry ``tool_calls``
    (checked by :func:`segkv.server.tools.template_message`)."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[dict[str, Any]] | None, BeforeValidator(_content)] = None
    name: str | None = None

    def plain(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined into one string (None content,
        as an assistant message with tool calls has, is an empty string)."""
        extra = self.model_extra or {}
        content = self.content
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        role = "system" if self.role == "developer" else self.role
        message = {**extra, "role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], _list_of(lambda m: isinstance(m, dict), "a list of message objects"),
                        Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


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


def sse_event(payload: dict) -> str:
    """``payload`` as one server-sent event (compact JSON)."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


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


def prompt_logprobs(output: RequestOutput, decode) -> dict:
    """The legacy ``logprobs`` object of the prompt's tokens (echo): the first token has none."""
    ids = output.prompt_token_ids
    entries = getattr(output, "prompt_logprobs", None) or [None] * len(ids)
    tokens = [decode(t) for t in ids]
    offsets, pos = [], 0
    for token in tokens:
        offsets.append(pos)
        pos += len(token)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {decode(t): lp for t, lp in (e.top or [])}
                             for e in entries],
            "text_offset": offsets}


def joined_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two legacy ``logprobs`` objects one after the other (``second``'s offsets already count
    ``first``'s text)."""
    if first is None or second is None:
        return first or second
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: first[key] + second[key] for key in keys}
