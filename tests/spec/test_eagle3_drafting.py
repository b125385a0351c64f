"""Speculative method eagle3: the same greedy tokens as plain decoding on both built-in targets, with
and without (emulated) CUDA graphs, head states that follow the sequences (turns, forks, restores)
and go away with them, and a clear error for each bad head."""

from __future__ import annotations

import gc
import json
import shutil

import pytest

from drafting_helpers import GREEDY, K, PROMPTS, proposer_pages, tokens
from model_helpers import build_model_dir
from segkv.engine.llm import LLM
from segkv.models.default_models import PACKAGE_ROOT
from segkv.sampling_params import SamplingParams
from segkv.spec.eagle3 import Eagle3Proposer

EAGLE3 = {"method": "eagle3", "model": "default", "num_speculative_tokens": K}
EAGLE3_TREE = {**EAGLE3, "topk": 4, "num_draft_tokens": 12}  # trees of 11 nodes, top-4 branches


@pytest.fixture(scope="module", params=[("default", "chain"), ("default", "tree"), ("default-mla", "chain"),
                                        ("default-mla", "tree")], ids="-".join)
def pair(request):
    """A built-in target without and with its built-in EAGLE-3 head drafting for it (greedy chains,
    or top-k trees verified as tree windows)."""
    name, shape = request.param
    return LLM(name, device="cpu", dtype="float32"), LLM(name, device="cpu", dtype="float32",
                                                         speculative_config=EAGLE3_TREE if shape == "tree" else EAGLE3)


def test_greedy_tokens_equal_plain_decoding_at_batch_3_and_1(pair):
    plain, spec = pair
    assert isinstance(spec.generator.proposer, Eagle3Proposer)
    assert spec.speculative_config.model == "default"  # as given; the generator runs the resolved head
    assert tokens(spec, PROMPTS, GREEDY) == tokens(plain, PROMPTS, GREEDY)
    stats = spec.generator.spec_stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens <= stats.draft_tokens
    assert stats.accepted_per_position[1] > 0  # deeper steps (the head's own output fed back) hit too
    if spec.speculative_config.topk > 1:  # windows were trees: more nodes than a chain's K drafts
        assert stats.draft_tokens > stats.drafts * K
    alone = tokens(spec, PROMPTS[2:], GREEDY)
    assert alone == tokens(plain, PROMPTS[2:], GREEDY)
    gc.collect()
    assert proposer_pages(spec) == 0 and spec.generator.proposer.num_sequences == 0
    assert spec.cache.stats()["pages_in_use"] == 0


def test_siblings_turns_forks_and_restores_match_plain(pair):
    """n > 1 siblings fork after prefill; a conversation keeps its head rows across turns; a fork
    starts from its parent's; a restore trims them to the common prefix."""
    results = []
    for llm in pair:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        got = [tokens(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, n=2, ignore_eos=True))]
        conv = llm.conversation(system="You write Python.")
        got.append(conv.say(PROMPTS[0], params).text)
        snap = conv.snapshot()
        got.append(conv.say(PROMPTS[1], params).text)
        fork = conv.fork()
        got.append(fork.say(PROMPTS[2], params).text)
        got.append(conv.say(PROMPTS[2], params).text)
        conv.restore(snap)
        got.append(conv.say(PROMPTS[2], params).text)
        results.append(got)
        del conv, fork, snap
        gc.collect()
        if llm.speculative_config is not None:
            assert proposer_pages(llm) == 0
    assert results[0] == results[1]


@pytest.mark.parametrize("config, max_tokens", [(EAGLE3, 9), (EAGLE3_TREE, 6)], ids=["chain", "tree"])
def test_graph_emulation_gives_the_plain_tokens(config, max_tokens):
    """The target's steps replayed from (emulated) CUDA graphs hand the proposer their aux states;
    tree windows replay their window graphs with key masks in the fixed plan buffers."""
    kw = dict(device="cpu", dtype="float32", page_size=16, num_pages=256, prefill_chunk=32)
    # one prompt, few tokens (enough for the head's window graphs): the interpreter runs every
    # program of the fixed-size window graphs
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    want = tokens(LLM("default", **kw), PROMPTS[2:], params)
    spec = LLM("default", backend="triton", cuda_graphs="emulate", speculative_config=config, **kw)
    assert tokens(spec, PROMPTS[2:], params) == want
    graphs = spec.runner.graphs
    assert graphs.window_replays > 0 and spec.generator.spec_stats.accepted_tokens > 0
    head_graphs = spec.generator.proposer.graphs  # the head's own steps replay graphs too
    assert head_graphs.replays > 0 and head_graphs.window_replays > 0


def _head_copy(tmp_path, **changes):
    path = tmp_path / "head"
    shutil.copytree(PACKAGE_ROOT / "eagle3-default", path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return str(path)


def test_bad_heads_are_clear_errors(tmp_path):
    build_model_dir(tmp_path / "tiny", "qwen3")
    with pytest.raises(ValueError, match="model 'default' picks the built-in head of a built-in target"):
        LLM(tmp_path / "tiny", device="cpu", speculative_config=EAGLE3)
    with pytest.raises(ValueError, match="head directory '/no/such/head' does not exist"):
        LLM("default", device="cpu", speculative_config={**EAGLE3, "model": "/no/such/head"})
    with pytest.raises(ValueError, match="target_hidden_size 128 != the target's hidden_size 256"):
        LLM("default", device="cpu", speculative_config={**EAGLE3, "model": _head_copy(tmp_path, target_hidden_size=128)})
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(PACKAGE_ROOT / "eagle3-default" / "config.json", weightless)
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        LLM("default", device="cpu", speculative_config={**EAGLE3, "model": str(weightless)})
    with pytest.raises(ValueError, match="model 'default' picks the built-in head of a built-in target"):
        LLM(tmp_path / "tiny", device="cpu", speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    # without a model, a built-in target takes its built-in head
    assert LLM("default", device="cpu", speculative_config={"method": "eagle3", "num_speculative_tokens": 2}
               ).speculative_config.model == "default"
