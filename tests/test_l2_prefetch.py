"""The L2 prefetch hint (``kernels.l2_prefetch``): it never changes results, asks for the bytes
it says, and the decoder asks for the output projection's weight at one row when it is on."""

from __future__ import annotations

import pytest
import torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def test_prefetch_asks_for_whole_16_byte_units_and_leaves_the_data_alone(gen):
    from segkv.kernels.l2_prefetch import l2_prefetch, supported

    w = torch.randn(1000, 300, generator=gen).to(torch.bfloat16).to(DEVICE)
    before = w.clone()
    asked = l2_prefetch(w)
    if supported(w):
        assert asked == w.numel() * 2 // 16 * 16
        assert l2_prefetch(w, max_bytes=1000) == 992
        assert l2_prefetch(w, max_bytes=10) == 0
        torch.cuda.synchronize()
    else:  # a hint with nothing to do on the CPU or in the interpreter
        assert asked == 0
    assert torch.equal(w, before)


def test_prefetch_rejects_what_it_cannot_read():
    from segkv.kernels.l2_prefetch import l2_prefetch

    w = torch.zeros(8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(w.T)
    with pytest.raises(ValueError, match="max_bytes"):
        l2_prefetch(w, max_bytes=-1)


def test_decoder_prefetching_its_output_weight_gives_the_same_logits(tmp_path, monkeypatch):
    """``SEGKV_BATCH1_PREFETCH_MB``: each layer at one row asks for its o weight before attention
    (on the GPU the kernel runs, graphs included); logits and greedy tokens are unchanged."""
    from model_helpers import build_model_dir
    from one_row_helpers import (
        counted,
        gemvs_on_the_cpu_too,
        llm,
        same_greedy_tokens,
        same_logits_one_token_at_a_time,
    )

    from segkv.kernels import l2_prefetch
    from segkv.layers import linear

    build_model_dir(tmp_path, "llama3.1")
    plain = llm(tmp_path, fused_ops=False)
    monkeypatch.setattr(linear, "BATCH1_PREFETCH_MB", 64)
    gemvs_on_the_cpu_too(monkeypatch)
    calls = counted(monkeypatch, prefetch=(l2_prefetch, "l2_prefetch"))
    fused = llm(tmp_path, fused_ops=True)
    layers = fused.runner.model.cfg.num_layers
    same_logits_one_token_at_a_time(plain, fused)
    assert calls == {"prefetch": 3 * layers}  # one per layer and token
    same_greedy_tokens(plain, fused)


def test_mla_model_prefetching_its_output_weight_gives_the_same_logits(tmp_path, monkeypatch):
    """The same for a DeepSeek model at one token (the x launch with RoPE, then the prefetch)."""
    from one_row_helpers import (
        GRAPHS,
        counted,
        gemvs_on_the_cpu_too,
        llm,
        same_greedy_tokens,
        same_logits_one_token_at_a_time,
        small_deepseek_dir,
    )

    from segkv.kernels import l2_prefetch
    from segkv.layers import linear, mla

    small_deepseek_dir(tmp_path, num_hidden_layers=3)
    plain = llm(tmp_path, fused_ops=False, cuda_graphs=False)
    monkeypatch.setattr(linear, "BATCH1_PREFETCH_MB", 64)
    monkeypatch.setattr(mla, "MLA_ROPE", True)
    gemvs_on_the_cpu_too(monkeypatch)
    calls = counted(monkeypatch, prefetch=(l2_prefetch, "l2_prefetch"))
    fused = llm(tmp_path, fused_ops=True, cuda_graphs=GRAPHS)
    layers = fused.runner.model.cfg.num_layers
    same_logits_one_token_at_a_time(plain, fused)
    assert calls == {"prefetch": 3 * layers}
    same_greedy_tokens(plain, fused)
