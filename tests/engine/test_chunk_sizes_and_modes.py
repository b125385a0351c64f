"""In float32, greedy tokens do not depend on how a prompt is chunked, which route attends it or
which precision mode runs inside the pieces: the Triton kernels (the interpreter on the CPU) give
the reference backend's tokens for every combination, a follow-up turn over a segmented history
and a fork included."""

from __future__ import annotations

import pytest

import segkv.settings as settings
from engine_helpers import conversation_tokens
from gpu_helpers import DEVICE
from model_helpers import build_model_dir
from segkv.engine import LLM
from segkv.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 9, 13, 40, 77, 21] * 7, [3, 1, 4, 1, 5, 9, 2, 6] * 3]
# (prefill chunk, route, precision): each chunk size and mode at least once, the routes that cut
# the history (the default, single, runs everywhere else)
CASES = [(5, "segments", "fast"), (17, "split", "exact"), (64, "cascade", "fast")]


def tokens(directory, *, backend: str, chunk: int, route: str | None) -> tuple[list[list[int]], LLM]:
    llm = LLM(directory, device=DEVICE, dtype="float32", backend=backend, page_size=16, num_pages=128,
              prefill_chunk=chunk, route=route)
    return conversation_tokens(llm, PROMPTS, PARAMS, ("hello there, a first turn", "and a follow-up",
                                                      "a fork's own turn")), llm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    build_model_dir(directory, "qwen3")
    return directory


@pytest.fixture(scope="module")
def reference(model_dir):
    return tokens(model_dir, backend="torch", chunk=64, route=None)[0]


@pytest.mark.parametrize("chunk,route,precision", CASES)
def test_greedy_tokens_do_not_depend_on_chunks_routes_or_modes(chunk, route, precision, model_dir, reference,
                                                                 monkeypatch):
    monkeypatch.setenv("SEGKV_ATTENTION_PRECISION", precision)
    monkeypatch.setattr(settings, "SETTINGS", settings.load_settings())
    llm_tokens, llm = tokens(model_dir, backend="triton", chunk=chunk, route=route)
    assert set(llm.runner.precision_counts) == {precision}  # every step ran the forced mode
    assert llm_tokens == reference
    assert all(len(t) == PARAMS.max_tokens for t in llm_tokens)
