"""The ``segkv`` command: generate, and an interactive chat with fork, undo, save, load, stats."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

import pytest

from model_helpers import build_model_dir
from segkv.cli import build_parser, run_chat


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli-model")
    build_model_dir(directory, "llama")
    return directory


def test_generate_prints_the_greedy_completion(model_dir):
    from segkv.engine import LLM
    from segkv.sampling_params import SamplingParams

    expected = LLM(model_dir).generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=6))[0]
    done = subprocess.run(
        [sys.executable, "-m", "segkv.cli", "generate", "--model", str(model_dir), "--prompt", "def f(x):",
         "--max-tokens", "6"], capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == expected.outputs[0].text.rstrip("\n")
    assert "loading weights" in done.stderr  # progress bar
    assert "leaked" not in done.stderr  # nothing left for the bindings to report at exit


def test_generate_reports_a_bad_page_size_clearly(model_dir):
    done = subprocess.run([sys.executable, "-m", "segkv.cli", "generate", "--model", str(model_dir), "--page-size",
                           "0", "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "page_size must be >= 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr


def test_generate_reports_a_missing_model_clearly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "segkv.cli", "generate", "--model", str(tmp_path / "none"),
                           "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "tokenizer.json" in done.stderr


def test_chat_commands(model_dir, tmp_path):
    args = build_parser().parse_args(["chat", "--model", str(model_dir), "--max-tokens", "5", "--page-size", "8"])
    out: list[str] = []
    path = tmp_path / "c.segkv"
    lines = ["hello", "/stats", "/fork", "a branch", "/branches", "/undo", "/undo", "/switch 0",
             "second", f"/save {path}", f"/load {path}", "/stats", "/switch 9", "/bogus", "/quit", "never"]
    assert run_chat(args, lines=lines, write=out.append) == 0
    text = "\n".join(out)
    assert "pages in use" in text and "bytes added" in text and "last route single" in text
    assert "now on branch 1 (forked; nothing copied)" in text
    assert "* 1: 4 messages" in text  # the branch has two turns' messages
    assert "undone; 2 messages" in text and "nothing to undo on this branch" in text
    assert f"saved to {path}" in text and "loaded into branch 2" in text
    assert "no branch '9'" in text and "unknown command /bogus" in text
    assert path.is_file()


def test_cuda_graphs_are_on_where_available_by_default():
    """Every command asks for CUDA graphs where they work ("auto"): a GPU decodes through them,
    the CPU runs eagerly (the generate test above passes through that default)."""
    from segkv.cli import CUDA_GRAPHS, build_parser

    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["chat"], ["serve"]):
        args = parser.parse_args(command)
        assert args.cuda_graphs == "auto" and CUDA_GRAPHS[args.cuda_graphs] == "auto"
    assert CUDA_GRAPHS[parser.parse_args(["serve", "--cuda-graphs", "off"]).cuda_graphs] is False


def test_serve_exits_within_its_shutdown_timeout_with_a_request_in_flight(model_dir):
    """SIGTERM with a long request in flight: the server gives it ``--shutdown-timeout`` seconds,
    then cancels it and exits (it used to wait for every request, however long)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "segkv.cli", "serve", "--model", str(model_dir), "--port",
                               str(port), "--shutdown-timeout", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        long_request = {"model": name, "prompt": "x", "n": 64, "max_tokens": 400, "ignore_eos": True}
        answers = []
        client = threading.Thread(target=lambda: answers.append(
            _status_or_error(lambda: httpx.post(f"{base}/v1/completions", json=long_request, timeout=60))))
        client.start()
        while httpx.get(f"{base}/health").json()["running"] == 0:  # the request is being served
            time.sleep(0.05)
        stopped = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        assert time.monotonic() - stopped < 8, "shutdown waited for the request in flight"
        client.join(timeout=30)
        assert answers and answers[0] != 200  # cancelled, not answered
    finally:
        if server.poll() is None:
            server.kill()
    assert "timeout graceful shutdown exceeded" in server.stdout.read()


def _status_or_error(call):
    try:
        return call().status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__
