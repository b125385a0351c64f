"""Constrained decoding on the built-in default model: every output follows its schema, regex,
choice or grammar, at temperature 1, in batches mixed with free requests, with and without
speculation; the same requests unconstrained do not give JSON."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from segkv.engine.llm import LLM
from segkv.sampling_params import SamplingParams, StructuredOutput
from segkv.structured.matcher import GrammarState
from segkv.server.metrics import ServerMetrics

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = {
    "nested objects": {**OBJ, "properties": {"p": {**OBJ, "properties": {"x": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 9}},
                                                       "required": ["x"]}}, "required": ["p"]},
    "arrays": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    "enums": {**OBJ, "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"]},
    "bounded numbers": {**OBJ, "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 250},
                                              "x": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
                        "required": ["n", "x"]},
    "required fields": {**OBJ, "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                              "ok": {"type": "boolean"}, "tag": {"type": "string", "maxLength": 2}},
                        "required": ["id", "ok"]},
}
PROMPT = "Answer in JSON:"


@pytest.fixture(scope="module")
def llm():
    return LLM("default", dtype="float32", device="cpu")


def run_all(llm, requests):
    """Run ``(prompt, params)`` requests together in one engine core; their RequestOutputs."""
    core = llm.core
    added = [core.add_request(llm.tokenizer.encode(p), params, cache_rows=False) for p, params in requests]
    while not all(r.finished for r in added):
        core.step()
    return [r.output() for r in added]


def test_every_output_of_five_schemas_validates(llm):
    """100 of 100 samples at temperature 1 (20 per schema, all in one batch) follow their schema."""
    params = [SamplingParams(temperature=1.0, n=20, max_tokens=40, structured=StructuredOutput(json_schema=s))
              for s in SCHEMAS.values()]
    outputs = run_all(llm, [(PROMPT, p) for p in params])
    texts = []
    for (name, schema), out in zip(SCHEMAS.items(), outputs):
        assert len(out.outputs) == 20
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (name, sample.text)
            jsonschema.validate(json.loads(sample.text), schema)
            texts.append(sample.text)
    assert len(set(texts)) > 20  # sampled, not one answer repeated
    stats = llm.generator.grammars.stats()
    assert stats["misses"] >= 5 and stats["hits"] >= 5 * 19  # each schema compiled once, shared by its samples
    text = ServerMetrics(llm.core.stats, model_name="default").render().decode()
    assert f'segkv_grammar_cache_hits_total{{model_name="default"}} {float(stats["hits"])}' in text
    assert f'segkv_grammar_cache_misses_total{{model_name="default"}} {float(stats["misses"])}' in text


def test_unconstrained_requests_do_not_give_json(llm):
    """The power check: without the grammar the same model does not write valid JSON."""
    out = run_all(llm, [(PROMPT, SamplingParams(temperature=1.0, n=16, max_tokens=24))])[0]

    def valid(text):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS["required fields"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    assert sum(valid(o.text) for o in out.outputs) == 0


def test_json_object_regex_choice_and_grammar_in_one_batch_with_free_requests(llm):
    requests = [
        (PROMPT, SamplingParams(n=6, max_tokens=60, structured=StructuredOutput(json_object=True), seed=7,
                                temperature=0.7)),
        ("Date:", SamplingParams(n=4, max_tokens=20, structured=StructuredOutput(regex=r"20[0-9]{2}-[01][0-9]"))),
        ("Pick:", SamplingParams(n=4, max_tokens=10, structured=StructuredOutput(
            choice=["alpha", "beta", "gamma"], prefix="<", suffix=">"))),
        ("Say:", SamplingParams(n=2, max_tokens=10, structured=StructuredOutput(grammar='root ::= ("ab" | "cd")+ "!"'))),
        ("def f(x):", SamplingParams(max_tokens=12, ignore_eos=True)),
    ]
    obj, date, pick, say, free = run_all(llm, requests)
    for o in obj.outputs:  # JSON mode closes what is open before the length limit
        assert isinstance(json.loads(o.text), dict) and o.finish_reason == "stop"
    assert all(re.fullmatch(r"20[0-9]{2}-[01][0-9]", o.text) and o.finish_reason == "stop" for o in date.outputs)
    assert all(o.text in ("<alpha>", "<beta>", "<gamma>") and o.finish_reason == "stop" for o in pick.outputs)
    assert all(re.fullmatch(r"(ab|cd)+!", o.text) for o in say.outputs if o.finish_reason == "stop")
    assert len(free.outputs[0].token_ids) == 12 and free.outputs[0].finish_reason == "length"


def test_constrained_greedy_equals_with_and_without_speculation(llm):
    spec = LLM("default", dtype="float32", device="cpu", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 6,
              "maxItems": 6}
    # the prompt repeats what the output will contain, so n-gram drafts are proposed (and some rejected)
    prompt = "[1, 2, 3, 1, 2, 3] [1, 2, 3, 1, 2, 3] [1, 2"
    params = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput(json_schema=schema))
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0] for o in llm.generate([prompt, prompt], params)]
    got = run_all(spec, [(prompt, params), (prompt, free)])
    assert got[0].outputs[0].token_ids == want[0].token_ids
    assert len(json.loads(want[0].text)) == 6
    stats = spec.generator.spec_stats
    assert stats.drafts > 0 and stats.accepted_tokens > 0
    assert spec.cache.stats()["pages_in_use"] == 0


def test_conversation_turns_take_the_same_sampling_params(llm):
    """The sessions path (a conversation's turn) is constrained like a request."""
    chat = llm.conversation()
    schema = SCHEMAS["enums"]
    turn = chat.say("Which colour?", SamplingParams(max_tokens=20, structured=StructuredOutput(json_schema=schema)))
    jsonschema.validate(json.loads(turn.text), schema)
    assert turn.output.finish_reason == "stop"
    turn = chat.say("Again, yes or no?", SamplingParams(max_tokens=5, structured=StructuredOutput(choice=["yes", "no"]),
                                                        logit_bias={llm.tokenizer.encode("no")[-1]: -100}))
    assert turn.text in ("yes", "no")
    with pytest.raises(ValueError, match="out of the vocabulary"):
        chat.say("x", SamplingParams(logit_bias={llm.model.cfg.vocab_size + 5: 1}))


def test_seeded_constrained_samples_ignore_the_batch_and_steps_launched_ahead(llm):
    """A seeded constrained request draws the same tokens alone and in a batch, and with steps
    launched ahead (the forward runs before the host has advanced the grammar; the mask is filled
    before the step's tokens are sampled) as without."""
    schema = SCHEMAS["required fields"]
    seeded = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=40, structured=StructuredOutput(json_schema=schema))
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = run_all(llm, [(PROMPT, seeded)])[0]
    llm.generator.lookahead = True
    try:
        used = llm.generator.steps_ahead_used
        together = run_all(llm, [("def f(x):", free), (PROMPT, seeded), ("import os", free)])
        assert llm.generator.steps_ahead_used > used + 10  # constrained steps ran ahead too
        free_only = run_all(llm, [("def f(x):", free), ("import os", free)])
    finally:
        llm.generator.lookahead = False
    assert [o.token_ids for o in together[1].outputs] == [o.token_ids for o in alone.outputs]
    assert [o.token_ids for o in free_only[0].outputs] == [o.token_ids for o in together[0].outputs]
    for o in alone.outputs:
        jsonschema.validate(json.loads(o.text), schema)


