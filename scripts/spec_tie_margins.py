"""Where speculative greedy tokens leave the plain ones in bf16, and by how much the plain run's top
two tokens were apart there (a tie within bf16 rounding, or a real difference).

Per (model, method): the held-out prompts of benchmarks.spec_decode, greedy, plain and speculative;
at each prompt's first differing position, the plain run's logprob gap between its top two tokens
and the speculative run's gap there. Prints one line per prompt. Run on a GPU:
``python scripts/spec_tie_margins.py``.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.spec_decode import heldout_prompts
from segkv.engine.llm import LLM
from segkv.sampling_params import SamplingParams

CASES = [("default", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
         ("default-mla", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                          "prompt_lookup_max": 3}),
         ("default-mla", {"method": "mtp", "num_speculative_tokens": 3}),
         ("default-mla", {"method": "draft_model", "model": "default", "num_speculative_tokens": 3}),
         ("default-mla", {"method": "eagle3", "model": "default", "num_speculative_tokens": 3})]


def gap(logprob) -> float:
    top = sorted((lp for _, lp in logprob.top), reverse=True)
    return top[0] - top[1]


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, logprobs=2)
    for model, config in CASES:
        plain = LLM(model, dtype=dtype, device=device, cuda_graphs="auto")
        spec = LLM(model, dtype=dtype, device=device, cuda_graphs="auto", speculative_config=config)
        prompts, _ = heldout_prompts(plain.tokenizer, 4, 512)
        a = [o.outputs[0] for o in plain.generate(prompts, params)]
        b = [o.outputs[0] for o in spec.generate(prompts, params)]
        for i, (x, y) in enumerate(zip(a, b)):
            j = next((j for j, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), None)
            if j is None:
                print(f"{model} {config['method']} prompt {i}: equal ({len(x.token_ids)} tokens)", flush=True)
            else:
                print(f"{model} {config['method']} prompt {i}: first difference at token {j}: plain top-2 "
                      f"logprob gap {gap(x.logprobs[j]):.4f}, speculative {gap(y.logprobs[j]):.4f}", flush=True)
        del plain, spec
        torch.cuda.empty_cache() if device == "cuda" else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
