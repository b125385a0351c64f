"""The README's Python examples run as written: the library ones in one namespace, the client ones
(``OpenAI(base_url="http://127.0.0.1:8000/v1", ...)``) against a live server of the default model."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SERVER_URL = "http://127.0.0.1:8000"


def _blocks() -> tuple[list[str], list[str]]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    client = [b for b in blocks if SERVER_URL in b]
    return [b for b in blocks if b not in client], client


def test_readme_examples_run():
    library, _ = _blocks()
    assert len(library) >= 2
    namespace: dict = {}
    exec(compile("\n".join(library), str(README), "exec"), namespace)  # noqa: S102
    assert namespace["pool"].pages_in_use == 0
    assert namespace["plan"].route.value == "cascade"  # both chains share the first turn


def test_readme_client_examples_run_against_a_server():
    from server_helpers import live_server
    from segkv.engine import LLM, AsyncEngine
    from segkv.server.app import create_app

    _, client = _blocks()
    assert client, "the README shows the server's API with the openai client"
    engine = AsyncEngine(LLM("default", page_size=16, num_pages=400))
    try:
        with live_server(create_app(engine, model_name="default")) as base:
            for block in client:
                namespace: dict = {}
                exec(compile(block.replace(SERVER_URL, base), str(README), "exec"), namespace)  # noqa: S102
                assert namespace["call"].function.name == "get_weather"
                assert namespace["follow_up"].choices[0].message.role == "assistant"
    finally:
        engine.shutdown()
