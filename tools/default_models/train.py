"""Train segkv's built-in default models on the Python standard library, reproducibly.

Builds the corpus (the stdlib's ``*.py`` sources, sorted by path; tests, site-packages and codec
tables left out), splits it by file (train / valid / test), trains a byte-level BPE tokenizer,
then trains

- ``qwen3-gqa``    (``--model default``):     a Qwen3-style grouped-query-attention model, and
- ``deepseek-mla`` (``--model default-mla``): a DeepSeek-V3-style model with multi-head latent
  attention, routed + shared experts (``noaux_tc`` routing with bias balancing) and one
  multi-token-prediction layer trained with DeepSeek-V3's MTP loss,

with segkv's own model classes (a full-sequence causal forward, ``tools.default_models.training``),
AdamW and a cosine schedule. Each model is saved as a Hugging Face directory (bfloat16
weights, the MoE routers in float32) and reloaded to measure its held-out perplexity, next
to a unigram model's on the same tokens. ``metrics.json`` records the curves, the corpus
digest and the versions; ``loss_curves.png`` is drawn when matplotlib is installed
(``python -m tools.default_models.plot`` draws it from ``metrics.json`` anywhere).

From the repository root:

    python -m tools.default_models.train --device cuda            # ~5 min on one H200
    python -m tools.default_models.train --preset tiny --device cpu --out-dir /tmp/dm   # seconds
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before CUDA starts

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from segkv.layers.moe import TopKRouter  # noqa: E402
from segkv.models import stdlib_corpus  # noqa: E402
from segkv.models.default_models import (  # noqa: E402
    EOS_TOKEN_IDS, GQA_NAME, MLA_NAME, PACKAGE_ROOT, PACKAGED, gqa_config, mla_config,
)
from segkv.models.loader import load_model  # noqa: E402
from segkv.models.registry import model_class  # noqa: E402
from tools.default_models import corpus  # noqa: E402
from tools.default_models.training import causal_hidden, init_weights, lm_losses  # noqa: E402

MAX_FILE_BYTES = 16_000_000
FP32_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # routing stays float32
PROMPT = "def fibonacci(n):"


@dataclass(slots=True)
class Preset:
    """Sizes of one run: the tokenizer, both architectures and the optimisation."""

    vocab_size: int
    gqa: dict
    mla: dict
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    eval_every: int
    log_every: int
    eval_tokens: int
    corpus_limit_bytes: int | None = None
    heldout_every: int = 50
    sample_tokens: int = 48
    extra: dict = field(default_factory=dict)


PRESETS = {
    # About 11 epochs of the training split, a few minutes per model on one H200; files <= 16 MB.
    "h200": Preset(
        vocab_size=8192,
        gqa=dict(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=2, head_dim=32,
                 intermediate_size=768),
        mla=dict(hidden_size=256, num_layers=6, num_heads=8, q_lora_rank=128, kv_lora_rank=64,
                 qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, intermediate_size=768,
                 moe_intermediate_size=128, num_experts=4, experts_per_token=2, num_shared_experts=1,
                 num_mtp_layers=1),
        steps=2000, batch_size=16, seq_len=1024, lr=2e-3, warmup=100, eval_every=200, log_every=50,
        eval_tokens=262_144, heldout_every=25,
    ),
    # Seconds on a CPU: for the tests.
    "tiny": Preset(
        vocab_size=384,
        gqa=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128,
                 max_position_embeddings=256),
        mla=dict(hidden_size=32, num_layers=2, num_heads=2, q_lora_rank=None, kv_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, intermediate_size=64,
                 moe_intermediate_size=32, num_experts=4, experts_per_token=2, num_shared_experts=1,
                 num_mtp_layers=1, max_position_embeddings=256),
        steps=60, batch_size=16, seq_len=64, lr=2e-2, warmup=5, eval_every=10, log_every=5, eval_tokens=8192,
        corpus_limit_bytes=400_000, heldout_every=7, sample_tokens=8,
    ),
}


def log(message: str) -> None:
    print(message, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.default_models.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out-dir", type=Path, default=PACKAGE_ROOT)
    p.add_argument("--models", default="gqa,mla", help="comma-separated: gqa, mla")
    p.add_argument("--steps", type=int, help="optimizer steps per model (default: the preset's)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-limit-bytes", type=int, help="use only the first files, up to this many bytes")
    p.add_argument("--heldout-every", type=int, help="every N-th file is test, every N-th + N/2 valid")
    p.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of the MTP loss (DeepSeek-V3: 0.3)")
    # DeepSeek-V3 used 0.001 over a far longer run; 0.01 balances the experts within ~100 steps here.
    p.add_argument("--bias-update-speed", type=float, default=1e-2,
                   help="gamma of noaux_tc's expert-bias balancing (default 0.01; DeepSeek-V3: 0.001)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warn-only-determinism", action="store_true",
                   help="warn instead of failing on an op without a deterministic implementation")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


# -- data ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Data:
    tokenizer: object
    streams: dict[str, torch.Tensor]  # split -> (N,) int64 tokens, documents joined by <|endoftext|>
    info: dict


def build_data(preset: Preset, limit_bytes: int | None, heldout_every: int) -> Data:
    docs = stdlib_corpus.read_corpus(limit_bytes=limit_bytes)
    split = corpus.split_corpus(docs, every=heldout_every)
    log(f"corpus: {len(docs)} files, {sum(len(d.text) for d in docs):,} characters; "
        + ", ".join(f"{k} {len(v)} files" for k, v in split.items()))
    tok = stdlib_corpus.train_tokenizer((d.text for d in split["train"]), vocab_size=preset.vocab_size)
    chats = [corpus.format_chat(q, a) for q, a in corpus.chat_examples(split["train"])]
    eot = tok.token_to_id(stdlib_corpus.END_OF_TEXT)
    streams = {}
    texts_of = {"train": [d.text for d in split["train"]] + chats,
                "valid": [d.text for d in split["valid"]], "test": [d.text for d in split["test"]]}
    for name, texts in texts_of.items():
        ids: list[int] = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids += enc.ids + [eot]
        streams[name] = torch.tensor(ids, dtype=torch.int64)
    info = {
        "source": "Python standard library *.py (sysconfig stdlib path), sorted by path",
        "skipped_dirs": sorted(stdlib_corpus.SKIP_DIRS), "sha256": corpus.corpus_sha256(docs),
        "files": {k: len(v) for k, v in split.items()}, "characters": sum(len(d.text) for d in docs),
        "heldout_every": heldout_every, "chat_examples": len(chats),
        "tokens": {k: int(v.numel()) for k, v in streams.items()},
        "test_files": [d.path for d in split["test"]],
    }
    counts = ", ".join(f"{k} {v:,}" for k, v in info["tokens"].items())
    log(f"tokenizer: vocab {tok.get_vocab_size()}; tokens {counts} ({len(chats)} chat examples in train)")
    return Data(tok, streams, info)


def unigram_nll(train: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """Mean NLL (nats) of ``targets`` under add-one-smoothed unigram frequencies of ``train``."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[targets].mean())


