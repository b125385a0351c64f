"""The fused decode kernels against the layers' torch code they replace (interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_helpers import DEVICE, GPU
from segkv.kernels.fused.fused_ops import (kind_of, mla_rope_and_write_latent, rms_norm, rope_and_write_kv,
                                     round_to_kind, silu_and_mul)
from segkv.layers.norm import RMSNorm
from segkv.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_same_rounding(out: torch.Tensor, ref: torch.Tensor, *, min_equal: float = 0.99) -> None:
    """Same dtype and shape, finite, and within two units of the last place (of the value, or of
    the largest value where a difference cancels). In bf16/fp16 at least
    ``min_equal`` of the values are bit-equal: only a float32 sum or a transcendental function
    that lands the other side of a rounding tie may differ. Float32 results keep those float32
    differences (a few units of the last place)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    if out.dtype != torch.float32:
        equal = (out == ref).float().mean().item()
        assert equal >= min_equal, f"only {equal:.4f} of the values are equal"
    ulp = {torch.float32: 2.0**-21, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[out.dtype]
    diff = (out.double() - ref.double()).abs()
    scale = ref.double().abs() + ref.double().abs().amax()
    assert (diff <= 2 * ulp * scale).all(), float(diff.max())


@triton.jit
def _round_kernel(X, Y, N, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    tl.store(Y + offs, round_to_kind(tl.load(X + offs, mask=ok), KIND), mask=ok)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_in_kernel_rounding_equals_a_torch_cast(dtype, gen):
    """The kernels' rounding of float32 values to float16/bfloat16 (on the bits) is the cast's,
    across magnitudes: float16 subnormals and overflow to infinity included."""
    scales = (1e-8, 1e-6, 1e-5, 1e-3, 1.0, 100.0, 3e4, 1e6)
    x = torch.cat([torch.randn(4096, generator=gen) * s for s in scales]).to(DEVICE)
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), KIND=kind_of(dtype), BLOCK=1024)
    assert torch.equal(y, x.to(dtype).float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 48)] + ([(7, 4096)] if GPU else []))
