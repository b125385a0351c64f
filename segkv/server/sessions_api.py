"""The sessions API: create, add a turn (streaming or not), fork or restore at a turn, files, delete."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from segkv.engine import QueueFullError, SessionStore
from segkv.server.disconnect import unless_client_leaves
from segkv.server.protocol import _Request, error_body

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="ignore")
    system: str | None = None


class TurnRequest(_Request):
    model: str = ""
    content: str = Field(min_length=1)


class AtTurn(BaseModel):
    turn: int | None = Field(default=None, ge=0)


class FileName(BaseModel):
    name: str


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param=param), status_code=status)


def _describe(store: SessionStore, session) -> dict:
    return {**session.describe(), "object": "session", "messages": session.messages}


def sessions_router(store: SessionStore, *, snapshot_dir: Path | None) -> APIRouter:
    """Routes under ``/v1/sessions``; files are saved and loaded by name inside ``snapshot_dir``."""
    router = APIRouter()

    def find(session_id: str):
        try:
            return store.get(session_id), None
        except KeyError:
            return None, _error(404, f"no session {session_id!r}", "not_found_error", "session_id")

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
            return _error(404, f"no session {session_id!r}", "not_found_error", "session_id")
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @router.post("/v1/sessions/{session_id}/turns")
    async def turn(session_id: str, req: TurnRequest, request: Request):
        session, err = find(session_id)
        if err:
            return err
        try:
            params = req.sampling_params(default_max_tokens=128, logprobs=None)
            if params.n != 1:
                raise ValueError("a session turn has exactly one reply (n=1)")
            stream = store.say(session_id, req.content, params)
            first = await stream.__anext__()  # validation errors surface before any response
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        except QueueFullError as exc:
            return _error(503, str(exc), "service_unavailable_error")
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
                        yield f"data: {json.dumps(body)}\n\n"
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
            raise PermissionError("saving sessions is disabled (the server has no snapshot directory)")
        if not _NAME.match(name):
            raise ValueError("name must be 1-128 letters, digits, '.', '_' or '-'")
        return snapshot_dir / f"{name}.segkv"

    @router.post("/v1/sessions/{session_id}/save")
    async def save(session_id: str, req: FileName):
        _, err = find(session_id)
        if err:
            return err
        try:
            store.save(session_id, file_path(req.name))
        except PermissionError as exc:
            return _error(403, str(exc))
        except ValueError as exc:
            return _error(400, str(exc), param="name")
        return {"id": session_id, "object": "session.saved", "name": req.name}

    @router.post("/v1/sessions/load")
    async def load(req: FileName):
        try:
            return _describe(store, store.load(file_path(req.name)))
        except PermissionError as exc:
            return _error(403, str(exc))
        except FileNotFoundError:
            return _error(404, f"no saved session named {req.name!r}", "not_found_error", "name")
        except ValueError as exc:
            return _error(400, str(exc), param="name")

    return router


def _usage(output) -> dict:
    prompt, completion = len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}
