"""CUDA-graph decode: static buffers, fixed-capacity plans and padding rows give the eager tokens.

Without a GPU the graphs are emulated (the captured step re-runs over the same static buffers,
which is what a replay reads); on a GPU real graphs are captured and replayed.
"""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEVICE, GPU
from model_helpers import build_deepseek_dir, build_model_dir
from segkv.engine import LLM
from segkv.runner.model_runner import StepInput
from segkv.sampling_params import SamplingParams

MODE = True if GPU else "emulate"


def _llm(path, backend="triton", **kw):
    return LLM(path, device=DEVICE, dtype="float32", backend=backend, page_size=16, num_pages=128,
               prefill_chunk=32, **kw)


def test_graph_decode_gives_the_eager_tokens(tmp_path):
    build_model_dir(tmp_path, "qwen3")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 9, 13, 40, 77] * 5, [3, 1, 4, 1, 5, 9, 2, 6] * 2, [8, 8, 1]]  # 3 rows: bucket 4, one pad
    eager = [o.outputs[0].token_ids for o in _llm(tmp_path).generate(prompts, params)]
    llm = _llm(tmp_path, cuda_graphs=MODE)
    graphs = llm.runner.graphs
    assert graphs is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == eager
    assert graphs.replays >= 3 and (4, False, True) in graphs._buckets  # decode steps went through the bucket
    conv = llm.conversation()  # a follow-up turn on a segmented chain (mid-page boundaries)
    turn = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = conv.say("hello there", turn).output.token_ids
    second = conv.say("and a second turn", turn).output.token_ids
    ref = _llm(tmp_path).conversation()
    assert [first, second] == [ref.say("hello there", turn).output.token_ids,
                               ref.say("and a second turn", turn).output.token_ids]


def test_steps_that_do_not_fit_run_eagerly(tmp_path):
    build_model_dir(tmp_path, "qwen3")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm = _llm(tmp_path, cuda_graphs=MODE)
    llm.runner.graphs.buckets = (1, 2)  # three sequences fit no bucket
    prompts = [[5, 9, 13], [3, 1, 4], [8, 8, 1]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in _llm(tmp_path).generate(prompts, params)]
    assert llm.runner.graphs.fallbacks >= 2 and llm.runner.graphs.replays == 0


def test_graphs_are_refused_where_they_cannot_work(tmp_path):
    build_model_dir(tmp_path, "qwen3")
    with pytest.raises(ValueError, match="Triton backend"):
        LLM(tmp_path, backend="torch", cuda_graphs=True, num_pages=32)
    assert LLM(tmp_path, backend="torch", cuda_graphs="auto", num_pages=32).runner.graphs is None
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        LLM(tmp_path, cuda_graphs="sometimes", num_pages=32)


def test_graph_decode_of_a_latent_attention_model(tmp_path):
    """A DeepSeek-V3-style model with dense layers only (no experts): absorbed MLA decode
    through the latent kernel inside the graph gives the eager tokens."""
    build_deepseek_dir(tmp_path, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 9, 13, 40, 77] * 4, [3, 1, 4, 1, 5, 9, 2, 6] * 2, [8, 8, 1]]
    eager = [o.outputs[0].token_ids for o in _llm(tmp_path).generate(prompts, params)]
    llm = _llm(tmp_path, cuda_graphs=MODE)
    assert llm.runner.graphs is not None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == eager
    assert llm.runner.graphs.replays >= 4


def test_packed_experts_match_the_expert_loop(gen):
    """Device-side expert dispatch (what graphs capture) against one GEMM per expert."""
    from segkv.layers.moe import MixtureOfExperts, RouterSpec

    spec = RouterSpec(num_experts=6, top_k=2)
    moe = MixtureOfExperts(32, 24, spec, num_shared=1).to(DEVICE)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    x = torch.randn(5, 32, generator=gen).to(DEVICE)
    with torch.no_grad():
        looped = moe(x)
        moe.pack_experts()
        packed = moe(x)
        assert moe.packed and moe.experts[3].up_proj.weight.data_ptr() == moe._packed[0][3, 24:].data_ptr()
        torch.testing.assert_close(packed, looped, rtol=1e-5, atol=1e-5)
        big = torch.randn(40, 32, generator=gen).to(DEVICE)  # 80 pairs: the grouped GEMM, still on the device
        torch.testing.assert_close(moe(big), moe._looped_experts(big, *moe.gate(big)) + moe.shared_experts(big))


