"""Shared by the model tests of the one-row decode paths (split-K GEMVs, per-head latent
GEMVs): taking those paths on the CPU, counting kernel calls, and comparing a
model with them against one without."""

from __future__ import annotations

import torch

from gpu_helpers import GPU, GRAPHS  # noqa: F401  (GRAPHS: for the model tests that import it from here)
# small models' LLM settings for these comparisons; a fused DeepSeek model runs its decode graphs
# (emulated on the CPU)
LLM_SETTINGS = {"device": "cuda" if GPU else "cpu", "dtype": "float32", "backend": "triton", "page_size": 16,
                "num_pages": 64, "prefill_chunk": 8}


def small_deepseek_dir(tmp_path, num_hidden_layers: int) -> None:
    """A DeepSeek model in ``tmp_path``: a dense first layer, then routed (4, 2 per token) and
    shared experts."""
    from model_helpers import build_deepseek_dir

    build_deepseek_dir(tmp_path, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                       num_hidden_layers=num_hidden_layers)


def llm(tmp_path, *, fused_ops: bool, **settings):
    """The model in ``tmp_path`` as an ``LLM`` with :data:`LLM_SETTINGS` (``settings`` added)."""
    from segkv.engine import LLM

    return LLM(tmp_path, fused_ops=fused_ops, **LLM_SETTINGS, **settings)


def gemvs_on_the_cpu_too(monkeypatch):
    """The one-row GEMV paths taken on the CPU too (in Triton's interpreter), for model tests.

    The interpreter runs a launch's programs one after another, so the whole-row launches take 16
    rows a program here instead of 4: a quarter of the programs for the same kernel code. The
    kernel tests in ``test_dense_gemv`` cover the default 4 rows, the GPU tests the models with it."""
    from segkv.layers import linear

    monkeypatch.setattr(linear, "one_row", lambda x, w, b=None: b is None and x.dim() == 2 and x.shape[0] == 1
                        and x.is_contiguous() and x.dtype == w.dtype)
    monkeypatch.setattr(linear, "WHOLE_ROWS", 16)


def counted(monkeypatch, **targets):
    """Count the calls of ``targets`` (``key=(module, function name)``): the returned dict holds them."""
    calls = dict.fromkeys(targets, 0)
    for key, (module, name) in targets.items():
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _k=key, **k: calls.__setitem__(_k, calls[_k] + 1)
                            or _f(*a, **k))
    return calls


def same_logits_one_token_at_a_time(plain, fused) -> int:
    """Both models fed the same tokens one at a time give the same logits; returns how many tokens."""
    chains = [llm.cache.new_chain() for llm in (plain, fused)]
    tokens = (5, 9)
    for token in tokens:
        rows = [llm.runner.prompt_logits(chain, [token]) for llm, chain in zip((plain, fused), chains)]
        assert torch.isfinite(rows[1]).all()
        torch.testing.assert_close(rows[1], rows[0], rtol=1e-4, atol=1e-4)
    return len(tokens)


def same_greedy_tokens(plain, fused):
    from segkv.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)  # two decode steps
    prompt = [[3, 1, 4, 1, 5, 9]]
    assert ([o.outputs[0].token_ids for o in fused.generate(prompt, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompt, params)])
