"""On a GPU: the engine with the Triton kernels gives the reference backend's greedy tokens."""

from __future__ import annotations

import pytest

from model_helpers import build_model_dir
from segkv.engine import LLM
from segkv.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_backend_matches_the_reference_end_to_end(tmp_path, dtype):
    build_model_dir(tmp_path, "qwen3")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 9, 13, 40, 77] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3]
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tmp_path, device="cuda", dtype=dtype, backend=backend, page_size=16, num_pages=256,
                  prefill_chunk=16)
        assert type(llm.runner.backend).__name__ == {"torch": "TorchReferenceBackend",
                                                     "triton": "TritonBackend"}[backend]
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        conv = llm.conversation()
        outputs[backend].append(conv.say("hello there", params).output.token_ids)
    if dtype == "float32":
        assert outputs["triton"] == outputs["torch"]
    else:  # bf16: both round float32 attention once; greedy ties may still break differently
        same = sum(a == b for x, y in zip(outputs["triton"], outputs["torch"]) for a, b in zip(x, y))
        assert same >= 0.9 * sum(len(x) for x in outputs["torch"])


def test_engine_with_graphs_and_steps_ahead_gives_the_eager_tokens(tmp_path):
    """Continuous batching on the GPU as the server runs it: CUDA graphs, decode steps launched
    ahead (the default there), requests of different lengths arriving while steps run ahead."""
    from segkv.engine.core import EngineCore
    from segkv.scheduler import SchedulerConfig

    build_model_dir(tmp_path, "qwen3")
    prompts = [[5, 9, 13, 40, 77] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3, [8, 8, 1], [7, 2, 7, 2, 9] * 4]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 7, 13, 16)]
    kw = dict(device="cuda", dtype="float32", backend="triton", page_size=16, num_pages=256, prefill_chunk=16)
    eager = LLM(tmp_path, **kw)
    want = [eager.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(tmp_path, cuda_graphs=True, **kw)
    assert llm.generator.lookahead
    core = EngineCore(llm.cache, llm.generator, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    requests = [core.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    for _ in range(5):
        core.step()
    requests += [core.add_request(p, sp) for p, sp in zip(prompts[2:], params[2:])]
    while core.has_unfinished():
        core.step()
    assert [r.output().outputs[0].token_ids for r in requests] == want
    assert llm.generator.steps_ahead_used > 10 and llm.runner.graphs.replays > 10