def test_graph_decode_of_a_model_with_experts(tmp_path):
    """DeepSeek-V3-style MoE layers: packed experts inside the graph at every bucket (GEMV per
    pair for small batches, the grouped GEMM above 64 pairs)."""
    build_deepseek_dir(tmp_path, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [[5, 9, 13, 40, 77] * 2, [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 1]]
    eager = [o.outputs[0].token_ids for o in _llm(tmp_path).generate(prompts, params)]
    llm = _llm(tmp_path, cuda_graphs=MODE)
    graphs = llm.runner.graphs
    assert graphs.max_batch == max(graphs.buckets) >= 32  # no cap from the expert dispatch
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == eager
    assert graphs.replays >= 2  # both decode steps
    wide = [[(7 * i + j) % 90 + 3 for j in range(3)] for i in range(17)]  # 17 x 4 = 68 pairs per layer
    one_step = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eager_wide = [o.outputs[0].token_ids for o in _llm(tmp_path).generate(wide, one_step)]
    replays = graphs.replays
    assert [o.outputs[0].token_ids for o in llm.generate(wide, one_step)] == eager_wide
    assert graphs.replays >= replays + 1  # the 17-sequence batch's decode step ran in a graph


def test_steps_planned_ahead_give_the_same_tokens(tmp_path):
    """While a graph step runs, the next step is planned for the same chains one row longer; it
    is used only when the chains really are that (not after a trim, a new page or a new batch)."""
    build_model_dir(tmp_path, "qwen3")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # 15 and 13 rows: both tails cross a page end (16 rows) mid-decode
    prompts = [[5, 9, 13, 40, 77] * 3, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]]
    eager = [o.outputs[0].token_ids for o in _llm(tmp_path).generate(prompts, params)]
    llm = _llm(tmp_path, cuda_graphs=MODE)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == eager
    runner = llm.runner
    used = runner.plans_ahead_used
    # every step after the first reuses the look-ahead, page crossings included (peeked pages)
    assert used == runner.graphs.replays - 1  # all but the first decode step (it follows the prefill)
    # and each of those replays found its indices already copied behind the step before
    assert runner.graphs.staged_plans_used == used
    # a look-ahead made for other chains is not used: plan a step, then change the chain under it
    chain = llm.cache.new_chain()
    runner.forward([StepInput(chain, [5, 9, 13])])
    runner.forward([StepInput(chain, [7])])
    assert runner._ahead is not None
    chain.trim(2)
    before, staged = runner.plans_ahead_used, runner.graphs.staged_plans_used
    logits = runner.forward([StepInput(chain, [7])])  # its bucket holds the staged indices: replaced
    assert runner.plans_ahead_used == before and runner.graphs.staged_plans_used == staged
    fresh = _llm(tmp_path).runner
    ref_chain = fresh.cache.new_chain()
    fresh.forward([StepInput(ref_chain, [5, 9])])
    torch.testing.assert_close(logits, fresh.forward([StepInput(ref_chain, [7])]), rtol=1e-5, atol=1e-5)


def _decode_logits(llm, shared: bool, steps: int = 2) -> torch.Tensor:
    """Logits of 4 sequences (a full bucket: the GEMMs have the eager step's shapes) decoding
    ``steps`` steps: forks of one sealed 40-row prefix (``shared``: a cascade plan, several
    query rows per work item) or 4 separate prompts."""
    runner = llm.runner
    if shared:
        parent = llm.cache.new_chain()
        runner.forward([StepInput(parent, list(range(5, 45)))])
        parent.seal()
        chains = [parent.fork() for _ in range(4)]
    else:
        chains = [llm.cache.new_chain() for _ in range(4)]
        for i, chain in enumerate(chains):
            runner.forward([StepInput(chain, list(range(5 + i, 30 + 3 * i)))])
    out = [runner.forward([StepInput(c, [7 + i + s]) for i, c in enumerate(chains)]) for s in range(steps)]
    return torch.stack(out)


