"""Train EAGLE-3 draft heads for the built-in models, with training-time test.

For ``default`` (``qwen3-gqa``) and ``default-mla`` (``deepseek-mla``), loads the packaged
target (float32, frozen), reads the standard-library corpus with the target's own tokenizer, and
trains one ``LlamaForCausalLMEagle3`` head (``segkv.models.eagle3``) that fuses the inputs of the
target's layers 1, 3 and 5 (a 6-layer target: vLLM's default 2, L // 2, L - 3 would pick layer 3
twice). Each step unrolls the head ``--ttt-steps`` times feeding its own output
(``tools.default_models.eagle3_training``), with a soft cross-entropy against the target's
next-token distribution at every step (weights ``0.8 ** step``). The draft vocabulary is the
``--draft-vocab-size`` most frequent tokens of the training text.

Held out: the files the targets were tested on (``test_files`` in ``segkv/default_models/
metrics.json``); the head trains on every other file. The heads ship in
``segkv/default_models/eagle3-default/`` and ``eagle3-default-mla/`` (bfloat16 weights), each
with a ``metrics.json``: the held-out top-1 acceptance of the first draft (how often the head's
argmax is the target's argmax), and of the deeper steps given the true tokens before them.

From the repository root:

    python -m tools.default_models.train_eagle3 --device cuda        # both heads, a few minutes on one GPU
    python -m tools.default_models.train_eagle3 --device cpu --steps 20 --out-dir /tmp/e3   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from segkv.models import stdlib_corpus
from segkv.models.default_models import GQA_NAME, MLA_NAME, PACKAGE_ROOT, PACKAGED
from segkv.models.eagle3 import Eagle3Config, Eagle3Head
from segkv.models.eagle3_loading import head_config, load_eagle3_head, save_eagle3_head
from segkv.models.loader import load_model, read_config
from tools.default_models import corpus
from tools.default_models.eagle3_training import init_head, target_batch, ttt_losses

HEAD_DIRS = {GQA_NAME: "eagle3-default", MLA_NAME: "eagle3-default-mla"}
AUX_LAYER_IDS = [1, 3, 5]
MAX_FILE_BYTES = 2_400_000


def log(message: str) -> None:
    print(message, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.default_models.train_eagle3", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default=f"{GQA_NAME},{MLA_NAME}")
    p.add_argument("--out-dir", type=Path, default=PACKAGE_ROOT)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab-size", type=int, default=2048)
    p.add_argument("--intermediate-size", type=int, default=256)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=1 << 17)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-only", action="store_true",
                   help="measure the heads in --out-dir again, no training")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def token_streams(tok: Tokenizer, test_files: set[str]) -> dict[str, torch.Tensor]:
    """``train``: every corpus file but ``test_files``, plus the chat examples; ``test``: those files."""
    docs = stdlib_corpus.read_corpus()
    held = [d for d in docs if d.path in test_files]
    rest = [d for d in docs if d.path not in test_files]
    if not held:
        raise SystemExit("none of the targets' test files is in this Python's standard library")
    eot = tok.token_to_id(stdlib_corpus.END_OF_TEXT)
    chats = [corpus.format_chat(q, a) for q, a in corpus.chat_examples(rest)]
    texts = {"train": [d.text for d in rest] + chats, "test": [d.text for d in held]}
    streams = {}
    for name, items in texts.items():
        ids: list[int] = []
        for enc in tok.encode_batch(items, add_special_tokens=False):
            ids += enc.ids + [eot]
        streams[name] = torch.tensor(ids, dtype=torch.int64)
    return streams


def draft_vocabulary(stream: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``stream``, ascending (ties: the lower id)."""
    counts = torch.bincount(stream, minlength=vocab)
    order = torch.argsort(-counts, stable=True)
    return order[: min(size, vocab)].sort().values


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(head: Eagle3Head, target, windows: torch.Tensor, batch_size: int, ttt_steps: int,
             device: torch.device) -> dict:
    """Held-out soft cross-entropy and top-1 acceptance (head argmax == target argmax) per draft step,
    and ``mean_accepted_drafts``: the expected number of a ``ttt_steps``-token chain's drafts that
    greedy verification accepts (the steps all right from the first on), the deeper steps fed the
    true tokens rather than the drafts (the same wherever the drafts before were right and the
    text follows the target's argmax)."""
    head.eval()
    loss = [0.0] * ttt_steps
    hits = [0.0] * ttt_steps
    count = [0] * ttt_steps
    chain = chains = 0.0
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start:start + batch_size].to(device)
        out = ttt_losses(head, ids, target_batch(target, ids), num_steps=ttt_steps)
        for j in range(ttt_steps):
            n = out.correct[j].numel()
            loss[j] += float(out.losses[j]) * n
            hits[j] += float(out.correct[j].sum())
            count[j] += n
        rows = ids.shape[1] - ttt_steps  # rows t with a label at every step
        right = torch.stack([c.view(ids.shape[0], -1)[:, :rows] for c in out.correct]).float()
        chain += float(right.cumprod(0).sum())
        chains += ids.shape[0] * rows
    head.train()
    return {"loss_by_step": [round(x / n, 4) for x, n in zip(loss, count)],
            "top1_by_step": [round(x / n, 4) for x, n in zip(hits, count)],
            "top1_first_draft": round(hits[0] / count[0], 4), "positions": count[0],
            "mean_accepted_drafts": round(chain / chains, 4)}


