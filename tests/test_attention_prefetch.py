"""The stage-1 kernels' L2 prefetch of each work item's first tiles before the PDL wait
(``SEGKV_ATTENTION_PREFETCH_TILES``): where it is launched, where it sits in the compiled kernel,
and (on the GPU) that it changes no result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from segkv.kernels import paged_attention

GPU = torch.cuda.is_available()


def test_prefetch_is_launched_only_where_bulk_prefetches_run(monkeypatch):
    """Off by default; asked for, only for 16-bit, 16-byte aligned caches of a launch that waits
    under PDL after reading its plan (a Hopper or later GPU, never the interpreter or the CPU)."""
    device = "cuda" if GPU else "cpu"
    query = torch.zeros(1, 8, 128, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16, device=device)
    assert paged_attention.PREFETCH_TILES == 0
    assert paged_attention.prefetch_option(query, (cache,), (128,), True) == {"PREFETCH": 0}
    monkeypatch.setattr(paged_attention, "PREFETCH_TILES", 2)
    pdl = paged_attention.attention_pdl_options(query)["USE_PDL"]
    assert pdl == (GPU and torch.cuda.get_device_capability()[0] >= 9 and os.environ.get("TRITON_INTERPRET") != "1")
    assert paged_attention.prefetch_option(query, (cache,), (128,), True) == {"PREFETCH": 2 if pdl else 0}
    assert paged_attention.prefetch_option(query, (cache,), (128,), False) == {"PREFETCH": 0}  # plan read late
    assert paged_attention.prefetch_option(query, (cache.float(),), (128,), True) == {"PREFETCH": 0}
    assert paged_attention.prefetch_option(query, (cache[..., 1:],), (127,), True) == {"PREFETCH": 0}  # unaligned


def test_prefetches_compile_before_the_wait():
    """Compiled for sm_90 (no GPU needed; outside the interpreter, in a subprocess): the GQA
    stage 1 asks for K and V rows of each of its first tiles, the latent one for the latent rows,
    all before ``griddepcontrol.wait``; with the default 0 there is no prefetch at all."""
    gqa = {"kernel": "gqa", "dtype": "bfloat16", "page_size": 16, "rows": 1, "head_dim": 128, "group": 4, "pdl": True}
    latent = {"kernel": "latent", "dtype": "bfloat16", "page_size": 32, "rows": 1, "one_query": True, "pdl": True,
              "rank": 128, "rope": 64}
    cases = [{**gqa, "prefetch": 0}, {**gqa, "prefetch": 2}, {**latent, "prefetch": 4}]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "segkv.kernels.offline_compile"], input=json.dumps(cases),
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    orders = [json.loads(line)["order"] for line in run.stdout.splitlines()]
    assert orders[0] == ["wait", "launch_dependents"]
    assert orders[1] == ["prefetch"] * 4 + ["wait", "launch_dependents"]  # K and V of two tiles
    assert orders[2] == ["prefetch"] * 4 + ["wait", "launch_dependents"]  # four latent tiles


@pytest.mark.skipif(not GPU, reason="bulk prefetches need the GPU")
@pytest.mark.parametrize("tiles", [1, 4])
def test_prefetch_changes_no_result(tiles, gen, monkeypatch):
    """The same plans with and without the prefetch give bit-equal outputs and LSEs: GQA at pages
    of 16 and 128 (a page longer than the tile), latent at pages of 32."""
    from attention_helpers import triton_and_reference
    from test_triton_attention import check, gqa_batch
    from test_triton_mla import latent_batch

    from segkv.attention import AttentionShape, DeviceSpec, plan_attention
    from segkv.attention.triton_backend import TritonBackend

    def run(plan, q, k, v, page_size, scale):
        tb = TritonBackend(page_size=page_size, device="cuda", poison=True)
        return tb.run(tb.prepare(plan), q, k, v, scale=scale)

    for page_size in (16, 128):
        batch = gqa_batch(gen, dtype=torch.bfloat16, page_size=page_size, ratio=4, head_dim=128, rows=1)
        plan = plan_attention(batch.queries, batch.shape, DeviceSpec.cuda(), page_size=page_size, route="split",
                              num_partitions=3)
        k, v = batch.cache.storage.key_cache(0), batch.cache.storage.value_cache(0)
        monkeypatch.setattr(paged_attention, "PREFETCH_TILES", 0)
        base = run(plan, batch.query, k, v, page_size, batch.scale)
        monkeypatch.setattr(paged_attention, "PREFETCH_TILES", tiles)
        assert paged_attention.prefetch_option(batch.query, (k, v), (128, 128), True)["PREFETCH"] == tiles
        with_prefetch = run(plan, batch.query, k, v, page_size, batch.scale)
        assert torch.equal(base[0], with_prefetch[0]) and torch.equal(base[1], with_prefetch[1])
        out, lse, ref, ref_lse = triton_and_reference(plan, batch.query, k, v, page_size=page_size,
                                                      scale=batch.scale, device="cuda")
        check(out, lse, ref, ref_lse)  # and against the reference
    cache, _, queries = latent_batch(gen, dtype=torch.bfloat16, page_size=32, rows=1)
    shape = AttentionShape(16, 1, 576, 512)
    plan = plan_attention(queries, shape, DeviceSpec.cuda(), page_size=32, route="split", num_partitions=3)
    q = (0.5 * torch.randn(plan.num_query_rows, 16, 576, generator=gen)).to(torch.bfloat16).cuda()
    k, v = cache.storage.key_cache(0), cache.storage.value_cache(0)
    monkeypatch.setattr(paged_attention, "PREFETCH_TILES", 0)
    base = run(plan, q, k, v, 32, 576**-0.5)
    monkeypatch.setattr(paged_attention, "PREFETCH_TILES", tiles)
    with_prefetch = run(plan, q, k, v, 32, 576**-0.5)
    assert torch.equal(base[0], with_prefetch[0]) and torch.equal(base[1], with_prefetch[1])
    assert not torch.isnan(base[0]).any()
