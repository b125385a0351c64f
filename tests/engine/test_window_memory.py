"""A model whose every layer attends a sliding window: the engine gives back the pages behind
the window while a request runs, so a long conversation holds about one window of rows per
chain; tokens stay transformers' and a follow-up turn reuses what the prefix index still holds
(or recomputes when its continuation would need released rows)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import run_all
from model_helpers import build_model_dir
from parity_helpers import hf_greedy
from segkv.engine import LLM
from segkv.sampling_params import SamplingParams

WINDOW, PAGE, CHUNK = 16, 4, 32
PROMPT, NEW = 150, 40


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral_release")
    hf = build_model_dir(directory, "mistral", sliding_window=WINDOW)
    hf.generation_config.eos_token_id = None
    return directory, hf


def _llm(directory) -> LLM:
    """Steps of at most one chunk of prompt rows (the scheduler's budget; 2048 by default)."""
    return LLM(directory, dtype="float32", device="cpu", backend="torch", page_size=PAGE, num_pages=256,
               prefill_chunk=CHUNK, max_num_batched_tokens=CHUNK)


def _run(llm: LLM, prompt: list[int], release: bool) -> tuple[list[int], int, int, int]:
    """(tokens, most live rows a running chain held after a step, peak pages in use, cached tokens)
    of one greedy request through the engine core (its rows stay in the prefix index)."""
    core = llm.core
    if not release:
        core.window = None  # the same engine keeping every row: the baseline
    held: list[int] = [0]
    core.step_listeners.append(lambda _: held.extend(s.chain.num_rows - s.chain.num_released_rows
                                                     for s in core.running))
    core.pool.reset_peak()
    request = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    run_all(core)
    core.step_listeners.pop()
    return request.output().outputs[0].token_ids, max(held), core.pool.peak_pages_in_use, \
        request.output().num_cached_tokens


def test_a_long_request_holds_one_window_and_keeps_transformers_tokens(windowed, gen):
    directory, hf = windowed
    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT,), generator=gen).tolist()
    expected = hf_greedy(hf, prompt, NEW)
    llm = _llm(directory)
    assert llm.core.window == WINDOW
    tokens, held, peak, _ = _run(llm, prompt, release=True)
    assert tokens == expected
    # after each step a chain holds its last window and the rest of the page the window starts in
    assert WINDOW <= held <= WINDOW + PAGE - 1
    # within a step: that, plus one prompt chunk (pages of the finished request stay cached)
    assert peak <= (WINDOW + PAGE + CHUNK) // PAGE + 1

    baseline = _llm(directory)
    tokens, held, peak_all, _ = _run(baseline, prompt, release=False)
    assert tokens == expected and held >= PROMPT + NEW - 2  # every row but the last token's
    assert peak_all >= (PROMPT + NEW - 1) // PAGE > 3 * peak


def test_follow_up_turns_reuse_the_live_window_or_recompute(windowed, gen):
    directory, hf = windowed
    llm = _llm(directory)
    first = torch.randint(0, hf.config.vocab_size, (PROMPT,), generator=gen).tolist()
    reply, _, _, _ = _run(llm, first, release=True)
    # the next turn continues the whole history: the index holds its last window, which is all
    # the continuation attends
    follow = first + reply + torch.randint(0, hf.config.vocab_size, (9,), generator=gen).tolist()
    tokens, held, _, cached = _run(llm, follow, release=True)
    assert cached == len(first) + len(reply) - 1  # the last cached row's token is recomputed for its logits
    assert tokens == hf_greedy(hf, follow, NEW)
    # a turn that departs from the history earlier would attend rows that were released: the
    # match is refused and the prompt recomputed
    edit = first[:100] + torch.randint(0, hf.config.vocab_size, (5,), generator=gen).tolist()
    tokens, _, _, cached = _run(llm, edit, release=True)
    assert cached == 0 and tokens == hf_greedy(hf, edit, NEW)
