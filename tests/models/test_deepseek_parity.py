"""DeepSeek V2/V3 against Hugging Face transformers: prompt logits (both MLA modes) and greedy decode."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from segkv.attention.plan import AttentionShape
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig
from segkv.layers.moe import RouterSpec, TopKRouter
from segkv.models.loader import load_model
from segkv.runner.model_runner import ModelRunner, StepInput

VOCAB = 100
PROMPT = 30
PREFILL_CHUNK = 7  # < PROMPT: later chunks attend the earlier ones as history pieces
TOLERANCE = 1e-4
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=256,
)
YARN = dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                                 mscale_all_dim=0.8, original_max_position_embeddings=64))
CASES = {
    "v2_lite": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(q_lora_rank=None)),
    "v2_q_lora": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(q_lora_rank=24)),
    # topk_group * group size > top_k > topk_group: group limiting really changes the choice
    "v2_group_limited": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=3,
        routed_scaling_factor=1.5)),
    "v3_noaux_tc": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(q_lora_rank=24, n_group=4, topk_group=2)),
    "v3_yarn": (DeepseekV3Config, DeepseekV3ForCausalLM,
                dict(q_lora_rank=24, n_group=4, topk_group=2, **YARN)),
    "v3_rope_halves": (DeepseekV3Config, DeepseekV3ForCausalLM,  # rope_interleave=False: rotate_half RoPE
                       dict(q_lora_rank=24, n_group=4, topk_group=2, rope_interleave=False)),
}


def _randomise(hf: torch.nn.Module) -> None:
    """Weights large enough that attention is far from uniform and routing is decisive.

    HF's default init (std 0.02) leaves scores near zero, where RoPE layout, softmax scale and
    routing errors would hardly show in the logits.
    """
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 1.5 / math.sqrt(p.shape[-1]))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # comparable to the spread of sigmoid scores
                b.copy_(0.3 * torch.randn_like(b))


def _build(name: str, directory: Path, **overrides) -> tuple[torch.nn.Module, Path]:
    config_cls, model_cls, extra = CASES[name]
    hf = model_cls(config_cls(**{**BASE, **extra, **overrides})).eval()
    _randomise(hf)
    hf.save_pretrained(directory)
    return hf, directory


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _runner(model, *, page_size: int, mla_mode: str, prefill_chunk: int = PREFILL_CHUNK) -> ModelRunner:
    cache = PagedKVCache(model.kv_layout(torch.float32), CacheConfig(page_size=page_size, num_pages=64))
    return ModelRunner(model, cache, mla_mode=mla_mode, prefill_chunk=prefill_chunk)


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_logits_match_hf(name, tmp_path, gen):
    hf, path = _build(name, tmp_path)
    model = load_model(path)
    ids = torch.randint(0, VOCAB, (PROMPT,), generator=gen)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for page_size in (4, 16):
        latents = {}
        for mode in ("naive", "absorbed"):
            runner = _runner(model, page_size=page_size, mla_mode=mode)
            out = runner.prompt_logits(runner.cache.new_chain(), ids.tolist())
            err = _rel_err(out, ref)
            assert err < TOLERANCE, f"{name} {mode} page_size={page_size}: relative error {err:.2e}"
            assert runner.route_counts.total() == math.ceil(PROMPT / PREFILL_CHUNK)
            latents[mode] = [t.clone() for t in runner.cache.storage.latent]
        # One cache row format: layer 0's rows are bit-identical (same inputs), later layers'
        # differ only by the float noise of the two attention paths.
        torch.testing.assert_close(latents["naive"][0], latents["absorbed"][0], rtol=0, atol=0)
        for naive, absorbed in zip(latents["naive"], latents["absorbed"]):
            torch.testing.assert_close(naive, absorbed, rtol=1e-4, atol=1e-4)


# "auto": prefill chunks take the naive path, single-token steps the absorbed one, over one cache.
@pytest.mark.parametrize(("name", "mla_mode"), [(name, "absorbed") for name in CASES] + [("v3_yarn", "auto")])
def test_greedy_decode_matches_hf(name, mla_mode, tmp_path, gen):
    hf, path = _build(name, tmp_path)
    hf.generation_config.eos_token_id = None  # always 32 new tokens
    model = load_model(path)
    prompt = torch.randint(0, VOCAB, (8,), generator=gen)
    steps = 32
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=steps, do_sample=False)[0, len(prompt):].tolist()
    assert len(expected) == steps
    modes: list[str] = []
    shape_of = model.attention_shape
    model.attention_shape = lambda mode: modes.append(mode) or shape_of(mode)  # record each step's mode
    runner = _runner(model, page_size=4, mla_mode=mla_mode, prefill_chunk=3)
    chain = runner.cache.new_chain()
    logits = runner.forward([StepInput(chain, prompt.tolist())])
    got, step_logits = [], []
    for _ in range(steps):
        step_logits.append(logits[0])
        token = int(logits[0].argmax())
        got.append(token)
        logits = runner.forward([StepInput(chain, [token])])
    if got != expected:  # only a float32 near-tie may flip greedy: both paths agree up to it
        i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        gap = (step_logits[i][got[i]] - step_logits[i][expected[i]]).abs().item()
        assert gap < 1e-4 * step_logits[i].abs().max().item(), f"step {i}: {got[i]} vs {expected[i]}, gap {gap}"
    assert modes == (["naive"] * 3 if mla_mode == "auto" else ["absorbed"] * 3) + ["absorbed"] * steps
    assert chain.num_rows == len(prompt) + steps


def test_v3_checkpoint_with_mtp_layers_loads(tmp_path, gen):
    layers = BASE["num_hidden_layers"]
    hf, path = _build("v3_noaux_tc", tmp_path, num_nextn_predict_layers=1)
    (weights,) = path.glob("*.safetensors")
    state = load_file(weights)
    hidden = BASE["hidden_size"]
    mtp = {  # the names DeepSeek-V3 checkpoints use for their next-token-prediction module
        "embed_tokens.weight": (VOCAB, hidden), "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
        "eh_proj.weight": (hidden, 2 * hidden), "shared_head.norm.weight": (hidden,),
        "shared_head.head.weight": (VOCAB, hidden), "input_layernorm.weight": (hidden,),
        "self_attn.kv_b_proj.weight": (128, 32), "mlp.experts.0.gate_proj.weight": (32, hidden),
        "mlp.gate.e_score_correction_bias": (8,),
    }
    state.update({f"model.layers.{layers}.{k}": torch.randn(shape) for k, shape in mtp.items()})
    save_file(state, weights, metadata={"format": "pt"})
    # only some of the MTP module's weights: it loads without them, and says so
    with pytest.warns(UserWarning, match="multi-token prediction is disabled"):
        model = load_model(path)
    assert len(model.model.layers) == layers
    ids = torch.randint(0, VOCAB, (12,), generator=gen)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    runner = _runner(model, page_size=4, mla_mode="absorbed")
    assert _rel_err(runner.prompt_logits(runner.cache.new_chain(), ids.tolist()), ref) < TOLERANCE
    # A layer past the MTP layers is still an error, not silently skipped.
    state[f"model.layers.{layers + 1}.input_layernorm.weight"] = torch.ones(hidden)
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_model(path)


def test_layout_and_attention_shapes(tmp_path):
    _, path = _build("v2_lite", tmp_path)
    model = load_model(path)
    layout = model.kv_layout(torch.bfloat16)
    assert (layout.kind, layout.num_layers, layout.kv_lora_rank, layout.rope_dim) == ("mla", 3, 32, 16)
    assert layout.dtype == torch.bfloat16
    assert model.attention_shape("absorbed") == AttentionShape(4, 1, 48, 32)
    assert model.attention_shape("naive") == AttentionShape(4, 4, 32, 16)
    with pytest.raises(ValueError, match="mla_mode"):
        model.attention_shape("auto")
    assert model.ignores_weight("model.layers.3.enorm.weight") is False  # V2 config: no MTP layers


def test_router_normalises_then_scales(gen):
    spec = RouterSpec(num_experts=8, top_k=3, scoring="softmax", topk_method="group_limited_greedy",
                      num_groups=4, topk_groups=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = TopKRouter(16, spec)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=gen))
    weights, ids = router(torch.randn(10, 16, generator=gen))
    torch.testing.assert_close(weights.sum(-1), torch.full((10,), 2.5))
    groups_used = [len(set((row // spec.group_size).tolist())) for row in ids]
    assert max(groups_used) <= spec.topk_groups
    with pytest.raises(ValueError, match="cannot supply"):
        RouterSpec(num_experts=8, top_k=5, topk_method="group_limited_greedy", num_groups=4, topk_groups=2)