def test_one_row_work_items_replay_narrow_graphs_and_shared_prefixes_wide_ones(tmp_path):
    """Decode plans with one query row per work item replay a "narrow" graph, whose attention
    tiles are the eager step's (same rounding: bit-equal logits in float32); forks of a shared
    prefix (cascade: several rows per work item) replay a "wide" graph of the same bucket."""
    build_model_dir(tmp_path, "qwen3")
    eager, graph = _llm(tmp_path), _llm(tmp_path, cuda_graphs=MODE)
    separate = _decode_logits(graph, shared=False)
    assert list(graph.runner.graphs._buckets) == [(4, False, True)]  # stage 1 merges: no merge launch
    assert torch.equal(separate, _decode_logits(eager, shared=False))
    forks = _decode_logits(graph, shared=True)
    assert graph.runner.last_plan.route.value == "cascade" and (4, True, False) in graph.runner.graphs._buckets
    reference = _decode_logits(eager, shared=True)
    torch.testing.assert_close(forks, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(forks.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("kv_heads,latent", [(8, False), (1, False), (1, True)])
def test_graph_buckets_hold_every_decode_plan_of_their_size(kv_heads, latent):
    """A bucket's work-item room (``max_graph_work_items``) covers the planner's decode plans on
    an H200-sized device: independent sequences of 100 to 128K rows (narrow buckets), and forks
    of a history sealed into up to 100 segments (wide ones); yet an 8-KV-head model's narrow
    batch-1 bucket is an eighth of a latent one's (its idle programs cost every layer's launch)."""
    from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
    from segkv.cache.segment import ChainSpan
    from segkv.runner.cuda_graphs import max_graph_work_items

    device = DeviceSpec(kind="cuda", name="H200-sized", num_multiprocessors=132, blocks_per_multiprocessor=2,
                        min_rows_per_partition=64, min_rows_per_latent_partition=32, max_partitions=256,
                        max_query_rows_per_work=64, partition_overhead_rows=256)
    shape = AttentionShape(16, 1, 576, 512) if latent else AttentionShape(4 * kv_heads, kv_heads, 128, 128)
    fullest = 0.0
    for batch in (1, 3, 8, 16, 32, 64):
        room = max_graph_work_items(device, batch, kv_heads=kv_heads, latent=latent)
        for context in (100, 1024, 4096, 16384, 65536, 131072):
            queries, first = [], 0
            for seq in range(batch):
                rows = context + 37 * seq
                pages = tuple(range(first, first + -(-rows // 32)))
                first += len(pages)
                queries.append(SequenceQuery((ChainSpan(seq, pages, rows, 0, sealed=False),), 1))
            plan = plan_attention(queries, shape, device, page_size=32)
            assert len(plan.work) <= room, (batch, context, len(plan.work), room)
            fullest = max(fullest, len(plan.work) / room)
    assert fullest > 0.45  # room no larger than plans come close to needing
    assert max_graph_work_items(device, 1, kv_heads=8, latent=False) == 66
    assert max_graph_work_items(device, 1, kv_heads=1, latent=True) == 256
    # forks of one segmented history (a tree search, turns sealed as segments): cascade plans in
    # wide buckets, whose pieces follow the shared segments
    for forks, segments, rows in ((2, 100, 512), (8, 30, 1024), (8, 1, 32768), (16, 8, 8192), (32, 100, 512)):
        shared, first = [], 0
        for seg in range(segments):
            pages = tuple(range(first, first + rows // 32))
            first += len(pages)
            shared.append(ChainSpan(seg, pages, rows, seg * rows, sealed=True))
        queries = []
        for fork in range(forks):
            own = ChainSpan(1000 + fork, tuple(range(first, first + 16)), 500, segments * rows, sealed=False)
            first += 16
            queries.append(SequenceQuery((*shared, own), 1))
        plan = plan_attention(queries, shape, device, page_size=32)
        assert plan.max_work_rows > 1  # wide: the shared pieces serve every fork's row
        bucket = 1 << (forks - 1).bit_length()
        room = max_graph_work_items(device, bucket, kv_heads=kv_heads, latent=latent, wide=True)
        assert len(plan.work) <= room, (forks, segments, len(plan.work), room)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _tokens(llm, prompts, params):
    return [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, params)]


def test_verify_windows_replay_window_graphs_and_give_the_plain_tokens(tmp_path):
    """n-gram windows of up to 4 rows (fewer when fewer drafts match: padded) replay the window
    graphs; forks of one long prompt (a shared prefix: cascade plans) replay the wide ones."""
    build_model_dir(tmp_path, "qwen3")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10], [8, 8, 1]]  # loops: the n-grams match
    forks = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2)
    # 46 rows: more than a page shared by the two samples; its loop at the end has the n-grams
    # match at once, so the first windows of the forks hold 3 rows each: 6 rows on a shared piece
    # (wider than a window: the wide graph)
    long_prompt = [[3, 1, 4, 1, 5, 9, 2, 6] * 5 + [172, 172, 172, 155, 172, 155]]
    plain = _llm(tmp_path, backend="auto")  # plain decoding: the torch oracle on the CPU (Triton on a GPU)
    want = _tokens(plain, prompts, params), _tokens(plain, long_prompt, forks)
    llm = _llm(tmp_path, cuda_graphs=MODE, speculative_config=NGRAM)
    graphs = llm.runner.graphs
    assert graphs.windows == (4,) and llm.runner.decode_rows_threshold == 4
    assert (_tokens(llm, prompts, params), _tokens(llm, long_prompt, forks)) == want
    assert llm.generator.spec_stats.drafts > 0 and graphs.window_replays > 0
    assert (4, 4, False) in graphs.window_captured and (2, 4, True) in graphs.window_captured
    assert llm.cache.stats()["pages_in_use"] == 2  # the graphs' two scratch chains only


def test_mtp_drafting_reads_the_hidden_states_of_graph_replays():
    """The MTP drafter's hidden states come from the graphs' static buffer (decode and window
    steps replay, none but the prefill runs eagerly), the MTP layer's own forwards replay MTP
    graphs (its catch-up after the prompt runs eagerly), and the tokens are plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    prompts = ["    return a + b\n\n\ndef sub("]  # 10 tokens: the 7 generated cross a page end
    want = _tokens(LLM("default-mla", dtype="float32"), prompts, params)
    llm = _llm("default-mla", cuda_graphs=MODE, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert _tokens(llm, prompts, params) == want
    stats, graphs = llm.generator.spec_stats, llm.runner.graphs
    assert stats.drafts > 0 and stats.accepted_tokens > 0
    assert graphs.window_replays > 0 and graphs.fallbacks == 0
    (mtp,) = llm.generator.proposer.mtp.graphs  # the MTP layer's forwards replay graphs of their own
    assert mtp.replays > mtp.window_replays > 0 and mtp.fallbacks == 0  # draft steps and catch-ups


def test_a_draft_model_decodes_and_catches_up_through_its_own_graphs(tmp_path):
    """The draft runner follows the target's graphs: draft steps replay decode buckets and the
    catch-up after a window (the accepted drafts and the pending token) replays window ones."""
    build_model_dir(tmp_path, "qwen3")
    # 8 tokens: more than one window of 3 rows (2 drafts and the bonus token) per sequence, so
    # draft steps and the catch-up after a window both run
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10]]
    want = _tokens(_llm(tmp_path, backend="auto"), prompts, params)  # plain decoding (the oracle on the CPU)
    llm = _llm(tmp_path, cuda_graphs=MODE,
               speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})
    assert _tokens(llm, prompts, params) == want
    draft = llm.generator.proposer.runner.graphs
    assert draft is not None and draft.windows == (3,)
    assert draft.replays > 0 and draft.window_replays > 0
    assert llm.generator.spec_stats.accepted_tokens > 0  # the model drafting for itself
