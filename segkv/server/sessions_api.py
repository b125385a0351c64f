"""The sessions API: create, add a turn (streaming or not), fork or restore at a turn, files, delete.

Errors are OpenAI error bodies; those about files name the file as the client did (``name``),
never by its path on the server.
"""

from __future__ import annotations

import re
import time
from typing import ClassVar
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from segkv.cache import OutOfPagesError
from segkv.engine import SessionStore
from segkv.server.context import fit_max_tokens
from segkv.server.disconnect import unless_client_leaves
from segkv.server.errors import APIError, echo, engine_error, safe_message
from segkv.server.protocol import COMPLETION_UNSUPPORTED, _Request, sse_event
from segkv.server.structured import structured_output

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
DEFAULT_TURN_TOKENS = 128  # a turn's reply when the client gives no limit (less if the context is short)


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    system: str | None = None


class TurnRequest(_Request):
    """One user turn; output constraints (``response_format``, ``guided_*``) and ``logit_bias``
    work as in chat, tools do not (a session's history has no tool messages)."""

    unsupported: ClassVar[dict] = COMPLETION_UNSUPPORTED
    model: str = ""
    content: str = Field(min_length=1)


class AtTurn(BaseModel):
    model_config = ConfigDict(strict=True)
    turn: int | None = Field(default=None, ge=0)


class FileName(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None) -> JSONResponse:
    return APIError(status, message, type_, param=param).response()


def _describe(store: SessionStore, session) -> dict:
    return {**session.describe(), "object": "session", "messages": session.messages}


