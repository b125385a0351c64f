"""The ``segkv`` command: generate, and an interactive chat with fork, undo, save, load, stats."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

import pytest

from model_helpers import build_model_dir
from server_helpers import free_port, wait_healthy
from settings_helpers import setenv
from segkv.cli import ChatSession, build_parser, run_chat


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
    # the reason names the path given (its wording belongs to the loader)
    assert done.returncode == 2 and done.stderr.startswith("segkv: error: ")
    assert str(tmp_path / "none") in done.stderr and "Traceback" not in done.stderr


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


def test_stats_follow_undo_and_name_compaction_copies(model_dir):
    """``/stats`` after ``/undo`` reports the turn that is last again (or none); the pool's copies
    are named compaction copies: a fork copies nothing, the next turn's compaction does."""
    from segkv.engine import LLM
    from segkv.sampling_params import SamplingParams

    llm = LLM(model_dir, page_size=8)
    out: list[str] = []
    session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=5), None, out.append)

    def stats() -> list[str]:
        out.clear()
        session.handle("/stats")
        return list(out)

    def compaction_line(copied: int) -> str:
        return f"bytes copied by compaction {copied:,} (forks, undo and snapshots copy nothing)"

    assert stats()[1] == "last turn: none on this branch"
    session.handle("hello")
    first = stats()
    assert first[1].startswith("last turn: 48 new prompt tokens (0 cached), 5 generated")
    assert first[0].endswith(compaction_line(0))
    session.handle("/fork")
    assert out[-1] == "now on branch 1 (forked; nothing copied)"
    assert stats() == first  # the fork copied and allocated nothing, and its last turn is the same
    session.handle("on the branch")
    copied = llm.cache.pool.bytes_copied
    assert copied > 0  # sealing this turn merged the chain's trailing segments
    second = stats()
    assert second[0].endswith(compaction_line(copied))
    assert f"{llm.cache.pool.bytes_copied:,} bytes copied by compaction" in second[1]
    assert "(48 cached)" in second[1]
    session.handle("/undo")
    assert stats()[1] == first[1]  # the turn last again, not the one undone
    session.handle("/switch 0")
    session.handle("/undo")
    assert stats()[1] == "last turn: none on this branch"


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
    then ends it with a 503 and exits 0 (it used to wait for every request, however long). The
    key from ``SEGKV_API_KEY`` guards the API meanwhile."""
    port = free_port()
    env = {**os.environ, "SEGKV_API_KEY": "sesame"}
    server = subprocess.Popen([sys.executable, "-m", "segkv.cli", "serve", "--model", str(model_dir), "--port",
                               str(port), "--shutdown-timeout", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    key = {"Authorization": "Bearer sesame"}
    try:
        wait_healthy(server, base)
        assert httpx.get(f"{base}/v1/models").status_code == 401  # no key
        name = httpx.get(f"{base}/v1/models", headers=key).json()["data"][0]["id"]
        long_request = {"model": name, "prompt": "x", "n": 64, "max_tokens": 400, "ignore_eos": True}
        answers = []
        client = threading.Thread(target=lambda: answers.append(_status_and_body(
            lambda: httpx.post(f"{base}/v1/completions", json=long_request, headers=key, timeout=60))))
        client.start()
        # the request is being served (a loaded machine may take seconds to answer while it starts)
        while httpx.get(f"{base}/health", timeout=30).json()["running"] == 0:
            time.sleep(0.05)
        stopped = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        assert time.monotonic() - stopped < 8, "shutdown waited for the request in flight"
        client.join(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
    status, body = answers[0]
    assert status == 503 and body["error"]["message"] == "the server is shutting down"  # ended, not answered
    assert "Ended 1 request(s) still running after 1 s" in server.stdout.read()


def _status_and_body(call):
    try:
        response = call()
        return response.status_code, response.json()
    except httpx.HTTPError as exc:
        return type(exc).__name__, None


def test_serve_load_warms_up_before_the_app_is_ready(model_dir, monkeypatch, capsys):
    """The load thread's work: the model is warmed up and its time and
    memory printed before the gate lets requests in; a server stopped meanwhile gets no engine."""
    from types import SimpleNamespace

    from segkv.cli import _load_and_serve
    from segkv.engine import LLM
    from segkv.server.loading import LoadingGate

    calls = []

    def warm_up(self, *, max_batch=None, max_num_batched_tokens=None, progress=False):
        calls.append((max_batch, max_num_batched_tokens, progress, gate.app))
        return {"seconds": 1.5, "bytes": 3 << 20}

    monkeypatch.setattr(LLM, "warm_up", warm_up)
    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--port", "9",
                                      "--max-num-seqs", "8", "--max-num-batched-tokens", "512"])
    gate, engines = LoadingGate(), []
    _load_and_serve(args, gate, engines, SimpleNamespace(should_exit=False), None, None)
    try:
        # the scheduler's shapes, with a progress bar, before the app was installed
        assert calls == [(8, 512, True, None)]
        assert gate.app is not None and len(engines) == 1
        out = capsys.readouterr().out
        assert "segkv: warmed up in 1.5 s, using 3.0 MiB\n" in out
        assert f"segkv: serving {model_dir.name} on http://127.0.0.1:9" in out
    finally:
        for engine in engines:
            engine.shutdown()
    gate, engines = LoadingGate(), []
    _load_and_serve(args, gate, engines, SimpleNamespace(should_exit=True), None, None)
    assert gate.app is None and engines == []


def test_help_has_no_markup():
    """Every help text reads as plain text: no reST double backticks from docstrings."""
    from segkv.bench.serve import build_parser as bench_serve_parser

    parser = build_parser()
    texts = [parser.format_help(), bench_serve_parser().format_help()]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == {"generate", "chat", "bench", "serve"}
    texts += [sub.format_help() for sub in subparsers.choices.values()]
    for text in texts:
        assert "``" not in text, text
    assert "--api-key" in subparsers.choices["serve"].format_help()


def test_serve_options_for_the_app(monkeypatch):
    """``--api-key`` falls back on ``SEGKV_API_KEY``; ``--max-request-bytes`` on the app's default."""
    from segkv.cli import _app_options, resolve_api_key
    from segkv.server import app as app_module

    setenv(monkeypatch, "SEGKV_API_KEY", None)
    assert resolve_api_key(None) is None
    setenv(monkeypatch, "SEGKV_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("from-flag") == "from-flag"
    setenv(monkeypatch, "SEGKV_API_KEY", "")
    assert resolve_api_key(None) is None  # an empty variable is no key
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        resolve_api_key("")
    args = build_parser().parse_args(["serve", "--max-request-bytes", "1024"])
    assert args.max_request_bytes == 1024 and args.api_key is None
    assert _app_options(app_module, api_key="k", max_request_bytes=1024) == {"api_key": "k",
                                                                             "max_request_bytes": 1024}
    assert _app_options(app_module, api_key=None, max_request_bytes=None) == {
        "api_key": None, "max_request_bytes": 16 * 1024 * 1024}


def test_serve_rejects_bad_numbers():
    for flags in (["--max-request-bytes", "0"], ["--shutdown-timeout", "-1"], ["--shutdown-timeout", "nan"]):
        done = subprocess.run([sys.executable, "-m", "segkv.cli", "serve", *flags], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and "must be >=" in done.stderr, done.stderr


def test_speculative_config_flag_on_every_model_command():
    """``--speculative-config`` (vLLM's JSON) on generate, chat and serve: parsed by argparse into a
    SpeculativeConfig, off (None) when absent or ``{"method": "none"}``."""
    from segkv.spec.config import SpeculativeConfig

    parser = build_parser()
    value = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    for command in (["generate", "--prompt", "x"], ["chat"], ["serve"]):
        assert parser.parse_args(command).speculative_config is None
        off = parser.parse_args([*command, "--speculative-config", '{"method": "none"}'])
        assert off.speculative_config is None
        config = parser.parse_args([*command, "--speculative-config", value]).speculative_config
        assert config == SpeculativeConfig("ngram", 3, prompt_lookup_min=4, prompt_lookup_max=4)


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["chat"], ["serve"]])
def test_a_bad_speculative_config_is_a_clear_error(command):
    """Bad JSON or a bad key: exit code 2 with the reason, before any model loads."""
    for value, reason in [("{", "not valid JSON"),
                          ('{"method": "ngram", "k": 3}', "unknown key(s) 'k'"),
                          ('{"method": "ngram", "num_speculative_tokens": 99}', "between 1 and 16, got 99")]:
        done = subprocess.run([sys.executable, "-m", "segkv.cli", *command, "--model", "/nonexistent",
                               "--speculative-config", value], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "argument --speculative-config: speculative config: " in done.stderr and reason in done.stderr
        assert "Traceback" not in done.stderr


def test_llm_takes_a_speculative_config(monkeypatch):
    from segkv.engine import LLM
    from segkv.engine import llm as llm_module

    llm = LLM("default", speculative_config='{"method":"ngram","num_speculative_tokens":3}')
    assert llm.speculative_config.num_speculative_tokens == 3
    assert llm.speculative_config.method == "ngram"
    assert LLM("default").speculative_config is None

    def no_loading(*args, **kwargs):
        raise AssertionError("the model loaded before the speculative config was checked")

    monkeypatch.setattr(llm_module, "load_model", no_loading)
    monkeypatch.setattr(llm_module, "check_model_dir", no_loading)
    with pytest.raises(ValueError, match="num_speculative_tokens is required for method 'ngram'"):
        LLM("default", speculative_config={"method": "ngram"})
