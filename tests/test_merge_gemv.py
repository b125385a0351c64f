"""The output projection that merges a batch-1 row's attention partials itself
(``kernels.merge_gemv``, ``SEGKV_MERGE_INTO_O``) against the merge launch followed by the product."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_helpers import write_rows

from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.attention.triton_backend import TritonBackend
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def _one_row_attention(gen, dtype, *, heads=8, kv_heads=2, head_dim=64, rows=300, page_size=16, partitions=12):
    """One decode row over ``rows`` of history, split in ``partitions`` (more than stage 1 merges
    itself, so a merge launch is due): the backend, its prepared plan and the run's tensors."""
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=64), device=DEVICE,
                         compaction=CompactionPolicy(enabled=False))
    chain = cache.new_chain()
    write_rows(cache, chain, rows, gen)
    shape = AttentionShape(heads, kv_heads, head_dim, head_dim)
    plan = plan_attention([SequenceQuery.from_chain(chain, 1)], shape, DeviceSpec.cuda() if GPU else DeviceSpec.cpu(),
                          page_size=page_size, route="split", num_partitions=partitions)
    assert plan.num_partitions == partitions
    backend = TritonBackend(page_size=page_size, device=DEVICE, poison=True)
    q = torch.randn(1, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    args = (backend.prepare(plan), q, cache.storage.key_cache(0), cache.storage.value_cache(0))
    return backend, args, head_dim**-0.5


def _weight(gen, out_dim, in_dim, dtype):
    return (torch.randn(out_dim, in_dim, generator=gen) / in_dim**0.5).to(dtype).to(DEVICE)


def _close_to_the_product(y, x, w):
    """``y`` is ``x @ w.T`` (float64) up to one rounding of a float32 sum to ``y``'s dtype."""
    ref = x.reshape(1, -1).double() @ w.double().T
    assert torch.isfinite(y).all()
    tol = 2.0**-7 if y.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n,block_p", [(16, 4), (64, 16)])
def test_the_product_of_a_deferred_merge_is_the_product_of_the_merged_row(dtype, block_n, block_p, gen):
    """A split batch-1 row run with ``defer_merge`` launches no merge and comes back pending; the
    product that merges it equals the product of the merged row (the merge launch's output, which
    ``resolve`` reproduces exactly), for output blocks that do and do not fill ``block_n``, the 12
    partials in one step or three."""
    from segkv.kernels.merge_gemv import merge_splitk_gemv, merge_workspace_size
    from segkv.kernels.partials_merge import PendingMerge

    backend, args, scale = _one_row_attention(gen, dtype)
    merged, lse = backend.run(*args, scale=scale)
    pending, none = backend.run(*args, scale=scale, defer_merge=True)
    assert isinstance(pending, PendingMerge) and none is None
    assert torch.isnan(pending.out).all()  # poisoned, and no merge wrote it
    assert torch.equal(pending.resolve(), merged) and not torch.isnan(merged).any()
    pending, _ = backend.run(*args, scale=scale, defer_merge=True)  # resolve wrote its output
    for out_dim in (96, 100):
        w = _weight(gen, out_dim, merged[0].numel(), dtype)
        floats, tickets = merge_workspace_size(out_dim, 8, 64, block_n)
        workspace = (torch.full((floats,), float("nan"), device=DEVICE),
                     torch.zeros(tickets, dtype=torch.int32, device=DEVICE))
        for _ in range(2):  # the tickets are back to 0 after a launch
            y = merge_splitk_gemv(pending, w, block_n=block_n, num_warps=4, block_p=block_p, workspace=workspace)
            assert y.shape == (1, out_dim) and y.dtype == dtype and not workspace[1].any()
            _close_to_the_product(y, merged, w)
            unfused = merged.reshape(1, -1) @ w.T
            tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(y, unfused, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_merging_product_reads_a_single_partial_from_the_output_and_weighs_masked_ones_zero(dtype, gen):
    """Hand-made pending merges: a row whose only partial stage 1 wrote to the output (the
    partial buffers are NaN and must not be read), a row without partials (0), and a row whose
    partials (listed out of order) include fully masked ones (LSE -inf, NaN outputs: weight 0)
    and a head with none live (0)."""
    from segkv.attention.merge import merge_states
    from segkv.kernels.merge_gemv import merge_splitk_gemv
    from segkv.kernels.partials_merge import PendingMerge

    heads, dv, out_dim = 4, 32, 48
    w = _weight(gen, out_dim, heads * dv, dtype)
    out = torch.randn(1, heads, dv, generator=gen).to(DEVICE)  # float32, rounded by the product
    nan = torch.full((3, heads, dv), float("nan"), device=DEVICE)
    ints = lambda *v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    single = PendingMerge(out, nan, nan[:, :, 0], ints(0, 1), ints(2), dtype)
    _close_to_the_product(merge_splitk_gemv(single, w, block_n=16, num_warps=4), out.to(dtype), w)
    empty = PendingMerge(out, nan, nan[:, :, 0], ints(0, 0), ints(0), dtype)
    assert torch.equal(merge_splitk_gemv(empty, w, block_n=16, num_warps=4), torch.zeros(1, out_dim, dtype=dtype,
                                                                                          device=DEVICE))
    part_out = torch.randn(3, heads, dv, generator=gen).to(DEVICE)
    part_lse = torch.randn(3, heads, generator=gen).to(DEVICE)
    part_lse[1] = float("-inf")  # partial 1 saw no key of any head
    part_out[1] = float("nan")
    part_lse[:, 3] = float("-inf")  # head 3 saw no key at all
    pending = PendingMerge(out, part_out, part_lse, ints(0, 3), ints(2, 1, 0), dtype)
    expected, _ = merge_states(torch.where(torch.isinf(part_lse)[..., None], 0.0, part_out), part_lse)
    assert torch.equal(expected[3], torch.zeros(dv, device=DEVICE))
    y = merge_splitk_gemv(pending, w, block_n=16, num_warps=4)
    _close_to_the_product(y, expected.to(dtype), w)


def test_the_merging_product_refuses_what_it_cannot_take(gen):
    from segkv.kernels.merge_gemv import merge_splitk_gemv
    from segkv.kernels.partials_merge import PendingMerge

    out = torch.zeros(2, 4, 32, device=DEVICE)
    parts = torch.zeros(3, 4, 32, device=DEVICE)
    ints = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    w = _weight(gen, 16, 128, torch.float32)
    with pytest.raises(ValueError, match="one query row"):
        merge_splitk_gemv(PendingMerge(out, parts, parts[:, :, 0], ints, ints, torch.float32), w)
    one = PendingMerge(out[:1], parts, parts[:, :, 0], ints, ints, torch.float32)
    with pytest.raises(ValueError, match="4 heads of 32"):
        merge_splitk_gemv(one, w[:, :96])
    with pytest.raises(ValueError, match="bfloat16"):
        merge_splitk_gemv(one, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="workspace"):
        merge_splitk_gemv(one, w, block_n=16, workspace=(torch.zeros(1, device=DEVICE), ints))


def test_decoder_merging_in_its_o_product_gives_the_logits_of_the_merge_launch(tmp_path, monkeypatch):
    """``SEGKV_MERGE_INTO_O``: a grouped-query model decoding one row at a time over a split
    history whose merge would launch (stage 1 merging none itself here) leaves each layer's merge
    to its o product (on the CPU too, for this test), launches no merge, and gives the logits and
    greedy tokens of the model with the merge launch."""
    from model_helpers import build_model_dir
    from one_row_helpers import counted, gemvs_on_the_cpu_too, llm

    from segkv.attention import triton_backend
    from segkv.kernels import merge_gemv, paged_attention
    from segkv.layers import linear
    from segkv.sampling_params import SamplingParams

    build_model_dir(tmp_path, "llama3.1")
    monkeypatch.setenv("SEGKV_ATTENTION_ROUTE", "split")
    monkeypatch.setattr(triton_backend, "stage1_merge_bound", lambda: 0)  # every split row: a merge launch
    monkeypatch.setattr(linear, "BATCH1_FUSED_GEMV", True)
    gemvs_on_the_cpu_too(monkeypatch)
    model = llm(tmp_path, fused_ops=True)
    # the CPU splits only very long pieces: split 64 rows
    model.runner.device_spec = dataclasses.replace(model.runner.device_spec, num_multiprocessors=16,
                                                   min_rows_per_partition=16, max_partitions=16,
                                                   partition_overhead_rows=1)
    prompt = [int(t) for t in torch.randint(3, 200, (64,), generator=torch.Generator().manual_seed(7))]
    chains = [model.cache.new_chain() for _ in range(2)]  # with the merge launch / merging in o
    for chain in chains:
        model.runner.prompt_logits(chain, prompt)
    calls = counted(monkeypatch, fused=(merge_gemv, "merge_splitk_gemv"), merges=(paged_attention, "merge_into"))
    layers = model.runner.model.cfg.num_layers
    for token in (5, 9):
        monkeypatch.setattr(merge_gemv, "MERGE_INTO_O", False)
        expected = model.runner.prompt_logits(chains[0], [token])
        assert calls == {"fused": 0, "merges": layers}  # each layer's split row merged by a launch
        monkeypatch.setattr(merge_gemv, "MERGE_INTO_O", True)
        got = model.runner.prompt_logits(chains[1], [token])
        assert calls == {"fused": layers, "merges": layers}
        calls.update(fused=0, merges=0)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for chain in chains:
        chain.release()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    merged = [o.outputs[0].token_ids for o in model.generate([prompt], params)]
    assert calls["fused"] >= layers  # the decode step merged in o
    monkeypatch.setattr(merge_gemv, "MERGE_INTO_O", False)
    assert merged == [o.outputs[0].token_ids for o in model.generate([prompt], params)]