def sessions_router(store: SessionStore, *, snapshot_dir: Path | None) -> APIRouter:
    """Routes under ``/v1/sessions``; files are saved and loaded by name inside ``snapshot_dir``."""
    router = APIRouter()
    llm = store.engine.llm

    def missing(session_id: str) -> JSONResponse:
        return _error(404, f"no session {echo(session_id)!r}", "not_found_error", "session_id")

    def find(session_id: str):
        try:
            return store.get(session_id), None
        except KeyError:
            return None, missing(session_id)

    def turn_prompt(session, req: TurnRequest) -> tuple[list[int], int]:
        """The turn's prompt ids and output limit, checked against the context like a chat request's."""
        messages = session.messages + [{"role": "user", "content": req.content}]
        ids = llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
        return ids, fit_max_tokens([len(ids)], req.requested_max_tokens, default=DEFAULT_TURN_TOKENS,
                                   max_model_len=llm.max_model_len, where="messages")

    @router.post("/v1/sessions")
    async def create(req: CreateSession):
        try:
            return _describe(store, store.create(req.system))
        except ValueError as exc:
            return _error(503, str(exc), "service_unavailable_error")

    @router.get("/v1/sessions")
    async def list_sessions():
        return {"object": "list", "data": [s.describe() for s in store.list()]}

    @router.get("/v1/sessions/{session_id}")
    async def get(session_id: str):
        session, err = find(session_id)
        return err or _describe(store, session)

    @router.delete("/v1/sessions/{session_id}")
    async def delete(session_id: str):
        try:
            store.delete(session_id)
        except KeyError:
            return missing(session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @router.post("/v1/sessions/{session_id}/turns")
    async def turn(session_id: str, req: TurnRequest, request: Request):
        session, err = find(session_id)
        if err:
            return err
        try:
            ids, max_tokens = turn_prompt(session, req)
            params = req.sampling_params(default_max_tokens=max_tokens, logprobs=None,
                                         vocab_size=llm.model.cfg.vocab_size,
                                         structured=structured_output(req.model_extra or {}))
            if params.n != 1:
                raise ValueError("a session turn has exactly one reply (n=1)")
            stream = store.say(session_id, req.content, params, prompt_ids=ids)
            first = await stream.__anext__()  # validation errors surface before any response
        except KeyError:  # deleted since it was found
            return missing(session_id)
        except Exception as exc:  # noqa: BLE001 - invalid input 400, full or stopping 503, else 500
            return engine_error(exc).response()
        base = {"id": f"turn-{session_id}-{len(session.turns) + 1}", "object": "session.turn",
                "created": int(time.time()), "session_id": session_id}

        async def updates():
            yield first
            async for update in stream:
                yield update

        if req.stream:
            async def sse():
                text = ""
                try:
                    async for update in updates():
                        out = update.output.outputs[0]
                        delta, text = out.text[len(text):], out.text
                        done = update.finished
                        body = {**base, "delta": delta, "finish_reason": out.finish_reason if done else None}
                        if done:
                            body["usage"] = _usage(update.output)
                        yield sse_event(body)
                except Exception as exc:  # noqa: BLE001 - headers are sent: report the error in the stream
                    yield sse_event(engine_error(exc).body)
                finally:
                    await stream.aclose()
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")
        async def last_update():
            last = first
            async for update in updates():
                last = update
            return last

        # a client that leaves cancels the turn's stream: nothing is recorded, the session can go on
        last = await unless_client_leaves(request, last_update())
        out = last.output.outputs[0]
        return {**base, "message": {"role": "assistant", "content": out.text},
                "finish_reason": out.finish_reason, "usage": _usage(last.output), "turns": len(session.turns)}

    @router.post("/v1/sessions/{session_id}/fork")
    async def fork(session_id: str, req: AtTurn):
        _, err = find(session_id)
        if err:
            return err
        try:
            return _describe(store, store.fork(session_id, req.turn))
        except ValueError as exc:
            return _error(400, str(exc), param="turn")

    @router.post("/v1/sessions/{session_id}/restore")
    async def restore(session_id: str, req: AtTurn):
        _, err = find(session_id)
        if err:
            return err
        if req.turn is None:
            return _error(400, "restore needs a turn", param="turn")
        try:
            return _describe(store, store.restore(session_id, req.turn))
        except ValueError as exc:
            return _error(400, str(exc), param="turn")

    def file_path(name: str) -> Path:
        if snapshot_dir is None:
            raise APIError(403, "saving sessions is disabled (the server has no snapshot directory)",
                           "invalid_request_error")
        if not _NAME.match(name):
            raise APIError(400, "name must be 1-128 letters, digits, '.', '_' or '-'", "invalid_request_error",
                           param="name")
        return snapshot_dir / f"{name}.segkv"

    def file_error(exc: Exception, path: Path, name: str, doing: str) -> JSONResponse:
        """The answer to an error reading or writing ``path``, which names ``name``, not the path."""
        text = str(exc).replace(repr(str(path)), repr(name)).replace(str(path), repr(name))
        message = safe_message(text, extra_dirs=(str(snapshot_dir),))
        if isinstance(exc, FileNotFoundError) and doing == "load":
            return _error(404, f"no saved session named {name!r}", "not_found_error", "name")
        if isinstance(exc, OutOfPagesError):
            return _error(503, f"cannot load saved session {name!r} now: {message}", "service_unavailable_error")
        if isinstance(exc, ValueError):
            return _error(400, message, param="name")
        # an OSError writing or reading the snapshot directory is the server's fault, not the client's
        return _error(500, f"cannot {doing} the session file {name!r}: the server's snapshot directory is "
                           "missing or not usable", "server_error")

    @router.post("/v1/sessions/{session_id}/save")
    async def save(session_id: str, req: FileName):
        _, err = find(session_id)
        if err:
            return err
        try:
            path = file_path(req.name)
            store.save(session_id, path)
        except APIError as exc:
            return exc.response()
        except (ValueError, OSError) as exc:
            return file_error(exc, path, req.name, "save")
        return {"id": session_id, "object": "session.saved", "name": req.name}

    @router.post("/v1/sessions/load")
    async def load(req: FileName):
        try:
            path = file_path(req.name)
            session = store.load(path)
        except APIError as exc:
            return exc.response()
        except (ValueError, OSError, OutOfPagesError) as exc:
            return file_error(exc, path, req.name, "load")
        return _describe(store, session)

    return router


def _usage(output) -> dict:
    prompt, completion = len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}