def test_rms_norm_matches_the_module(dtype, shape, gen):
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)
    norm = RMSNorm(shape[-1], eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen) * 0.5 + 1)
    norm = norm.to(dtype)
    out, res = rms_norm(x, norm.weight, norm.eps)
    assert res is None
    assert_same_rounding(out, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_matches_add_then_norm(dtype, gen):
    x = torch.randn(4, 96, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(4, 96, generator=gen).to(dtype).to(DEVICE)
    norm = RMSNorm(96).to(DEVICE).to(dtype)
    out, s = rms_norm(x, norm.weight, norm.eps, residual=residual)
    assert torch.equal(s, residual + x)  # one rounding of the sum, as torch's add
    assert_same_rounding(out, norm(residual + x))


def test_rms_norm_float32_weight_promotes_like_the_module(gen):
    x = torch.randn(2, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    norm = RMSNorm(32).to(DEVICE)  # float32 weight: the module's product is float32
    out, _ = rms_norm(x, norm.weight, norm.eps)
    assert_same_rounding(out, norm(x))


def test_rms_norm_rejects_bad_shapes(gen):
    x = torch.randn(2, 8, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, residual=torch.zeros(2, 4, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [40, 1100])
def test_silu_and_mul_matches_torch(dtype, inner, gen):
    x = (torch.randn(3, 2 * inner, generator=gen) * 4).to(dtype).to(DEVICE)
    ref = F.silu(x[:, :inner]) * x[:, inner:]
    assert_same_rounding(silu_and_mul(x), ref)


def test_silu_and_mul_rejects_odd_widths():
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(torch.zeros(2, 5, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,dim", [(4, 2, 16), (8, 8, 64)] + ([(32, 8, 128)] if GPU else []))
def test_rope_and_write_kv_matches_rotary_and_cache_write(dtype, hq, hkv, dim, gen):
    tokens, slots_total = 5, 40
    rotary = RotaryEmbedding(dim, base=10000.0, max_position=131072,
                             scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    rotary.init_buffers(DEVICE)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=1)  # strided views, as the packed GEMM gives
    q, k, v = q.view(tokens, hq, dim), k.view(tokens, hkv, dim), v.view(tokens, hkv, dim)
    positions = torch.tensor([0, 1, 7, 3999, 131071], device=DEVICE)  # long contexts: large angles
    slots = torch.randperm(slots_total, generator=gen)[:tokens].to(DEVICE)
    keys = torch.full((slots_total, hkv, dim), float("nan"), dtype=dtype, device=DEVICE)
    values = keys.clone()
    q_out = rope_and_write_kv(q, k, v, positions, rotary.cos_sin_table(dtype), slots, keys, values)
    assert torch.equal(q_out, rotary(q, positions))  # the same cos/sin, each product rounded as torch does
    assert torch.equal(keys[slots], rotary(k, positions))
    assert torch.equal(values[slots], v)
    untouched = torch.ones(slots_total, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert keys[untouched].isnan().all() and values[untouched].isnan().all()  # no other row written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,dim", [(4, 2, 16)] + ([(32, 8, 128)] if GPU else []))
def test_rope_and_write_kv_with_head_norms_matches_norm_then_rope(dtype, hq, hkv, dim, gen):
    """``q_norm``/``k_norm`` (Qwen3): each head RMS-normed in the RoPE launch equals ``rms_norm``
    per head, then ``rope_and_write_kv`` without norms, within one rounding of the dtype (the mean
    square is summed as two halves); values written unchanged; nothing else written."""
    tokens, slots_total = 4, 30
    rotary = RotaryEmbedding(dim, base=1000000.0, max_position=40960)
    rotary.init_buffers(DEVICE)
    qkv = (3 * torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen)).to(dtype).to(DEVICE)
    q, k, v = (part.view(tokens, -1, dim) for part in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=1))
    q_norm, k_norm = ((torch.rand(dim, generator=gen) + 0.5).to(dtype).to(DEVICE) for _ in range(2))
    positions = torch.tensor([0, 3, 1000, 40959], device=DEVICE)
    slots = torch.randperm(slots_total, generator=gen)[:tokens].to(DEVICE)
    table = rotary.cos_sin_table(dtype)

    def fresh_rows():
        return (torch.full((slots_total, hkv, dim), float("nan"), dtype=dtype, device=DEVICE),
                torch.full((slots_total, hkv, dim), float("nan"), dtype=dtype, device=DEVICE))

    keys_ref, values_ref = fresh_rows()
    q_ref = rope_and_write_kv(rms_norm(q, q_norm, 1e-6)[0], rms_norm(k, k_norm, 1e-5)[0], v, positions, table,
                              slots, keys_ref, values_ref)
    keys, values = fresh_rows()
    q_out = rope_and_write_kv(q, k, v, positions, table, slots, keys, values, q_norm=q_norm, k_norm=k_norm,
                              q_eps=1e-6, k_eps=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-6  # one rounding of a value of magnitude ~2
    for got, want in ((q_out, q_ref), (keys[slots], keys_ref[slots])):
        assert not got.isnan().any()
        assert (got.double() - want.double()).abs().max() <= tol * want.double().abs().max()
    assert not torch.equal(q_out, rope_and_write_kv(q, k, v, positions, table, slots, *fresh_rows()))  # normed
    assert torch.equal(values[slots], v)
    untouched = torch.ones(slots_total, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert keys[untouched].isnan().all() and values[untouched].isnan().all()
    with pytest.raises(ValueError, match="norm weights"):
        rope_and_write_kv(q, k, v, positions, table, slots, keys, values, q_norm=q_norm)
    with pytest.raises(ValueError, match="norm weights"):
        rope_and_write_kv(q, k, v, positions, table, slots, keys, values, q_norm=q_norm[:-1], k_norm=k_norm)


def test_rope_and_write_kv_rejects_mismatched_shapes():
    q = torch.zeros(2, 4, 16, device=DEVICE)
    k = torch.zeros(2, 2, 16, device=DEVICE)
    rows = torch.zeros(8, 2, 16, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.long, device=DEVICE)
    table = torch.ones(32, 16, device=DEVICE)
    with pytest.raises(ValueError, match="cos_sin"):
        rope_and_write_kv(q, k, k, slots, table[:, :8], slots, rows, rows)
    with pytest.raises(ValueError, match="dtype"):
        rope_and_write_kv(q, k, k, slots, table.half(), slots, rows, rows)
    with pytest.raises(ValueError, match="cache rows"):
        rope_and_write_kv(q, k, k, slots, table, slots, rows[:, :1], rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads,rank,rope", [(3, 24, 16)] + ([(16, 512, 64)] if GPU else []))
def test_mla_rope_and_write_latent_matches_rotary_and_cache_write(dtype, interleaved, heads, rank, rope, gen):
    """The latent path's RoPE and cache write in one kernel: the rotated query rope part and the
    latent row ``[c_kv | rope(k_pe)]`` bit-equal to the torch layers' (DeepSeek's interleaved
    pairs and the half-split kind), nothing else written."""
    tokens, slots_total = 5, 40
    rotary = RotaryEmbedding(rope, base=10000.0, max_position=163840, interleaved=interleaved,
                             scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
    rotary.init_buffers(DEVICE)
    q = torch.randn(tokens, heads, 8 + rope, generator=gen).to(dtype).to(DEVICE)  # [nope | rope] per head
    kv_a = torch.randn(tokens, rank + rope, generator=gen).to(dtype).to(DEVICE)  # [c_kv | k_pe]
    q_pe, (c_kv, k_pe) = q[..., 8:], kv_a.split([rank, rope], dim=-1)
    positions = torch.tensor([0, 1, 7, 3999, 163839], device=DEVICE)
    slots = torch.randperm(slots_total, generator=gen)[:tokens].to(DEVICE)
    rows = torch.full((slots_total, rank + rope), float("nan"), dtype=dtype, device=DEVICE)
    q_out = mla_rope_and_write_latent(q_pe, k_pe, c_kv, positions, rotary.cos_sin_table(dtype), slots, rows,
                                      interleaved=interleaved)
    assert torch.equal(q_out, rotary(q_pe, positions))
    assert torch.equal(rows[slots], torch.cat((c_kv, rotary(k_pe.unsqueeze(1), positions).squeeze(1)), dim=-1))
    untouched = torch.ones(slots_total, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert rows[untouched].isnan().all()
    # out=: the rope columns of a wider query buffer (absorbed MLA's), the other columns untouched
    query = torch.full((tokens, heads, rank + rope), float("nan"), dtype=dtype, device=DEVICE)
    written = mla_rope_and_write_latent(q_pe, k_pe, c_kv, positions, rotary.cos_sin_table(dtype), slots, rows,
                                        interleaved=interleaved, out=query[..., rank:])
    assert written.data_ptr() == query[..., rank:].data_ptr() and torch.equal(query[..., rank:], q_out)
    assert query[..., :rank].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [24] + ([512] if GPU else []))
def test_mla_latent_write_with_the_kv_a_norm_folded_in(dtype, rank, gen):
    """``norm=``: c_kv RMS-normalised in the write kernel equals the RMSNorm layer's output (torch
    ops) within one rounding of the model dtype, and the rope parts stay bit-equal."""
    from segkv.layers.norm import RMSNorm

    tokens, heads, rope = 6, 4, 16
    rotary = RotaryEmbedding(rope, base=10000.0, max_position=4096, interleaved=True)
    rotary.init_buffers(DEVICE)
    norm = RMSNorm(rank, eps=1e-6).to(DEVICE).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(rank, generator=gen).to(dtype).to(DEVICE) + 0.5)
    q_pe = torch.randn(tokens, heads, rope, generator=gen).to(dtype).to(DEVICE)
    c_kv = 3 * torch.randn(tokens, rank, generator=gen).to(dtype).to(DEVICE)
    k_pe = torch.randn(tokens, rope, generator=gen).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 5, 9, 100, 2000, 4095], device=DEVICE)
    slots = torch.randperm(20, generator=gen)[:tokens].to(DEVICE)
    rows = torch.full((20, rank + rope), float("nan"), dtype=dtype, device=DEVICE)
    q_out = mla_rope_and_write_latent(q_pe, k_pe, c_kv, positions, rotary.cos_sin_table(dtype), slots, rows,
                                      interleaved=True, norm=(norm.weight, norm.eps))
    assert torch.equal(q_out, rotary(q_pe, positions))
    assert torch.equal(rows[slots, rank:], rotary(k_pe.unsqueeze(1), positions).squeeze(1))
    expected, written = norm(c_kv).double(), rows[slots, :rank].double()
    assert not written.isnan().any()
    step = torch.finfo(dtype).eps * expected.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((written - expected).abs() <= step + 1e-6 * (dtype == torch.float32)).all()
    with pytest.raises(ValueError, match="norm weight"):
        mla_rope_and_write_latent(q_pe, k_pe, c_kv, positions, rotary.cos_sin_table(dtype), slots, rows,
                                  interleaved=True, norm=(norm.weight[:-1], norm.eps))


def test_mla_rope_and_write_latent_rejects_mismatched_shapes():
    q_pe, k_pe, c_kv = (torch.zeros(2, 4, 16, device=DEVICE), torch.zeros(2, 16, device=DEVICE),
                        torch.zeros(2, 24, device=DEVICE))
    rows, slots = torch.zeros(8, 40, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE)
    table = torch.ones(32, 16, device=DEVICE)
    with pytest.raises(ValueError, match="latent rows"):
        mla_rope_and_write_latent(q_pe, k_pe, c_kv, slots, table, slots, rows[:, :39], interleaved=True)
    with pytest.raises(ValueError, match="dtype"):
        mla_rope_and_write_latent(q_pe, k_pe, c_kv, slots, table.half(), slots, rows, interleaved=True)
    with pytest.raises(ValueError, match="does not match q_pe"):
        mla_rope_and_write_latent(q_pe, k_pe, c_kv, slots, table, slots, rows, interleaved=True, out=q_pe[:1])
    with pytest.raises(ValueError, match="power-of-two"):
        mla_rope_and_write_latent(q_pe[..., :12], k_pe[:, :12], c_kv, slots, table[:, :12].contiguous(), slots, rows[:, :36],
                                  interleaved=True)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama3.1", "deepseek", "deepseek-q-lora"])
def test_fused_model_gives_the_unfused_tokens_and_logits(family, tmp_path):
    """A whole model with stacked projections and fused kernels: prefill and decode logits close
    to the unfused model's, the same greedy tokens, the same cache rows (in float32)."""
    from segkv.engine import LLM
    from segkv.layers.mla import MultiHeadLatentAttention
    from segkv.sampling_params import SamplingParams

    _build(tmp_path, family)
    kw = dict(device=DEVICE, dtype="float32", backend="triton", page_size=16, num_pages=64, prefill_chunk=8)
    plain, fused = LLM(tmp_path, fused_ops=False, **kw), LLM(tmp_path, fused_ops=True, **kw)
    assert fused.runner.fused_ops and not plain.runner.fused_ops
    mla = [m for m in fused.runner.model.modules() if isinstance(m, MultiHeadLatentAttention)]
    assert all(m._x_proj is not None for m in mla) and (len(mla) > 0) == family.startswith("deepseek")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)  # two decode steps
    prompts = [[5, 9, 13, 40, 77] * 4, [3, 1, 4, 1, 5, 9, 2, 6]]
    assert ([o.outputs[0].token_ids for o in fused.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
    chains = [llm.cache.new_chain() for llm in (plain, fused)]
    rows = [llm.runner.prompt_logits(chain, prompts[0]) for llm, chain in zip((plain, fused), chains)]
    assert torch.isfinite(rows[1]).all()
    torch.testing.assert_close(rows[1], rows[0], rtol=1e-4, atol=1e-4)
    keys = [llm.cache.storage.key_cache(0).reshape(-1)[: 20 * 4] for llm in (plain, fused)]
    assert keys[0].abs().sum() > 0
    torch.testing.assert_close(keys[1], keys[0], rtol=1e-5, atol=1e-5)


def _build(path, family):
    from model_helpers import build_deepseek_dir, build_model_dir

    if family.startswith("deepseek"):  # MLA with a dense layer, then routed + shared experts
        q_lora = {"q_lora_rank": 24} if family == "deepseek-q-lora" else {}
        return build_deepseek_dir(path, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, **q_lora)
    return build_model_dir(path, family)


def test_fused_moe_router_and_combine_give_the_unfused_tokens(tmp_path):
    """A DeepSeek model routing greedily among all experts, with fused ops and packed experts
    (the graph runner packs them): the fused router and combine kernels run in prefill (grouped
    GEMM, many pairs) and decode (GEMV) and give the unfused model's greedy tokens."""
    from model_helpers import build_deepseek_dir

    from segkv.engine import LLM
    from segkv.layers.moe import MixtureOfExperts
    from segkv.sampling_params import SamplingParams

    from safetensors.torch import load_file, save_file

    build_deepseek_dir(tmp_path, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
                       topk_method="greedy", scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.5)
    weights_file = tmp_path / "model.safetensors"  # greedy (V2-style) routing has no correction bias
    state = {k: v for k, v in load_file(weights_file).items() if not k.endswith("e_score_correction_bias")}
    save_file(state, weights_file, metadata={"format": "pt"})
    kw = dict(device=DEVICE, dtype="float32", backend="triton", page_size=16, num_pages=64, prefill_chunk=32)
    plain = LLM(tmp_path, fused_ops=False, cuda_graphs=False, **kw)
    fused = LLM(tmp_path, fused_ops=True, cuda_graphs=True if GPU else "emulate", **kw)
    layers = [m for m in fused.runner.model.modules() if isinstance(m, MixtureOfExperts)]
    assert layers and all(m.fused and m.packed and m.gate.fused for m in layers)
    assert all(m._stacked_shared_weights() is not None for m in layers)  # shared experts stackable
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)  # two decode steps
    prompts = [[5, 9, 13, 40, 77] * 5, [3, 1, 4, 1, 5, 9, 2, 6]]  # 25 x 3 = 75 pairs: the grouped GEMM
    assert ([o.outputs[0].token_ids for o in fused.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
    for prompt in prompts:  # prefill logits: grouped GEMM (75 pairs) and per-pair GEMV (24 pairs)
        rows = [llm.runner.prompt_logits(llm.cache.new_chain(), prompt) for llm in (plain, fused)]
        assert torch.isfinite(rows[1]).all()
        torch.testing.assert_close(rows[1], rows[0], rtol=1e-4, atol=1e-4)
