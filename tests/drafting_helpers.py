"""What the tests of drafters with a cache of their own (a draft model, an EAGLE-3 head) share."""

from __future__ import annotations

from segkv.sampling_params import SamplingParams

K = 3
PROMPTS = [
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tokens(llm, prompts, params):
    """Every sample's token ids, per prompt."""
    return [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, params)]


def proposer_pages(llm) -> int:
    """Pages the drafter's own cache holds."""
    return llm.generator.proposer.cache.pool.pages_in_use
