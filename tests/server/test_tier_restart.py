"""A server killed (SIGKILL) while its disk tier writes a segment file, then restarted on the same
directory, which also holds sessions saved by name: the partial file and the earlier run's
segment files are removed at start and never read, and the saved session loads and answers as
before the kill."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch

from model_helpers import build_model_dir
from server_helpers import free_port, spawned_server
from segkv.cache.files import is_temporary
from segkv.models.loader import load_model

PAGE, PAGES = 16, 24
# segkv's CLI with the disk tier's writes held for a while once the file is whole under its
# temporary name (before the rename): the test can kill the server in the middle of one
SLOW_WRITES = """
import sys, time
import segkv.cache.files as files
write = files.save_file
def held_write(tensors, path, metadata=None):
    write(tensors, path, metadata=metadata)
    if "segment-" in str(path):
        time.sleep(0.5)
files.save_file = held_write
from segkv.cli import main
sys.exit(main(sys.argv[1:]))
"""
WORDS = "the of and to in is was for on that with as by at from his her an were are which".split()
TURN = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    build_model_dir(directory, "qwen3")
    return directory


@contextmanager
def serve(model_dir, tier_dir, *, slow_writes: bool):
    """``segkv serve`` of ``model_dir`` over a pool of ``PAGES`` pages, with a disk tier (no host
    tier: every spilled segment is written to a file) and saved sessions in ``tier_dir``."""
    row_bytes = load_model(model_dir).kv_layout(torch.float32).row_bytes
    port = free_port()
    flags = ["serve", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--port", str(port),
             "--max-model-len", "256", "--page-size", str(PAGE), "--kv-cache-memory", repr(PAGES * PAGE * row_bytes / 2**30),
             "--kv-offload-dir", str(tier_dir), "--kv-offload-disk-gib", "1", "--snapshot-dir", str(tier_dir)]
    command = [sys.executable, "-c", SLOW_WRITES, *flags] if slow_writes else [sys.executable, "-m", "segkv.cli",
                                                                               *flags]
    with spawned_server(command, port) as (server, base):
        yield server, base


def load_and_turn(base: str) -> tuple[list, str]:
    """Load the session saved as ``kept``: its messages, and its reply to one more turn."""
    loaded = httpx.post(f"{base}/v1/sessions/load", json={"name": "kept"}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    session = loaded.json()
    reply = httpx.post(f"{base}/v1/sessions/{session['id']}/turns", json={"content": "and then", **TURN},
                       timeout=60).json()
    return session["messages"], reply["message"]["content"]


def keep_busy(base: str, stop: threading.Event) -> None:
    """Completions of distinct texts until ``stop``: their cached rows overflow the pool."""
    rng = random.Random(0)
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    while not stop.is_set():
        text = " ".join(rng.choice(WORDS) for _ in range(60))
        try:
            reply = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": text, **TURN}, timeout=30)
        except httpx.TransportError:  # the server was killed
            return
        assert reply.status_code == 200, reply.text


def test_a_server_killed_mid_write_restarts_clean_and_its_saved_sessions_load(model_dir, tmp_path):
    tier_dir = tmp_path / "tiers"
    with serve(model_dir, tier_dir, slow_writes=True) as (server, base):
        session = httpx.post(f"{base}/v1/sessions", json={"system": "be brief"}, timeout=60).json()
        said = httpx.post(f"{base}/v1/sessions/{session['id']}/turns", json={"content": "hello there", **TURN},
                          timeout=60)
        assert said.status_code == 200, said.text
        saved = httpx.post(f"{base}/v1/sessions/{session['id']}/save", json={"name": "kept"}, timeout=60)
        assert saved.status_code == 200, saved.text
        messages, reply = load_and_turn(base)
        stop = threading.Event()
        busy = threading.Thread(target=keep_busy, args=(base, stop), daemon=True)
        busy.start()
        deadline = time.monotonic() + 120
        while not any(is_temporary(p.name) for p in tier_dir.iterdir()):  # caught writing a segment file
            assert time.monotonic() < deadline and server.poll() is None, "no segment file was written"
            time.sleep(0.01)
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        stop.set()
        busy.join(timeout=60)
    left = {p.name for p in tier_dir.iterdir()}
    partial = {name for name in left if is_temporary(name)}
    assert partial and "kept.segkv" in left
    # a segment file under its temporary name, or safetensors' own temporary file inside it
    assert not any("kept" in name for name in partial)
    with serve(model_dir, tier_dir, slow_writes=False) as (_, base):
        tiers = httpx.get(f"{base}/health", timeout=10).json()["kv_tiers"]
        assert tiers["files_removed_at_start"] == len(left) - 1, (tiers, left)
        assert {p.name for p in tier_dir.iterdir()} == {"kept.segkv"}  # nothing of the killed run is read
        assert load_and_turn(base) == (messages, reply)
