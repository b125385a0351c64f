"""The FastAPI app: OpenAI completions and chat (streaming or not), models, health and metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

import segkv.settings as settings
from segkv.engine import AsyncEngine, SessionStore, StreamUpdate
from segkv.outputs import RequestOutput
from segkv.sampling_params import SamplingParams
from segkv.server.auth import ApiKeyAuth, check_api_key
from segkv.server.context import fit_max_tokens
from segkv.server.dashboard import dashboard_router
from segkv.server.disconnect import unless_client_leaves
from segkv.server.errors import APIError, echo, engine_error, install_error_handlers, safe_message
from segkv.server.guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard, check_max_bytes
from segkv.server.metrics import CONTENT_TYPE, ServerMetrics, speculative_stats
from segkv.server.sessions_api import sessions_router
from segkv.server.protocol import (ChatCompletionRequest, CompletionRequest, FieldError, Usage, chat_logprobs,
                                   completion_logprobs, finish_reason, joined_logprobs, prompt_logprobs,
                                   sse_event)
from segkv.server.structured import structured_output
from segkv.server.tool_output import CallText, ToolStream, limit_calls
from segkv.server.tool_parsers import default_parser, parser_for
from segkv.server.tools import call_constraint, check_parameter_schemas, template_message, tool_settings

__all__ = ["APIError", "DEFAULT_MAX_REQUEST_BYTES", "create_app"]

LSE_API = "torch-reference"


class _Streams:
    """The engine streams of one HTTP request, merged; closing it aborts what is unfinished."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.errors: list[Exception] = []

    async def start(self, engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                    rid: str) -> None:
        for i, ids in enumerate(prompts):
            stream = engine.generate(ids, params, request_id=f"{rid}-{i}")
            self.tasks.append(asyncio.create_task(self._pump(i, stream)))
        await asyncio.sleep(0)  # every pump has run add_request: its errors are known now
        if self.errors:
            self.close()
            raise self.errors[0]

    async def _pump(self, index: int, stream: AsyncIterator[StreamUpdate]) -> None:
        try:
            async for update in stream:
                self.queue.put_nowait((index, update))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            self.errors.append(exc)
            self.queue.put_nowait((index, exc))

    async def updates(self) -> AsyncIterator[tuple[int, StreamUpdate]]:
        remaining = len(self.tasks)
        while remaining:
            index, item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            remaining -= item.finished
            yield index, item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Cancel the pumps; each cancelled engine stream aborts its request and frees its pages."""
        for task in self.tasks:
            task.cancel()


def create_app(engine: AsyncEngine, *, model_name: str, snapshot_dir: str | Path | None = None,
               session_ttl: float = 3600.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               api_key: str | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` under the model name ``model_name``.

    Tool calls are read with ``tool_call_parser`` (vLLM's ``--tool-call-parser`` names), by
    default the parser of the model's family (:func:`segkv.server.tool_parsers.default_parser`;
    none: requests with tools get a 400 unless ``tool_choice`` is "none").

    Sessions live ``session_ttl`` seconds idle; ``snapshot_dir`` enables saving them to files.
    Request bodies over ``max_request_bytes`` get a 413. With ``api_key``, ``/v1/*`` and the
    dashboard's data need ``Authorization: Bearer <api_key>`` (see :mod:`segkv.server.auth`);
    ``/health`` and ``/metrics`` stay open. Every error is an OpenAI error body.
    """
    check_max_bytes(max_request_bytes)  # here, not when the middleware is built at the first request
    if tool_call_parser is not None:
        parser_for(tool_call_parser)  # an unknown name is refused here, not at the first request
    if api_key is not None:
        check_api_key(api_key)
    app = FastAPI(title="segkv", version="0")
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_bytes=max_request_bytes)
    if api_key is not None:  # added last: the outermost layer, so a request without the key is refused first
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    sessions = SessionStore(engine, ttl_seconds=session_ttl)
    app.state.sessions = sessions
    app.include_router(sessions_router(sessions, snapshot_dir=Path(snapshot_dir) if snapshot_dir else None))
    llm = engine.llm

    def speculative() -> dict | None:
        return speculative_stats(llm.speculative_config, llm.generator.spec_stats)

    app.include_router(dashboard_router(
        lambda: {**engine.live_stats(), "sessions": [s.describe() for s in sessions.list()],
                 "speculative": speculative()},
        model_name=model_name, max_model_len=llm.max_model_len, started=time.time()))
    tokenizer = llm.tokenizer
    vocab_size = llm.model.cfg.vocab_size
    parser_name = tool_call_parser or default_parser(_model_type(llm.model_dir))
    call_text = CallText(tokenizer, parser_for(parser_name)) if parser_name else None
    metrics = ServerMetrics(
        lambda: {**engine.stats(), "sessions": sessions.stats(), "speculative": speculative()},
        model_name=model_name)
    created = int(time.time())
    app.state.engine, app.state.metrics = engine, metrics

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def check_model(model: str) -> None:
        if model != model_name:  # the name is echoed cut short: it may be a megabyte
            raise APIError(404, f"The model `{echo(model)}` does not exist.", "invalid_request_error",
                           param="model", code="model_not_found")

    def check_ids(ids: list[int]) -> list[int]:
        vocab = llm.model.cfg.vocab_size
        if not ids:
            raise APIError(400, "a prompt must have at least one token", "invalid_request_error",
                           param="prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", "invalid_request_error",
                           param="prompt")
        return ids

    async def start(prompts: list[list[int]], params: SamplingParams, rid: str) -> _Streams:
        streams = _Streams()
        try:
            await streams.start(engine, prompts, params, rid)
        except Exception as exc:
            raise engine_error(exc) from exc
        return streams

    def record(update: StreamUpdate) -> None:
        metrics.observe_finished(update.output, arrival=update.arrival,
                                 first_token_time=update.first_token_time, now=time.monotonic())

    async def collect(streams: _Streams, count: int) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * count
        try:
            async for index, update in streams.updates():
                if update.finished:
                    finals[index] = update.output
                    record(update)
        except Exception as exc:
            raise engine_error(exc) from exc
        finally:
            streams.close()
        return finals  # type: ignore[return-value]

    async def stream_chunks(streams: _Streams, chunk, n: int, first=None, usage: bool = False):
        """SSE text: ``chunk(choice_index, output, start_token, delta, done, request_output)`` per
        new piece (a payload, or a list of payloads, none to skip)."""
        texts: dict[int, str] = {}
        tokens: dict[int, int] = {}
        finals: list[RequestOutput] = []
        try:
            if first is not None:
                for index in range(first):
                    yield sse_event(chunk(index, None, 0, None, False, None))
            async for prompt_index, update in streams.updates():
                for out in update.output.outputs:
                    index = prompt_index * n + out.index
                    old = texts.get(index, "")
                    delta = out.text[len(old):] if out.text.startswith(old) else out.text
                    done = out.finish_reason is not None and update.finished
                    if delta or done or len(out.token_ids) > tokens.get(index, 0):
                        payloads = chunk(index, out, tokens.get(index, 0), delta, done, update.output)
                        for payload in payloads if isinstance(payloads, list) else [payloads]:
                            yield sse_event(payload)
                    texts[index], tokens[index] = out.text, len(out.token_ids)
                if update.finished:
                    finals.append(update.output)
                    record(update)
            if usage:
                yield sse_event(chunk(None, None, 0, Usage.of(finals).model_dump(), True, None))
        except Exception as exc:  # headers are sent: report the error in the stream
            yield sse_event(engine_error(exc).body)
        finally:
            streams.close()
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [tokenizer.encode(prompt)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        if not prompts:
            raise APIError(400, "prompt must not be empty", "invalid_request_error", param="prompt")
        prompts = [check_ids(p) for p in prompts]
        if req.requested_max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens 0 needs echo (prompt scoring)", "invalid_request_error",
                           param="max_tokens")
        max_tokens = fit_max_tokens([len(p) for p in prompts], req.requested_max_tokens, default=16,
                                    max_model_len=llm.max_model_len, where="prompt")
        # echo with logprobs scores the prompt; max_tokens 0 needs prompt logprobs in the engine
        scoring = req.echo and (req.logprobs is not None or max_tokens == 0)
        structured = _structured(req)
        params = _params(req, default_max_tokens=max_tokens, logprobs=req.logprobs, vocab_size=vocab_size,
                         structured=structured, prompt_logprobs=(req.logprobs or 0) if scoring else None)
        rid, n = f"cmpl-{uuid.uuid4().hex}", req.n
        streams = await start(prompts, params, rid)
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
        sources = prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]

        def echoed(final: RequestOutput, out, prompt_index: int) -> tuple[str, dict | None]:
            """The prompt's text and logprobs, then the output's: what ``echo`` answers."""
            source = sources[prompt_index]
            text = source if isinstance(source, str) else tokenizer.decode(prompts[prompt_index])
            logprobs = completion_logprobs(out, 0, token_text, len(text))
            if req.logprobs is not None:
                logprobs = joined_logprobs(prompt_logprobs(final, token_text), logprobs)
            return text, logprobs

        if req.stream:
            opened: set[int] = set()

            def chunk(index, out, start_token, delta, done, final):
                if index is None:
                    return {**base, "choices": [], "usage": delta}
                logprobs = completion_logprobs(out, start_token, token_text, 0)
                if req.echo and index not in opened:
                    opened.add(index)
                    text, logprobs = echoed(final, out, index // n)
                    delta = text + delta
                return {**base, "choices": [{"index": index, "text": delta, "logprobs": logprobs,
                                             "finish_reason": finish_reason(out) if done else None}]}

            return StreamingResponse(stream_chunks(streams, chunk, n, usage=req.include_usage),
                                     media_type="text/event-stream",
                                     background=BackgroundTask(streams.aclose))
        finals = await unless_client_leaves(request, collect(streams, len(prompts)))
        choices = []
        for i, final in enumerate(finals):
            for out in final.outputs:
                text, logprobs = out.text, completion_logprobs(out, 0, token_text, 0)
                if req.echo:
                    prefix, logprobs = echoed(final, out, i)
                    text = prefix + text
                choices.append({"index": i * n + out.index, "text": text, "finish_reason": finish_reason(out),
                                "logprobs": logprobs})
        return {**base, "choices": choices, "usage": Usage.of(finals).model_dump()}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        tools, parser, structured = _chat_tools(req, parser_name)
        try:
            messages = [template_message(m.plain(), i) for i, m in enumerate(req.messages)]
            ids = tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools.tools)
        except FieldError as exc:
            raise APIError(400, safe_message(exc), "invalid_request_error", param=exc.param) from exc
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise APIError(400, safe_message(exc), "invalid_request_error", param="messages") from exc
        check_ids(ids)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        # no limit given: the room the context leaves, as vLLM does
        max_tokens = fit_max_tokens([len(ids)], req.requested_max_tokens, default=llm.max_model_len,
                                    max_model_len=llm.max_model_len, where="messages")
        params = _params(req, default_max_tokens=max_tokens, logprobs=logprobs, vocab_size=vocab_size,
                         structured=structured)
        rid, n = f"chatcmpl-{uuid.uuid4().hex}", req.n
        streams = await start([ids], params, rid)
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model_name}

        if req.stream:
            tool_streams: dict[int, ToolStream] = {}

            def chunk(index, out, start_token, delta, done, final):
                if index is None:
                    return {**base, "choices": [], "usage": delta}
                if out is None:  # the opening chunk of each choice names the role
                    opening = {"index": index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}
                    return {**base, "choices": [opening]}
                logprobs = chat_logprobs(out, start_token, token_text)
                if parser is None:
                    return {**base, "choices": [{"index": index, "delta": {"content": delta} if delta else {},
                                                 "logprobs": logprobs,
                                                 "finish_reason": finish_reason(out) if done else None}]}
                stream = tool_streams.setdefault(index, ToolStream(parser, parallel=tools.parallel))
                content, calls = stream.feed(call_text(out.text, out.token_ids), done)
                deltas = ([{"content": content}] if content else []) + [{"tool_calls": [c]} for c in calls]
                if not deltas and (done or logprobs):
                    deltas = [{}]
                payloads = [{**base, "choices": [{"index": index, "delta": d, "logprobs": None,
                                                  "finish_reason": None}]} for d in deltas]
                if payloads:
                    payloads[0]["choices"][0]["logprobs"] = logprobs
                    if done:
                        payloads[-1]["choices"][0]["finish_reason"] = _tool_finish(out, bool(stream.calls))
                return payloads

            return StreamingResponse(stream_chunks(streams, chunk, n, first=n, usage=req.include_usage),
                                     media_type="text/event-stream",
                                     background=BackgroundTask(streams.aclose))
        (final,) = await unless_client_leaves(request, collect(streams, 1))
        choices = []
        for out in final.outputs:
            message, reason = {"role": "assistant", "content": out.text}, finish_reason(out)
            if parser is not None:
                parsed = limit_calls(parser.parse(call_text(out.text, out.token_ids)), tools.parallel)
                if parsed.tool_calls:
                    message = {"role": "assistant", "content": parsed.content,
                               "tool_calls": [c.to_openai() for c in parsed.tool_calls]}
                    reason = _tool_finish(out, True)
            choices.append({"index": out.index, "message": message, "finish_reason": reason,
                            "logprobs": chat_logprobs(out, 0, token_text)})
        return {**base, "object": "chat.completion", "choices": choices,
                "usage": Usage.of([final]).model_dump()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "segkv", "max_model_len": llm.max_model_len}]}

    @app.get("/health")
    async def health():
        stats = engine.stats()
        plan = llm.runner.last_plan
        forced = llm.runner.route
        route = plan.route.value if plan is not None else (forced.value if forced is not None else "auto")
        # the last step's precision mode inside the pieces, and steps per mode (the planner picks)
        precision = plan.precision.value if plan is not None else (settings.SETTINGS.attention_precision or "auto")
        prefix = stats.get("prefix", {})
        error = None if engine.error is None else str(engine.error)
        return {"status": "ok", "model": model_name, "engine_error": error,
                "decode_route": route, "lse_api": getattr(llm.runner.backend, "lse_api", LSE_API), "routes": stats.get("routes", {}),
                "attention_precision": precision, "precisions": stats.get("precisions", {}),
                "pages_in_use": stats["pages_in_use"], "bytes_in_use": stats["bytes_in_use"],
                "peak_bytes_in_use": stats["peak_bytes_in_use"], "num_pages": stats["num_pages"],
                # pages in use = running requests' + sessions' pins + cached prefixes (evictable)
                "pages_requests": stats.get("pages_requests", 0),
                "pages_cached_only": stats.get("pages_cached_only", 0),
                "cached_segments": prefix.get("num_nodes", 0),
                # host and disk copies of idle segments (None: no KV tiers)
                "kv_tiers": stats.get("kv_tiers"),
                "cached_tokens": prefix.get("num_cached_tokens", 0),
                "running": stats["running"], "waiting": stats["waiting"], "preemptions": stats["preemptions"],
                "speculative": None if llm.speculative_config is None else llm.speculative_config.describe(),
                # what the engine runs on: device, dtype, weight bytes, KV capacity, attention routes
                "engine": llm.summary()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _params(req, **settings) -> SamplingParams:
    try:
        return req.sampling_params(**settings)
    except FieldError as exc:
        raise APIError(400, safe_message(exc), "invalid_request_error", param=exc.param) from exc
    except (ValueError, TypeError) as exc:
        raise APIError(400, safe_message(exc), "invalid_request_error") from exc


def _structured(req):
    """The request's output constraint (response_format, guided_*), or None (400 naming the field)."""
    try:
        req.check_supported()
        return structured_output(req.model_extra or {})
    except FieldError as exc:
        raise APIError(400, safe_message(exc), "invalid_request_error", param=exc.param) from exc


def _chat_tools(req, parser_name: str | None):
    """(ToolSettings, the parser to read calls with or None, the output constraint or None) of a
    chat request (400 naming the field for bad tool input)."""
    try:
        req.check_supported()
        extra = req.model_extra or {}
        tools = tool_settings(extra)
        structured = structured_output(extra)
        parser = None
        if tools.tools and tools.choice != "none":
            if parser_name is None:
                raise FieldError("this model has no tool-call parser: start the server with "
                                 "--tool-call-parser, or send tool_choice \"none\"", "tools")
            parser = parser_for(parser_name)
            check_parameter_schemas(tools)
        if tools.forced:
            if structured is not None:
                raise FieldError("`response_format` cannot constrain a forced tool call (`tool_choice` "
                                 "\"required\" or a named function)", "response_format")
            try:
                structured = call_constraint(parser_name, tools)
            except ValueError as exc:
                raise FieldError(f"`tools`: {exc}", "tools") from exc
    except FieldError as exc:
        raise APIError(400, safe_message(exc), "invalid_request_error", param=exc.param) from exc
    return tools, parser, structured


def _tool_finish(out, called: bool) -> str | None:
    """"tool_calls" for an output that ended with calls, else its own finish reason."""
    reason = finish_reason(out)
    return "tool_calls" if called and reason == "stop" else reason


def _model_type(model_dir: Path) -> str:
    """The Hugging Face ``model_type`` in the model directory's config.json ("" if unreadable)."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""
