"""EAGLE-3 heads: the published checkpoint layout loads and computes the documented math; the
target's aux hidden states come from its one forward; bad heads are refused by name; training
with training-time test lowers the loss."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from segkv.attention.metadata import AttentionMetadata
from segkv.models.default_configs import gqa_config, mla_config
from segkv.models.eagle3 import Eagle3Head
from segkv.models.eagle3_loading import load_eagle3_head
from segkv.models.registry import model_class
from tools.default_models.training import DenseCausalAttention, dense_metadata, init_weights

VOCAB = 96


def make_target(kind: str = "gqa", *, vocab: int = VOCAB, hidden: int = 32, layers: int = 6, seed: int = 0):
    if kind == "gqa":
        cfg = gqa_config(vocab, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                         head_dim=8, intermediate_size=64, max_position_embeddings=128)
    else:
        cfg = mla_config(vocab, hidden_size=hidden, num_layers=layers, num_heads=2, q_lora_rank=None,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         intermediate_size=64, moe_intermediate_size=16, num_experts=4, experts_per_token=2,
                         num_shared_experts=1, num_mtp_layers=0, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = model_class(cfg).from_hf_config(cfg)
    init_weights(model, std=0.2)  # large enough that the layers change the stream
    return model.eval()


# -- aux hidden states ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_aux_hidden_states_match_the_layers_run_by_hand(kind):
    target = make_target(kind)
    ids = torch.randint(0, VOCAB, (2, 11))
    b, s = ids.shape
    positions = torch.arange(s).repeat(b)
    with torch.no_grad():
        plain = target(ids.reshape(-1), positions, dense_metadata(target, b, s, ids.device))
        assert isinstance(plain, torch.Tensor) and target.aux_hidden_layers is None
        target.set_aux_hidden_layers([4, 1, 5])  # any order, returned in this order
        hidden, aux = target(ids.reshape(-1), positions, dense_metadata(target, b, s, ids.device))
        # by hand: each block's full forward, its input recorded
        meta = dense_metadata(target, b, s, ids.device)
        x = target.model.embed_tokens(ids.reshape(-1))
        inputs = []
        for layer in target.model.layers:
            inputs.append(x)
            x = layer(x, positions, meta)
        want = torch.cat([inputs[4], inputs[1], inputs[5]], dim=-1)
    assert aux.shape == (b * s, 3 * target.cfg.hidden_size)
    torch.testing.assert_close(aux, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, plain, rtol=0, atol=0)  # capturing changes nothing
    assert not torch.equal(inputs[1], inputs[4])
    target.set_aux_hidden_layers(None)
    with torch.no_grad():
        again = target(ids.reshape(-1), positions, dense_metadata(target, b, s, ids.device))
    assert isinstance(again, torch.Tensor)
    assert not any(isinstance(v, torch.Tensor) for v in vars(target).values())  # nothing kept on the module


def test_aux_layer_ids_out_of_range():
    target = make_target()
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        target.set_aux_hidden_layers([2, 3, 6])


# -- a checkpoint in the published layout --------------------------------------------------------
HEAD = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, inter=48, draft_vocab=40)


def head_config(**over):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "hidden_size": HEAD["hidden"], "num_attention_heads": HEAD["heads"],
           "num_key_value_heads": HEAD["kv_heads"], "head_dim": HEAD["head_dim"],
           "intermediate_size": HEAD["inter"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 128, "vocab_size": VOCAB, "draft_vocab_size": HEAD["draft_vocab"],
           "hidden_act": "silu", "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    cfg.update(over)
    return cfg


def head_tensors(*, own_embeddings: bool = False, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d, inter, nd = HEAD["hidden"], HEAD["head_dim"], HEAD["inter"], HEAD["draft_vocab"]

    def w(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    t = {
        "fc.weight": w(h, 3 * h),
        "midlayer.input_layernorm.weight": 1 + w(h, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + w(h, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + w(h, scale=0.1),
        "midlayer.self_attn.q_proj.weight": w(HEAD["heads"] * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(HEAD["kv_heads"] * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(HEAD["kv_heads"] * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, HEAD["heads"] * d),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": 1 + w(h, scale=0.1),
        "lm_head.weight": w(nd, h),
    }
    targets = torch.randperm(VOCAB, generator=g)[:nd].sort().values  # draft id -> target id
    t["d2t"] = targets - torch.arange(nd)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[targets] = True
    t["t2d"] = t2d
    if own_embeddings:
        t["embed_tokens.weight"] = w(VOCAB, h, scale=1.0)
    return t


def write_head(directory, tensors, config=None):
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config or head_config()))
    return directory


def reference_head(t, embed_w, features, ids, positions, eps=1e-5, theta=10000.0):
    """The EAGLE-3 layer written out: ``features (S, hidden)`` of one sequence -> (prenorm output,
    draft logits, target logits)."""
    def rms(x, wt):
        return wt * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):  # (S, H, D), halves rotated
        d = x.shape[-1]
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = positions.float()[:, None] * inv[None]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    p = "midlayer."
    s, d = features.shape[0], HEAD["head_dim"]
    e = embed_w[ids]
    x = torch.cat([rms(e, t[p + "input_layernorm.weight"]), rms(features, t[p + "hidden_norm.weight"])],
                  dim=-1)
    q = rope((x @ t[p + "self_attn.q_proj.weight"].T).view(s, -1, d)).transpose(0, 1)
    k = rope((x @ t[p + "self_attn.k_proj.weight"].T).view(s, -1, d)).transpose(0, 1)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(s, -1, d).transpose(0, 1)
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(1, 2) / d**0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, -1) @ t[p + "self_attn.o_proj.weight"].T
    h1 = features + attn
    m = rms(h1, t[p + "post_attention_layernorm.weight"])
    mlp = (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
        @ t[p + "mlp.down_proj.weight"].T
    out = h1 + mlp
    draft = rms(out, t["norm.weight"]) @ t["lm_head.weight"].T
    full = torch.full((s, VOCAB), float("-inf"))
    full[:, torch.arange(draft.shape[1]) + t["d2t"]] = draft
    return out, draft, full


def one_sequence_meta(s: int) -> AttentionMetadata:
    dense = DenseCausalAttention(1, s)
    return AttentionMetadata(backend=dense, prepared=None, storage=dense, slots=torch.arange(s))


@pytest.mark.parametrize("own_embeddings", [False, True])
def test_published_layout_loads_and_matches_reference(tmp_path, own_embeddings):
    target = make_target(layers=6)
    tensors = head_tensors(own_embeddings=own_embeddings)
    head = load_eagle3_head(write_head(tmp_path / "head", tensors), target)
    assert isinstance(head, Eagle3Head) and head.aux_layer_ids == (1, 3, 4)
    assert set(head.state_dict()) == set(tensors)  # the shared embedding is not the head's to save
    embed_w = tensors["embed_tokens.weight"] if own_embeddings else target.model.embed_tokens.weight.detach()
    s = 9
    ids = torch.randint(0, VOCAB, (s,))
    positions = torch.arange(s) + 3
    target.set_aux_hidden_layers(head.aux_layer_ids)
    with torch.no_grad():
        meta = dense_metadata(target, 1, s, ids.device)
        _, aux = target(torch.randint(0, VOCAB, (s,)), torch.arange(s), meta)
        features = head.fuse(aux)
        out = head(features, ids, positions, one_sequence_meta(s))
        draft = head.compute_logits(out)
        full = head.compute_target_logits(out)
        # a deeper step: the head's own output as the hidden input
        out2 = head(out, ids.roll(1), positions + 1, one_sequence_meta(s))
    torch.testing.assert_close(features, aux @ tensors["fc.weight"].T, rtol=1e-5, atol=1e-5)
    want_out, want_draft, want_full = reference_head(tensors, embed_w, features, ids, positions)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(draft, want_draft, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full, want_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out2, reference_head(tensors, embed_w, out, ids.roll(1), positions + 1)[0],
                               rtol=1e-5, atol=1e-5)
    best = head.draft_to_target(draft.argmax(-1))
    assert torch.equal(best, full.argmax(-1)) and bool(tensors["t2d"][best].all())


def test_defaults_when_the_config_names_no_layers(tmp_path):
    cfg = head_config()
    del cfg["eagle_config"]
    target = make_target(layers=8)
    head = load_eagle3_head(write_head(tmp_path / "h", head_tensors(), cfg), target)
    assert head.aux_layer_ids == (2, 4, 5)


# -- refused heads ---------------------------------------------------------------------------------
def _without(name):
    t = head_tensors()
    del t[name]
    return t


def _with(name, value):
    t = head_tensors()
    t[name] = value
    return t


@pytest.mark.parametrize("case, match", [
    ("target_vocab", r"vocab_size 96 != the target's vocab_size 100"),
    ("target_hidden", r"target_hidden_size 32 != the target's hidden_size 48"),
    ("layer_ids", r"eagle_aux_hidden_state_layer_ids \[1, 3, 6\]"),
    ("missing_tensor", r"lacks tensors: midlayer.mlp.up_proj.weight"),
    ("unexpected_tensor", r"unexpected tensors extra.weight"),
    ("lm_head_shape", r"'lm_head.weight' has shape \(41, 32\)"),
    ("fc_shape", r"'fc.weight' has shape"),
    ("missing_d2t", r"lacks tensor 'd2t'"),
    ("d2t_out_of_vocab", r"'d2t' maps draft ids outside the target vocabulary"),
    ("t2d_disagrees", r"'t2d' disagrees with 'd2t'"),
    ("draft_vocab_too_big", r"draft_vocab_size 200 must be in \[1, vocab_size 96\]"),
    ("architecture", r"not an EAGLE-3 head"),
])
def test_mismatched_heads_are_refused_by_name(tmp_path, case, match):
    cfg, tensors, target = head_config(), head_tensors(), None
    if case == "target_vocab":
        target = make_target(vocab=100)
    elif case == "target_hidden":
        target = make_target(hidden=48)
    elif case == "layer_ids":
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    elif case == "missing_tensor":
        tensors = _without("midlayer.mlp.up_proj.weight")
    elif case == "unexpected_tensor":
        tensors = _with("extra.weight", torch.zeros(2))
    elif case == "lm_head_shape":
        tensors = _with("lm_head.weight", torch.zeros(41, 32))
    elif case == "fc_shape":
        tensors = _with("fc.weight", torch.zeros(32, 64))
    elif case == "missing_d2t":
        tensors = _without("d2t")
    elif case == "d2t_out_of_vocab":
        d2t = tensors["d2t"].clone()
        d2t[-1] = VOCAB
        tensors = _with("d2t", d2t)
    elif case == "t2d_disagrees":
        t2d = tensors["t2d"].clone()
        t2d[(~t2d).nonzero()[0]] = True
        tensors = _with("t2d", t2d)
    elif case == "draft_vocab_too_big":
        cfg["draft_vocab_size"] = 200
    elif case == "architecture":
        cfg["architectures"] = ["LlamaForCausalLM"]
    target = target or make_target()
    with pytest.raises(ValueError, match=match):
        load_eagle3_head(write_head(tmp_path / "h", tensors, cfg), target)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_eagle3_head(tmp_path / "nowhere", make_target())


# -- training ----------------------------------------------------------------------------------------
def test_training_time_test_lowers_the_loss():
    from segkv.models.eagle3 import Eagle3Config
    from segkv.models.eagle3_loading import head_config as make_head_config
    from tools.default_models.eagle3_training import init_head, target_batch, ttt_losses

    target = make_target(layers=4)
    for p in target.parameters():
        p.requires_grad_(False)
    tcfg = gqa_config(VOCAB, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=64, max_position_embeddings=128)
    cfg = Eagle3Config.from_hf(make_head_config(tcfg, draft_vocab_size=64, aux_layer_ids=[1, 2, 3],
                                                num_heads=4, num_kv_heads=2))
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    init_head(head)
    head.set_vocab_map(torch.arange(64) + 16)
    head.share_embedding(target.model.embed_tokens)
    target.set_aux_hidden_layers(cfg.aux_layer_ids)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (4, 16))
    batch = target_batch(target, ids)
    first = None
    for _ in range(30):
        out = ttt_losses(head, ids, batch, num_steps=3)
        loss = sum(out.losses)
        if first is None:
            first = [float(x.detach()) for x in out.losses]
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = [float(x) for x in ttt_losses(head, ids, batch, num_steps=3).losses]
    # soft cross-entropy against a random target's near-uniform distribution: its floor is that
    # distribution's entropy, so the drop is absolute
    assert len(last) == 3 and all(b < a - 0.25 for a, b in zip(first, last)), (first, last)


def test_training_time_test_attends_as_a_draft_chain_does(tmp_path):
    """Step 1 of training-time test at row ``t`` equals drafting one token after position ``t``:
    the head over ``[step-0 rows 0..t ; its own output at t]`` with a plain causal mask."""
    from tools.default_models.eagle3_training import TTTAttention

    target = make_target(layers=6)
    tensors = head_tensors()
    head = load_eagle3_head(write_head(tmp_path / "head", tensors), target)
    s = 10
    ids = torch.randint(0, VOCAB, (1, s + 2))
    features = torch.randn(s, HEAD["hidden"])
    store = TTTAttention(1, s)
    meta = AttentionMetadata(backend=store, prepared=None, storage=store, slots=torch.arange(s))
    base = torch.arange(s)
    with torch.no_grad():
        out0 = head(features, ids[0, 1:s + 1], base, meta)
        out1 = head(out0, ids[0, 2:s + 2], base + 1, meta)
        for t in (0, 4, s - 1):
            chain_hidden = torch.cat([features[: t + 1], out0[t: t + 1]])
            chain_ids = torch.cat([ids[0, 1: t + 2], ids[0, t + 2: t + 3]])
            chain_pos = torch.cat([torch.arange(t + 1), torch.tensor([t + 1])])
            chain = head(chain_hidden, chain_ids, chain_pos, one_sequence_meta(t + 2))
            torch.testing.assert_close(chain[: t + 1], out0[: t + 1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(chain[t + 1], out1[t], rtol=1e-5, atol=1e-5)


SNIPPET = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()
'''


@pytest.mark.parametrize("name", ["default", "default-mla"])
def test_packaged_heads_load_and_agree_with_their_targets(name):
    """The shipped heads load against the shipped targets and their first draft is the target's
    argmax well above chance on a snippet of Python."""
    from tokenizers import Tokenizer

    from segkv.models.default_models import PACKAGE_ROOT, is_complete, packaged_dir
    from segkv.models.loader import load_model
    from tools.default_models.eagle3_training import target_batch, ttt_losses

    head_dir = PACKAGE_ROOT / {"default": "eagle3-default", "default-mla": "eagle3-default-mla"}[name]
    if not (head_dir / "model.safetensors").is_file() or not is_complete(packaged_dir(name)):
        pytest.skip(f"no packaged {name} model or head in this checkout")
    target = load_model(packaged_dir(name))
    head = load_eagle3_head(head_dir, target)
    target.set_aux_hidden_layers(head.aux_layer_ids)
    ids = Tokenizer.from_file(str(packaged_dir(name) / "tokenizer.json")).encode(SNIPPET).ids
    ids = torch.tensor([ids])
    with torch.no_grad():
        out = ttt_losses(head, ids, target_batch(target, ids), num_steps=2)
    first = float(out.correct[0].float().mean())
    assert first > 0.3, first
