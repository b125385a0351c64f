"""Decode steps launched ahead (``Generator.lookahead``): the next step starts from the device's
samples before the host reads them. Outputs, chains and pages must equal the step-by-step run's,
whatever ends, forks, waits or is preempted in between."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import GPU
from model_helpers import build_model_dir
from segkv.engine import LLM
from segkv.engine.core import EngineCore
from segkv.runner.model_runner import PENDING_TOKEN, StepInput
from segkv.sampling_params import SamplingParams
from segkv.scheduler import SchedulerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lookahead-model")
    build_model_dir(directory, "qwen3")
    return directory


def _llm(model_dir, lookahead: bool, **kw) -> LLM:
    llm = LLM(model_dir, page_size=4, num_pages=kw.pop("num_pages", 400), **kw)
    llm.generator.lookahead = lookahead
    return llm


def _prompts(llm, count: int) -> list[list[int]]:
    words = ["pages", "segments", "forks", "chains", "merge", "split", "plans", "turns"]
    return [llm.tokenizer.encode(" ".join(words[(i + j) % 8] for j in range(2 + i % 5)))
            for i in range(count)]


def _outputs(results) -> list[tuple]:
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for r in results for c in r.outputs]


def _run(llm, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Generate each prompt with its own params in one batch (what ``generate`` does with one)."""
    gen = llm.generator
    seqs = [gen.new_sequence(0, llm.cache.new_chain(), ids, ids, p) for ids, p in zip(prompts, params)]
    try:
        gen.run(seqs)
        return [(c.token_ids, c.finish_reason, c.stop_reason, c.text)
                for s in seqs for c in (x.result() for x in [s, *s.siblings])]
    finally:
        for s in seqs:
            for x in [s, *s.siblings]:
                x.chain.release()


def test_generate_gives_the_step_by_step_outputs(model_dir):
    """Sequences ending at different steps (lengths, a stop string, EOS), samples forked with
    n > 1 and seeded sampling: same tokens, texts and finish reasons; no row or page left over."""
    plain, ahead = _llm(model_dir, False), _llm(model_dir, True)
    prompts = _prompts(plain, 5)
    cases = [
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 1, 6, 12)],
        [SamplingParams(temperature=0, max_tokens=10, stop=["s"])] * 5,
        [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=7, seed=11, n=3)] * 5,
        [SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, logprobs=2)] * 5,
    ]
    for params in cases:
        free = ahead.cache.pool.num_free_pages
        want = _run(plain, prompts, params)
        used = ahead.generator.steps_ahead_used
        assert _run(ahead, prompts, params) == want
        assert ahead.generator.steps_ahead_used > used  # the steps really ran ahead
        assert ahead.cache.pool.num_free_pages == free  # every extra row was given back
    assert plain.generator.steps_ahead_used == 0