def test_preempted_constrained_sequences_resume_in_their_grammar():
    """A constrained sequence preempted for lack of pages recomputes its rows and goes on from where
    its grammar stood: every output still follows the schema."""
    small = LLM("default", dtype="float32", device="cpu", page_size=4, num_pages=40)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 8, "maxItems": 8}
    params = SamplingParams(temperature=1.0, max_tokens=60, structured=StructuredOutput(json_schema=schema))
    outputs = run_all(small, [("Numbers: " * 3, params)] * 8)
    assert small.core.num_preemptions > 0
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert small.cache.stats()["pages_in_use"] == 0


@pytest.mark.parametrize("max_tokens", [3, 12, 40])
def test_json_mode_always_parses_within_its_budget(llm, max_tokens, monkeypatch):
    """At temperature 1 this model writes strings it never closes; JSON mode forces the shortest
    completion once the tokens left only just hold it. The check has power: with the budget
    hidden from the grammar state, outputs stop at the length limit unparsed."""
    prompt = "Give me a JSON object describing a user."
    params = SamplingParams(n=24, max_tokens=max_tokens, temperature=1.0, seed=int(torch.randint(1 << 30, ())),
                            structured=StructuredOutput(json_object=True))
    for o in llm.generate([prompt], params)[0].outputs:
        assert isinstance(json.loads(o.text), dict), o.text
        assert o.finish_reason == "stop" and len(o.token_ids) <= max_tokens
    if max_tokens == 40:
        original = GrammarState.__init__

        def unbudgeted(self, cache, structured, *, budget=None):
            original(self, cache, structured, budget=None)

        monkeypatch.setattr(GrammarState, "__init__", unbudgeted)
        outs = llm.generate([prompt], params)[0].outputs
        assert sum(o.finish_reason == "length" for o in outs) >= 3
