"""Speculative decoding with a draft model: the same tokens as plain decoding, draft chains that
follow the sequences (trims, forks, preemption) and go away with them, and a tokenizer check."""

from __future__ import annotations

import gc
import json
import shutil

import pytest

from drafting_helpers import GREEDY, K, PROMPTS, proposer_pages, tokens
from model_helpers import build_model_dir
from segkv.engine.core import EngineCore
from segkv.engine.llm import LLM
from segkv.models.default_models import resolve_model_dir
from segkv.sampling_params import SamplingParams
from segkv.scheduler import SchedulerConfig
from segkv.spec.draft_model import DraftModelProposer

DRAFT = {"method": "draft_model", "model": "default", "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def mla_pair():
    """default-mla without and with ``default`` drafting for it."""
    return LLM("default-mla"), LLM("default-mla", speculative_config=DRAFT)


@pytest.fixture(scope="module")
def self_pair():
    """default without and with itself drafting for it."""
    return LLM("default"), LLM("default", speculative_config=DRAFT)


def test_greedy_tokens_equal_plain_decoding_and_the_draft_cache_empties(mla_pair):
    plain, spec = mla_pair
    assert isinstance(spec.generator.proposer, DraftModelProposer)
    assert tokens(spec, PROMPTS, GREEDY) == tokens(plain, PROMPTS, GREEDY)
    stats = spec.generator.spec_stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens <= stats.draft_tokens
    gc.collect()
    assert proposer_pages(spec) == 0 and spec.generator.proposer.num_sequences == 0
    assert spec.cache.stats()["pages_in_use"] == 0


def test_a_model_drafting_for_itself_has_every_draft_accepted(self_pair):
    plain, spec = self_pair
    stats = spec.generator.spec_stats
    before = (stats.drafts, stats.draft_tokens, stats.accepted_tokens)
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    assert tokens(spec, PROMPTS, params) == tokens(plain, PROMPTS, params)
    drafts, proposed, accepted = (now - then for now, then in
                                  zip((stats.drafts, stats.draft_tokens, stats.accepted_tokens), before))
    assert drafts > 0 and accepted == proposed
    # 32 tokens after the first: windows of k + 1 tokens (8 per prompt), the last one shortened
    assert drafts == len(PROMPTS) * 8 and proposed == len(PROMPTS) * 32 - drafts
    gc.collect()
    assert proposer_pages(spec) == 0


def test_siblings_and_batches_match_plain(mla_pair):
    plain, spec = mla_pair
    params = SamplingParams(temperature=0, max_tokens=16, n=2, ignore_eos=True)
    got = tokens(spec, PROMPTS[:2], params)
    assert got == tokens(plain, PROMPTS[:2], params)
    assert all(a == b for a, b in got)  # greedy siblings agree
    alone = [tokens(spec, [p], GREEDY)[0] for p in PROMPTS[:2]]
    assert alone == tokens(plain, PROMPTS[:2], GREEDY)
    gc.collect()
    assert proposer_pages(spec) == 0


def test_seeded_sampling_is_reproducible(mla_pair):
    _, spec = mla_pair
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    assert tokens(spec, PROMPTS, params) == tokens(spec, PROMPTS, params)


def test_conversation_turns_fork_and_restore_match_plain(mla_pair):
    """A conversation keeps its draft chain across turns; a fork starts from its parent's draft
    rows; a restore to an earlier snapshot trims the draft chain to the common prefix."""
    results = []
    for llm in mla_pair:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        conv = llm.conversation(system="You write Python.")
        replies = [conv.say(PROMPTS[0], params).text]
        snap = conv.snapshot()
        replies.append(conv.say(PROMPTS[1], params).text)
        fork = conv.fork()
        replies.append(fork.say(PROMPTS[2], params).text)
        replies.append(conv.say(PROMPTS[2], params).text)
        conv.restore(snap)
        replies.append(conv.say(PROMPTS[2], params).text)
        results.append(replies)
        if llm.speculative_config is not None:
            assert llm.generator.proposer.num_sequences == 2  # the conversation's chain and the fork's
        del conv, fork, snap
        gc.collect()
        if llm.speculative_config is not None:
            assert proposer_pages(llm) == 0
    assert results[0] == results[1]


def test_a_small_target_cache_preempts_and_recomputes_with_the_same_tokens(mla_pair):
    plain, _ = mla_pair
    more = ["for i in range(10):\n", "with open(path) as f:\n", "try:\n    x = 1\nexcept"]
    batch = [plain.tokenizer.encode(p) for p in PROMPTS + more]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = tokens(plain, batch, params)
    small = LLM("default-mla", page_size=4, num_pages=28, speculative_config=DRAFT)
    core = EngineCore(small.cache, small.generator, SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64))
    requests = [core.add_request(p, params) for p in batch]
    for _ in range(2000):
        if not core.has_unfinished():
            break
        core.step()
    assert core.num_preemptions > 0 and small.generator.spec_stats.drafts > 0
    assert [[o.token_ids for o in r.output().outputs] for r in requests] == want
    del requests
    gc.collect()
    assert proposer_pages(small) == 0


