"""Run-ahead decode: the next step is launched before the host reads the sampled tokens.

Outputs, chains (their token ids included) and page counts must equal those of the plain loop:
sequences that stop mid-batch, seeded sampling, ``n > 1`` siblings, requests admitted while a
step runs ahead, preemption, abort, and follow-up turns of a conversation.
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import build_model_dir
from segkv.engine import LLM
from segkv.engine.core import EngineCore
from segkv.runner.model_runner import PLACEHOLDER_ID, StepInput
from segkv.sampling_params import SamplingParams
from segkv.scheduler import SchedulerConfig

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ahead-model")
    build_model_dir(directory, "qwen3")
    return directory


def _llm(path, run_ahead: bool, **kw) -> LLM:
    kw = {"page_size": 8, "num_pages": 400, **kw}
    return LLM(path, device=DEVICE, dtype="float32", run_ahead=run_ahead, **kw)


def _outputs(results) -> list:
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in r.outputs] for r in results]


PROMPTS = [[5, 9, 13, 40, 77] * 3, [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 1], [21, 22, 23, 24, 25, 26, 27]]


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_generate_gives_the_plain_loops_outputs(model_dir, graphs):
    """Greedy with a stop token that ends some sequences mid-batch, seeded sampling, two samples
    per prompt: the same tokens and finish reasons, rows computed ahead were used and some
    trimmed, and no page is left behind."""
    kw = {"backend": "triton", "cuda_graphs": True if GPU else "emulate"} if graphs else {}
    plain, ahead = _llm(model_dir, False, **kw), _llm(model_dir, True, **kw)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = plain.generate(PROMPTS, greedy)
    stop = first[0].outputs[0].token_ids[3]  # ends prompt 0 early, maybe others elsewhere
    cases = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop]),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=9, seed=7, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=6, n=2, seed=3, ignore_eos=True),
    ]
    for params in cases:
        want = _outputs(plain.generate(PROMPTS, params))
        assert _outputs(ahead.generate(PROMPTS, params)) == want
    assert want[0][0] != want[0][1]  # the siblings really sampled apart
    stopped = _outputs(ahead.generate(PROMPTS[:1], cases[0]))[0][0]
    assert stopped[1:] == ("stop", stop) and len(stopped[0]) == first[0].outputs[0].token_ids.index(stop) + 1
    gen = ahead.generator
    assert gen.steps_taken_ahead > 0 and gen.rows_cancelled > 0
    assert plain.generator.steps_taken_ahead == 0
    assert ahead.cache.pool.pages_in_use == plain.cache.pool.pages_in_use == (1 if graphs else 0)  # the graphs hold a scratch page


def test_engine_admits_requests_while_a_step_runs_ahead(model_dir):
    """Requests added between steps join the batch: the sequences computed ahead take their
    logits from that step, the new ones run their own forward; outputs equal each alone."""
    plain, llm = _llm(model_dir, False), _llm(model_dir, True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = [plain.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    core = EngineCore(llm, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    requests = [core.add_request(PROMPTS[0], params)]
    for step in range(40):
        if step in (3, 5, 6):  # arrivals while the others decode (after a run-ahead launch)
            requests.append(core.add_request(PROMPTS[len(requests)], params))
        if not core.has_unfinished():
            break
        core.step()
    assert [r.output().outputs[0].token_ids for r in requests] == alone
    assert llm.generator.steps_taken_ahead > 0
    core.prefix.clear()
    assert llm.cache.pool.pages_in_use == 0


def test_preemption_and_abort_with_rows_computed_ahead(model_dir):
    """A small cache preempts sequences that hold a row computed ahead, and an abort drops one:
    the others' outputs equal each alone and every page comes back."""
    plain = _llm(model_dir, False, page_size=4, num_pages=800)
    prompts = [p * 2 for p in PROMPTS] * 2
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [plain.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    small = _llm(model_dir, True, page_size=4, num_pages=44)
    core = EngineCore(small, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    requests = [core.add_request(p, params) for p in prompts]
    for _ in range(6):
        core.step()
    assert core.abort(requests[1].request_id)
    while core.has_unfinished():
        core.step()
    assert core.num_preemptions > 0 and small.generator.steps_taken_ahead > 0
    kept = [i for i in range(len(prompts)) if i != 1]
    assert [requests[i].output().outputs[0].token_ids for i in kept] == [alone[i] for i in kept]
    core.prefix.clear()
    assert small.cache.pool.pages_in_use == 0


def test_conversation_chains_hold_the_real_token_ids(model_dir):
    """After each turn the chain holds the prompt and every generated token but the last (no
    placeholder left), so the next turn reuses the whole history from the chain."""
    plain, llm = _llm(model_dir, False).conversation(), _llm(model_dir, True).conversation()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for text in ("hello there", "and a second turn"):
        want = plain.say(text, params)
        got = llm.say(text, params)
        assert got.output.token_ids == want.output.token_ids
        assert llm.chain.token_ids() == plain.chain.token_ids()
        assert PLACEHOLDER_ID not in llm.chain.token_ids()
    assert llm.last_stats.cached_tokens == plain.last_stats.cached_tokens > 0
    assert llm.llm.generator.steps_taken_ahead > 0


def test_device_ids_and_token_fill_check_their_inputs(model_dir):
    llm = _llm(model_dir, False)
    chain = llm.cache.new_chain()
    runner = llm.runner
    runner.forward([StepInput(chain, [5, 6, 7])])
    ids = torch.tensor([9], device=DEVICE)
    with pytest.raises(ValueError, match="device_ids"):
        runner.forward([StepInput(chain, [1, 2])], device_ids=ids)
    with pytest.raises(ValueError, match="device_ids"):
        runner.forward([StepInput(chain, [1])], device_ids=torch.tensor([9, 9], device=DEVICE))
    assert chain.num_rows == 3  # refused before touching the chain
    by_device = runner.forward([StepInput(chain, [PLACEHOLDER_ID])], device_ids=ids)
    chain.trim(1)
    by_host = runner.forward([StepInput(chain, [9])])
    torch.testing.assert_close(by_device, by_host, rtol=0, atol=0)
    assert chain.token_ids() == [5, 6, 7, 9]
    chain.trim(1)
    runner.forward([StepInput(chain, [PLACEHOLDER_ID])], device_ids=ids)
    chain.fill_token_ids([9])
    assert chain.token_ids() == [5, 6, 7, 9]
    with pytest.raises(ValueError, match="fewer than"):
        chain.fill_token_ids([1] * 5)
    chain.release()