def test_a_follow_up_turn_sees_exactly_the_history(model_dir):
    """A conversation's chain after a turn holds its prompt and answer, the right token ids, and
    not the row of the step launched after the last token."""
    plain, ahead = _llm(model_dir, False), _llm(model_dir, True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    convs = [plain.conversation(), ahead.conversation()]
    for text in ("hello there", "and a second turn", "a third"):
        outs = [c.say(text, params).output.token_ids for c in convs]
        assert outs[0] == outs[1]
        assert convs[1].chain.num_rows == convs[0].chain.num_rows
        tokens = convs[1].chain.token_ids()
        assert tokens == convs[0].chain.token_ids() and PENDING_TOKEN not in tokens
    assert ahead.generator.steps_ahead_used >= 6


def test_the_length_limit_ends_at_the_same_token(model_dir):
    plain, ahead = _llm(model_dir, False, max_model_len=24), _llm(model_dir, True, max_model_len=24)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompt = _prompts(plain, 3)[2]
    want = _outputs(plain.generate([prompt], params))
    assert want[0][1] == "length" and len(prompt) + len(want[0][0]) == 24
    assert _outputs(ahead.generate([prompt], params)) == want


def _finish(core: EngineCore) -> None:
    for _ in range(2000):
        if not core.has_unfinished():
            return
        core.step()
    raise AssertionError("requests did not finish")


def _step_until_ahead(core: EngineCore) -> None:
    for _ in range(50):
        core.step()
        if core.generator._ahead is not None:
            return
    raise AssertionError("no step was launched ahead")


def test_engine_with_arrivals_and_aborts(model_dir):
    """Continuous batching: requests arriving while a step runs ahead are prefilled beside it (its
    decode rows are used), an abort leaves the others served by it; every output equals the
    request run alone."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = _llm(model_dir, False)
    batch = _prompts(plain, 10)
    alone = [plain.generate([p], params)[0].outputs[0].token_ids for p in batch]
    llm = _llm(model_dir, True)
    gen = llm.generator
    core = EngineCore(llm.cache, llm.generator, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64))
    requests = [core.add_request(p, params) for p in batch[:6]]
    doomed = core.add_request(batch[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    _step_until_ahead(core)
    requests += [core.add_request(p, params) for p in batch[6:]]
    used = gen.steps_ahead_used
    core.step()
    # the running decodes came from the step ahead; the arrivals' prefill ran a forward of its own
    assert gen.steps_ahead_used == used + 1 and gen.steps_ahead_cancelled == 0
    _step_until_ahead(core)
    used = gen.steps_ahead_used
    assert core.abort(doomed.request_id)
    core.step()
    assert gen.steps_ahead_used == used + 1  # the rest of the batch still used it
    _finish(core)
    assert [r.output().outputs[0].token_ids for r in requests] == alone


def test_engine_preempting_sequences_that_hold_rows_ahead(model_dir):
    """A small page budget preempts sequences (some holding a row of a step launched ahead: it is
    sealed with its real token and recomputed from the prefix index); outputs equal the requests
    run alone."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = _llm(model_dir, False)
    batch = _prompts(plain, 10)
    alone = [plain.generate([p], params)[0].outputs[0].token_ids for p in batch]
    small = _llm(model_dir, True, num_pages=36)
    core = EngineCore(small.cache, small.generator,
                      SchedulerConfig(max_num_seqs=10, max_num_batched_tokens=64))
    requests = [core.add_request(p, params) for p in batch]
    _step_until_ahead(core)
    held = [s for s in core.running if small.generator.rows_ahead(s)]
    assert held
    core._preempt(held[-1])  # what the scheduler does when pages run out
    used = small.generator.steps_ahead_used
    core.step()
    assert small.generator.steps_ahead_used == used + 1  # the others' rows were still used
    _finish(core)
    assert [r.output().outputs[0].token_ids for r in requests] == alone
    assert core.num_preemptions > 1


def test_the_step_ahead_reads_device_tokens(model_dir):
    """``ModelRunner.decode_from_device``: the same logits as the step given host token ids, and
    the rows' token ids are placeholders until set."""
    llm = _llm(model_dir, False)
    runner = llm.runner
    chains = [llm.cache.new_chain() for _ in range(2)]
    prompts = _prompts(llm, 2)
    runner.forward([StepInput(c, p) for c, p in zip(chains, prompts)])
    forks = [c.fork() for c in chains]
    tokens = [17, 5]
    want = runner.forward([StepInput(c, [t]) for c, t in zip(chains, tokens)])
    got = runner.decode_from_device(forks, torch.tensor(tokens))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert [c.token_ids()[-1] for c in forks] == [PENDING_TOKEN] * 2
    for c, t in zip(forks, tokens):
        c.set_last_token_id(t)
    assert [c.token_ids() for c in forks] == [c.token_ids() for c in chains]
    with pytest.raises(ValueError, match="shape"):
        runner.decode_from_device(forks, torch.tensor([1, 2, 3]))
    for c in chains + forks:
        c.release()


def test_rows_and_lists_reach_the_device_unchanged(gen):
    """The transfers the decode loop uses instead of synchronising ones give the same tensors."""
    from segkv.layers.transfer import HostCopy, select_rows, to_device

    x = torch.randn(6, 5, generator=gen)
    assert select_rows(x, range(6)) is x
    for rows in ([2, 3, 4], [5, 0, 3], [1], []):
        torch.testing.assert_close(select_rows(x, rows), x[list(rows)], rtol=0, atol=0)
    assert select_rows(x, [2, 3]).data_ptr() == x[2].data_ptr()  # consecutive rows: a view
    device = "cuda" if GPU else "cpu"
    got = to_device([[1, 2], [3, 4]], torch.int32, device)
    assert got.dtype == torch.int32 and got.device.type == device and got.tolist() == [[1, 2], [3, 4]]
    assert to_device([True, False], torch.bool, device).tolist() == [True, False]
    values = torch.randint(0, 1000, (7,), generator=gen).to(device)
    copy = HostCopy(values)
    values.add_(1)  # queued after the copy: the copy holds the values it was given
    assert copy.tolist() == (values - 1).tolist()


def test_a_failed_step_gives_back_the_rows_it_took(model_dir, monkeypatch):
    """A step that takes decode rows from the step ahead and fails in its own forward (a new
    sequence's prefill) leaves every chain as before the step; generation then goes on unchanged."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain, ahead = _llm(model_dir, False), _llm(model_dir, True)
    p1, p2 = _prompts(plain, 2)
    want = _run(plain, [p1, p2], [params, params])
    gen = ahead.generator
    a = gen.new_sequence(0, ahead.cache.new_chain(), p1, p1, params)
    gen.step([(a, len(a.pending))])  # prefill
    gen.step([(a, 1)])  # a decode: launches the next one ahead
    assert gen.rows_ahead(a) == 1
    rows, pending = a.chain.num_rows, list(a.pending)
    b = gen.new_sequence(0, ahead.cache.new_chain(), p2, p2, params)
    with monkeypatch.context() as m:
        m.setattr(ahead.runner, "forward", lambda inputs: (_ for _ in ()).throw(RuntimeError("no pages")))
        with pytest.raises(RuntimeError, match="no pages"):
            gen.step([(a, 1), (b, len(b.pending))])
    assert a.chain.num_rows == rows - 1 and a.pending == pending and b.chain.num_rows == 0
    gen.run([a, b])
    assert [(s.output_ids, s.finish_reason) for s in (a, b)] == [(w[0], w[1]) for w in want]
    for s in (a, b):
        s.chain.release()