def train_head(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    target_dir = PACKAGE_ROOT / PACKAGED[name]
    target_cfg = read_config(target_dir)
    target = load_model(target_dir, dtype="float32", device=device)
    for p in target.parameters():
        p.requires_grad_(False)
    metrics = json.loads((PACKAGE_ROOT / "metrics.json").read_text())
    test_files = set(metrics["corpus"]["test_files"])
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    streams = token_streams(tok, test_files)
    vocab = int(target_cfg["vocab_size"])
    draft_ids = draft_vocabulary(streams["train"], vocab, args.draft_vocab_size)
    test_counts = torch.bincount(streams["test"], minlength=vocab)
    coverage = float(test_counts[draft_ids].sum() / test_counts.sum())
    config = head_config(target_cfg, draft_vocab_size=int(draft_ids.numel()), aux_layer_ids=AUX_LAYER_IDS,
                         intermediate_size=args.intermediate_size, num_heads=args.num_heads,
                         num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)
    torch.manual_seed(args.seed)
    head = Eagle3Head(Eagle3Config.from_hf(config))
    init_head(head)
    head.set_vocab_map(draft_ids)
    head.to(device).train()
    head.share_embedding(target.model.embed_tokens)
    target.set_aux_hidden_layers(AUX_LAYER_IDS)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    train = streams["train"]
    s, b = args.seq_len, args.batch_size
    n_test = min(streams["test"].numel() // s, max(1, args.eval_tokens // s))
    test = streams["test"][: n_test * s].view(n_test, s)
    weights = [0.8**j for j in range(args.ttt_steps)]
    directory = args.out_dir / HEAD_DIRS[name]
    if args.eval_only:  # re-measure a saved head; its metrics.json keeps the training record
        result = evaluate(load_eagle3_head(directory, target, device=device), target, test, b, args.ttt_steps,
                          device)
        record = json.loads((directory / "metrics.json").read_text())
        record["heldout"].update(tokens=int(test.numel()), **result)
        (directory / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
        log(f"[{name}] held-out {result}")
        return record
    log(f"[{name}] head {sum(p.numel() for p in params):,} parameters, draft vocabulary {draft_ids.numel()} "
        f"(held-out coverage {coverage:.3f}); {args.steps} steps of {b} x {s}; "
        f"train {train.numel():,} tokens, test {test.numel():,}")
    curve = []
    start = time.perf_counter()
    running = [0.0] * args.ttt_steps
    for step in range(args.steps):
        offsets = torch.randint(0, train.numel() - s, (b,), generator=gen)
        ids = torch.stack([train[o:o + s] for o in offsets.tolist()]).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        out = ttt_losses(head, ids, target_batch(target, ids), num_steps=args.ttt_steps)
        loss = sum(w * x for w, x in zip(weights, out.losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = [r + float(x.detach()) for r, x in zip(running, out.losses)]
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            n = args.log_every if done % args.log_every == 0 else done % args.log_every
            point = {"step": done, "loss_by_step": [round(r / n, 4) for r in running],
                     "elapsed_s": round(time.perf_counter() - start, 1)}
            curve.append(point)
            log(f"[{name}] step {done}/{args.steps} loss by draft step {point['loss_by_step']} "
                f"{point['elapsed_s']}s")
            running = [0.0] * args.ttt_steps
    wall = time.perf_counter() - start
    size = save_eagle3_head(head, config, directory)
    if size > MAX_FILE_BYTES:
        raise SystemExit(f"{directory} weights are {size:,} bytes, over {MAX_FILE_BYTES:,}")
    saved = load_eagle3_head(directory, target, device=device)  # what users get: bf16-rounded
    result = evaluate(saved, target, test, b, args.ttt_steps, device)
    log(f"[{name}] held-out top-1 acceptance of the first draft {result['top1_first_draft']:.3f}; "
        f"by step {result['top1_by_step']}")
    record = {
        "target": PACKAGED[name],
        "command": "python -m tools.default_models.train_eagle3 " + " ".join(args.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__, "python_version": corpus.python_version(),
        "aux_layer_ids": AUX_LAYER_IDS, "draft_vocab_size": int(draft_ids.numel()),
        "draft_vocab_heldout_coverage": round(coverage, 4), "ttt_steps": args.ttt_steps,
        "step_weights": weights, "steps": args.steps, "batch_size": b, "seq_len": s, "lr": args.lr,
        "schedule": "linear warmup, cosine to 10%", "optimizer": "AdamW(0.9, 0.95), wd 0.01, clip 1.0",
        "seed": args.seed, "tokens_seen": args.steps * b * s, "train_tokens": int(train.numel()),
        "heldout": {"files": sorted(test_files), "tokens": int(test.numel()), **result},
        "parameters": sum(p.numel() for p in params), "file_bytes": size, "train_wall_time_s": round(wall, 1),
        "curve": curve,
    }
    (directory / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
    target.set_aux_hidden_layers(None)
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    for name in names:
        if name not in HEAD_DIRS:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(HEAD_DIRS)}")
    for name in names:
        train_head(name, args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