def windows(stream: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping ``(n, seq_len)`` windows from the start of ``stream`` (at most ``max_tokens``)."""
    n = min(stream.numel() // seq_len, max(1, max_tokens // seq_len))
    if n == 0:
        raise SystemExit(f"a held-out split has {stream.numel()} tokens, fewer than --seq-len {seq_len}: "
                         "use more of the corpus or a smaller --heldout-every")
    return stream[: n * seq_len].view(n, seq_len)


# -- training ------------------------------------------------------------------------------
class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step, every router's
    ``e_score_correction_bias`` moves by ``speed`` towards the experts that got fewer tokens."""

    def __init__(self, model: torch.nn.Module, speed: float) -> None:
        self.speed, self.recording = speed, False
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter) and m.spec.has_bias]
        self.loads: dict[int, torch.Tensor] = {}
        for i, router in enumerate(self.routers):
            router.register_forward_hook(lambda _m, _in, out, i=i: self._record(i, out[1]))

    def _record(self, i: int, ids: torch.Tensor) -> None:
        if self.recording:
            n = self.routers[i].spec.num_experts
            load = torch.bincount(ids.reshape(-1), minlength=n).float()
            self.loads[i] = self.loads[i] + load if i in self.loads else load

    @torch.no_grad()
    def update(self) -> float:
        """Apply the bias step; return the worst router's max load / mean load this step (1 = balanced)."""
        worst = 1.0
        for i, load in self.loads.items():
            bias = self.routers[i].e_score_correction_bias
            bias += self.speed * torch.sign(load.mean() - load)
            worst = max(worst, float(load.max() / load.mean()))
        self.loads.clear()
        return worst


