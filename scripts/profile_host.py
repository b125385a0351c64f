"""Where the host's time goes in speculative and constrained decoding (cProfile, batch 1).

Runs each case once untimed (graph captures, compiles), then profiles ``--prompts`` generations
of ``--max-tokens`` tokens and prints the functions with the most own time and the most cumulative
time, with wall time per generated token. Cases: ``plain:<model>``, ``spec:<model>:<method>:<k>``,
``json:<model>`` (the structured-output benchmark's schema).

    python scripts/profile_host.py --cases spec:default-mla:mtp:3,json:default
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from benchmarks.spec_decode import heldout_prompts, spec_config
from benchmarks.structured_output import SCHEMA
from segkv.engine.llm import LLM
from segkv.sampling_params import SamplingParams, StructuredOutput


def build(case: str) -> tuple[LLM, SamplingParams]:
    kind, model, *rest = case.split(":")
    speculative = None
    if kind == "spec":
        speculative = spec_config(rest[0], int(rest[1]), draft_model="default")
    llm = LLM(model, dtype="bfloat16" if torch.cuda.is_available() else "float32",
              device="cuda" if torch.cuda.is_available() else "cpu", speculative_config=speculative,
              cuda_graphs="auto")
    params = SamplingParams(temperature=0, ignore_eos=True)
    if kind == "json":
        params = params.replace(structured=StructuredOutput(json_schema=SCHEMA))
    return llm, params


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="plain:default-mla,spec:default-mla:mtp:3")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    for case in args.cases.split(","):
        llm, params = build(case)
        params = params.replace(max_tokens=args.max_tokens)
        prompts, _ = heldout_prompts(llm.tokenizer, args.prompts, 512)
        llm.generate(prompts[:1], params)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for prompt in prompts:
            llm.generate([prompt], params)
        profile.disable()
        wall = time.perf_counter() - start
        print(f"== {case}: {wall / (len(prompts) * args.max_tokens) * 1e3:.3f} ms per token (profiled)")
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
            print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
        del llm


if __name__ == "__main__":
    main()
