"""The shortest completion of a JSON prefix: every prefix of random JSON closes into JSON."""

from __future__ import annotations

import json
import random

import pytest
import torch

from segkv.structured.json_closing import json_closing


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-30, 30)
    if kind in (3, 4):
        return "".join(rng.choice('ab "\\\u00e9\u4e2d\n\t/') for _ in range(rng.randrange(6)))
    if kind in (5, 6):
        return {f"k{i}\"\\": _random_value(rng, depth + 1)
                for i in range(rng.randrange(4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


@pytest.mark.parametrize("spaced", [True, False])
def test_every_prefix_of_random_json_closes_into_json(spaced):
    rng = random.Random(int(torch.randint(1 << 30, ())))
    separators = (", ", ": ") if spaced else (",", ":")
    for _ in range(60):
        value = {"v": _random_value(rng)} if rng.random() < 0.5 else _random_value(rng)
        text = json.dumps(value, separators=separators, ensure_ascii=rng.random() < 0.5)
        for i in range(len(text) + 1):
            closing = json_closing(text[:i], spaced=spaced)
            json.loads(text[:i] + closing)  # raises if not JSON
            if spaced:  # the grammar's separators: a colon or comma always has its space
                assert ":" + '"' not in closing and ":n" not in closing
        assert json_closing(text, spaced=spaced) == ""


def test_shortest_completions():
    assert json_closing("") == "{}"
    assert json_closing('{"ab') == '": null}'
    assert json_closing('{"a":') == " null}"
    assert json_closing('{"a": 1,') == ' "": null}'
    assert json_closing('[1, tr') == "ue]"
    assert json_closing('["x\\u00') == '00"]'
    assert json_closing('{"a": -') == "0}"
    assert json_closing('{"a":1,', spaced=False) == '"":null}'


@pytest.mark.parametrize("bad", ["}", '{"a" 1', "[1,]", "tx", '{"a": nul1'])
def test_text_that_is_no_json_prefix_is_refused(bad):
    with pytest.raises(ValueError):
        json_closing(bad)