def test_a_recomputed_sequence_step_by_step(self_pair):
    """Between steps the target chain is replaced by an empty one (a preemption) or trimmed and
    the tokens recomputed: the drafts still follow the sequence and every one is accepted."""
    plain, spec = self_pair
    ids = spec.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = tokens(plain, [ids], params)[0][0]
    gen, stats = spec.generator, spec.generator.spec_stats
    before = (stats.draft_tokens, stats.accepted_tokens)
    seq = gen.new_sequence(0, spec.cache.new_chain(), ids, ids, params)
    step = 0
    while seq.finish_reason is None:
        gen.step([(seq, len(seq.pending))])
        step += 1
        if seq.finish_reason is None and step % 3 == 0:  # preempted: a new chain, everything recomputed
            seq.chain.release()
            seq.chain = spec.cache.new_chain()
            seq.pending = seq.all_token_ids()
        elif seq.finish_reason is None and step % 3 == 1 and seq.chain.num_rows > 4:  # trimmed back
            seq.chain.trim(4)
            seq.pending = seq.all_token_ids()[-5:]
    assert seq.output_ids == want
    assert stats.draft_tokens - before[0] == stats.accepted_tokens - before[1] > 0
    seq.chain.release()
    del seq
    gc.collect()
    assert proposer_pages(spec) == 0


def test_a_tiny_draft_cache_evicts_or_skips_and_never_fails_the_step(mla_pair):
    plain, spec = mla_pair
    tiny = DraftModelProposer.for_target("default", spec.runner, spec.tokenizer, num_pages=12, page_size=4)
    old, spec.generator.proposer = spec.generator.proposer, tiny
    try:
        drafts = spec.generator.spec_stats.drafts
        assert tokens(spec, PROMPTS, GREEDY) == tokens(plain, PROMPTS, GREEDY)
        assert spec.generator.spec_stats.drafts > drafts  # some sequences still got drafts
        assert tiny.evictions > 0
        gc.collect()
        assert tiny.cache.pool.pages_in_use == 0
    finally:
        spec.generator.proposer = old


def test_a_draft_model_with_another_tokenizer_is_refused(mla_pair, tmp_path):
    _, spec = mla_pair
    build_model_dir(tmp_path / "tiny", "qwen3")  # a tiny vocabulary of its own
    with pytest.raises(ValueError, match=r"(?s)draft model .*tiny.* does not share the tokenizer of "
                                         r"DeepseekV3ForCausalLM.*vocabulary size"):
        DraftModelProposer.for_target(tmp_path / "tiny", spec.runner, spec.tokenizer)
    with pytest.raises(ValueError, match="does not share the tokenizer"):
        LLM("default-mla", speculative_config={**DRAFT, "model": str(tmp_path / "tiny")})
    # the same size and special tokens, two ordinary tokens' ids swapped
    swapped = tmp_path / "swapped"
    shutil.copytree(resolve_model_dir("default"), swapped)
    data = json.loads((swapped / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    (a, ia), (b, ib) = list(vocab.items())[300:302]
    vocab[a], vocab[b] = ib, ia
    (swapped / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="does not share the tokenizer"):
        DraftModelProposer.for_target(swapped, spec.runner, spec.tokenizer)