def lr_at(step: int, preset: Preset, steps: int, lr: float) -> float:
    """Linear warmup, then cosine decay to 10% of ``lr``."""
    if step < preset.warmup:
        return lr * (step + 1) / preset.warmup
    progress = (step - preset.warmup) / max(1, steps - preset.warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: torch.Tensor, batch_size: int, device: torch.device) -> dict:
    """Mean losses over ``batches (n, S)``: ``loss`` (nats/token) and, with MTP, ``mtp_loss`` and
    ``mtp_top1`` (how often MTP's argmax is token t + 2, the acceptance of a one-token draft)."""
    model.eval()
    total = mtp_total = correct = 0.0
    count = mtp_count = 0
    for start in range(0, batches.shape[0], batch_size):
        ids = batches[start:start + batch_size].to(device)
        out = lm_losses(model, ids)
        n = ids.shape[0] * (ids.shape[1] - 1)
        total, count = total + float(out.main) * n, count + n
        if out.mtp is not None:
            m = out.mtp_correct.numel()
            mtp_total, mtp_count = mtp_total + float(out.mtp) * m, mtp_count + m
            correct += float(out.mtp_correct.sum())
    result = {"loss": total / count, "perplexity": math.exp(total / count), "tokens": count}
    if mtp_count:
        result.update(mtp_loss=mtp_total / mtp_count, mtp_perplexity=math.exp(mtp_total / mtp_count),
                      mtp_top1=correct / mtp_count)
    model.train()
    return result


