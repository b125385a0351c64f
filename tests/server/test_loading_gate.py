"""While the model loads the server answers 503 with a reason; then it serves the real app."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from segkv.server.loading import LoadingGate


@pytest.mark.anyio
async def test_503_while_loading_then_the_app():
    gate = LoadingGate()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://t") as http:
        response = await http.get("/health")
        assert response.status_code == 503 and response.json()["error"]["code"] == "loading"
        gate.failed("no config.json in /x")
        response = await http.post("/v1/completions", json={})
        assert response.status_code == 503 and "no config.json" in response.json()["error"]["message"]
        app = FastAPI()
        app.get("/health")(lambda: {"status": "ok"})
        gate.ready(app)
        assert (await http.get("/health")).json() == {"status": "ok"}



@pytest.mark.anyio
async def test_503_for_new_requests_once_draining():
    gate = LoadingGate()
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    gate.ready(app)
    gate.drain()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://t") as http:
        for response in (await http.get("/health"), await http.post("/v1/chat/completions", json={})):
            assert response.status_code == 503
            assert response.json()["error"] == {"message": "the server is shutting down",
                                                 "type": "service_unavailable_error", "param": None,
                                                 "code": "shutting_down"}
            assert response.headers["connection"] == "close" and "retry-after" not in response.headers

@pytest.fixture
def anyio_backend():
    return "asyncio"