def train(kind: str, config: dict, data: Data, preset: Preset, args, device: torch.device) -> tuple:
    """Train one model; return it (the weights of its best validation loss) and its record."""
    steps = args.steps or preset.steps
    batch, seq_len = args.batch_size or preset.batch_size, args.seq_len or preset.seq_len
    lr = args.lr or preset.lr
    torch.manual_seed(args.seed)  # each model's init and data order depend on the seed only
    model = model_class(config).from_hf_config(config)
    init_weights(model)
    model.to(device).train()
    balancer = ExpertBalancer(model, args.bias_update_speed)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)
    order = torch.Generator().manual_seed(args.seed)
    train_stream = data.streams["train"]
    valid = windows(data.streams["valid"], seq_len, preset.eval_tokens)
    mtp_weight = args.mtp_weight if len(getattr(model, "mtp", ())) else 0.0
    curve, valid_curve = [], []
    best = (math.inf, -1, None)
    run_main = run_mtp = torch.zeros((), device=device)
    run_n = imbalance = 0
    start = time.perf_counter()
    log(f"[{kind}] {sum(p.numel() for p in params):,} parameters; {steps} steps of {batch} x {seq_len} "
        f"tokens, lr {lr}, device {device}")
    for step in range(steps):
        offsets = torch.randint(0, train_stream.numel() - seq_len, (batch,), generator=order)
        ids = torch.stack([train_stream[o:o + seq_len] for o in offsets.tolist()]).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, preset, steps, lr)
        balancer.recording = True
        out = lm_losses(model, ids, with_mtp=mtp_weight > 0)
        balancer.recording = False
        loss = out.main + mtp_weight * out.mtp if out.mtp is not None else out.main
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        imbalance += balancer.update()
        run_main = run_main + out.main.detach()
        run_mtp = run_mtp + (out.mtp.detach() if out.mtp is not None else 0.0)
        run_n += 1
        done = step + 1
        if done % preset.log_every == 0 or done == steps:
            elapsed = time.perf_counter() - start
            point = {"step": done, "lr": opt.param_groups[0]["lr"], "loss": float(run_main) / run_n,
                     "tokens": done * batch * seq_len, "elapsed_s": round(elapsed, 2)}
            if mtp_weight:
                point.update(mtp_loss=float(run_mtp) / run_n, expert_max_over_mean=round(imbalance / run_n, 3))
            curve.append(point)
            eta = elapsed / done * (steps - done)
            log(f"[{kind}] step {done}/{steps} loss {point['loss']:.4f}"
                + (f" mtp {point['mtp_loss']:.4f} experts max/mean {imbalance / run_n:.2f}" if mtp_weight else "")
                + f" lr {point['lr']:.2e} {done * batch * seq_len / elapsed:,.0f} tok/s "
                f"elapsed {elapsed:.0f}s eta {eta:.0f}s")
            run_main = run_mtp = torch.zeros((), device=device)
            run_n = imbalance = 0
        if done % preset.eval_every == 0 or done == steps:
            result = evaluate(model, valid, batch, device)
            valid_curve.append({"step": done, **result})
            log(f"[{kind}] step {done}: valid loss {result['loss']:.4f} (ppl {result['perplexity']:.2f})")
            if result["loss"] < best[0]:
                best = (result["loss"], done, {k: v.detach().clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best[2])
    wall = time.perf_counter() - start
    record = {
        "steps": steps, "batch_size": batch, "seq_len": seq_len, "lr": lr, "warmup": preset.warmup,
        "schedule": "linear warmup, cosine to 10%",
        "optimizer": f"AdamW(0.9, 0.95), wd {args.weight_decay}, clip 1.0",
        "mtp_weight": mtp_weight, "bias_update_speed": args.bias_update_speed if balancer.routers else None,
        "tokens_seen": steps * batch * seq_len,
        "epochs": round(steps * batch * seq_len / train_stream.numel(), 2), "selected_step": best[1],
        "train_wall_time_s": round(wall, 1), "curve": curve, "valid": valid_curve,
        "parameters": sum(p.numel() for p in params),
    }
    return model, record


# -- saving --------------------------------------------------------------------------------
def save_model(model: torch.nn.Module, config: dict, tok, directory: Path) -> int:
    """A Hugging Face directory: config, bfloat16 safetensors (routers float32), tokenizer files."""
    directory.mkdir(parents=True, exist_ok=True)
    rename = getattr(model, "checkpoint_name", lambda n: n)
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        dtype = torch.float32 if name.endswith(FP32_TENSORS) else torch.bfloat16
        state[rename(name)] = tensor.detach().to("cpu", dtype).contiguous()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": None, "eos_token_id": EOS_TOKEN_IDS, "pad_token_id": 0}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    stdlib_corpus.save_tokenizer(tok, directory, model_max_length=config["max_position_embeddings"])
    size = (directory / "model.safetensors").stat().st_size
    if size > MAX_FILE_BYTES:
        raise SystemExit(f"{directory / 'model.safetensors'} is {size:,} bytes, over {MAX_FILE_BYTES:,}")
    return size


@torch.no_grad()
def greedy_text(model: torch.nn.Module, tok, prompt: str, max_new: int, device: torch.device) -> str:
    ids = tok.encode(prompt, add_special_tokens=False).ids
    for _ in range(max_new):
        x = torch.tensor([ids], device=device)
        token = int(model.compute_logits(causal_hidden(model, x)[-1:]).argmax())
        if token in EOS_TOKEN_IDS:
            break
        ids.append(token)
    return tok.decode(ids)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def deterministic(warn_only: bool, device: torch.device):
    """Deterministic algorithms (TF32 matmuls on CUDA) for the run; the caller's settings after."""
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32)
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = device.type == "cuda"  # deterministic, and several times faster
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32 = saved[2:]


def run(args: argparse.Namespace) -> dict:
    """Train, save and measure the models ``args.models``; write ``metrics.json``; return it."""
    device = torch.device(args.device)
    with deterministic(args.warn_only_determinism, device):
        return _run(args, device)


def _run(args: argparse.Namespace, device: torch.device) -> dict:
    t0 = time.perf_counter()
    preset = PRESETS[args.preset]
    limit = args.corpus_limit_bytes if args.corpus_limit_bytes is not None else preset.corpus_limit_bytes
    data = build_data(preset, limit, args.heldout_every or preset.heldout_every)
    vocab = data.tokenizer.get_vocab_size()
    seq_len = args.seq_len or preset.seq_len
    test = windows(data.streams["test"], seq_len, 1 << 40)
    unigram = unigram_nll(data.streams["train"], test[:, 1:].reshape(-1), vocab)
    import tokenizers

    metrics = {
        "python_version": corpus.python_version(), "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__, "seed": args.seed, "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "command": "python -m tools.default_models.train " + " ".join(args.argv),
        "corpus": data.info, "vocab_size": vocab, "models": {},
    }
    builders = {"gqa": (GQA_NAME, gqa_config, preset.gqa), "mla": (MLA_NAME, mla_config, preset.mla)}
    max_pos = max(512, 2 * seq_len)
    for kind in [k.strip() for k in args.models.split(",") if k.strip()]:
        if kind not in builders:
            raise SystemExit(f"unknown model {kind!r}; choose from gqa, mla")
        name, make_config, sizes = builders[kind]
        config = make_config(vocab, **{"max_position_embeddings": max_pos, **sizes})
        t_model = time.perf_counter()
        model, record = train(kind, config, data, preset, args, device)
        directory = args.out_dir / PACKAGED[name]
        size = save_model(model, config, data.tokenizer, directory)
        del model
        saved = load_model(directory, dtype="float32", device=device)  # what users get: bf16-rounded
        if kind == "mla":
            assert len(saved.mtp) == config["num_nextn_predict_layers"], "the MTP layer did not load"
        result = evaluate(saved, test, args.batch_size or preset.batch_size, device)
        record.update(
            name=name, directory=PACKAGED[name], config=config, file_bytes=size,
            sha256=sha256_file(directory / "model.safetensors"), test=result,
            unigram_test_perplexity=math.exp(unigram),
            sample={"prompt": PROMPT,
                    "greedy": greedy_text(saved, data.tokenizer, PROMPT, preset.sample_tokens, device)},
            wall_time_s=round(time.perf_counter() - t_model, 1),
        )
        metrics["models"][PACKAGED[name]] = record
        log(f"[{kind}] saved {directory} ({size:,} bytes); test perplexity {result['perplexity']:.2f} "
            f"vs unigram {math.exp(unigram):.2f}"
            + (f"; MTP perplexity {result['mtp_perplexity']:.2f}, top-1 {result['mtp_top1']:.3f}"
               if "mtp_perplexity" in result else ""))
        log(f"[{kind}] greedy: {record['sample']['greedy']!r}")
    metrics["wall_time_s"] = round(time.perf_counter() - t0, 1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"wrote {args.out_dir / 'metrics.json'}; total {metrics['wall_time_s']:.0f}s")
    if not args.no_plot:
        _plot(args.out_dir / "metrics.json", args.out_dir / "loss_curves.png")
    return metrics


def _plot(metrics_path: Path, png: Path) -> None:
    """Draw the curves with ``tools.default_models.plot`` when matplotlib is installed."""
    if importlib.util.find_spec("matplotlib") is None:
        log("matplotlib is not installed: no plot (python -m tools.default_models.plot draws it later)")
        return
    from tools.default_models.plot import plot

    plot(json.loads(metrics_path.read_text()), png)
    log(f"wrote {png}")


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
