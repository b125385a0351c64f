"""KV rows a long request holds on a model whose every layer attends a sliding window: the
engine gives back the pages behind the window (``EngineCore``), against the same engine keeping
every row. A random model of Mistral's architecture (``--layers``/``--hidden`` small enough for
the CPU), the built-in default model's tokenizer; the figures are rows and pages, which the
model's size does not change.

    python -m benchmarks.window_memory --prompt 30720 --new 2048 --window 4096
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.decode_e2e import build_segkv
from segkv.models.default_models import resolve_model_dir
from segkv.engine.llm import LLM
from segkv.sampling_params import SamplingParams


def mistral_dir(out: Path, *, window: int, layers: int, hidden: int, max_len: int) -> Path:
    """A random Mistral-architecture checkpoint with ``window`` on every layer, and the default
    model's tokenizer."""
    source = resolve_model_dir("default")
    own = json.loads((source / "config.json").read_text())
    cfg = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
           "vocab_size": own["vocab_size"], "hidden_size": hidden, "intermediate_size": 2 * hidden,
           "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": hidden // 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "max_position_embeddings": max_len, "sliding_window": window, "torch_dtype": "float32"}
    model, _ = build_segkv(cfg, device=torch.device("cpu"), dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
    return out


def run(llm: LLM, prompt: list[int], new: int, *, release: bool) -> dict:
    """One greedy request through the engine core: rows held per step, peak pages, time."""
    core = llm.core
    if not release:
        core.window = None
    held: list[int] = []
    core.step_listeners.append(lambda _: held.extend(s.chain.num_rows - s.chain.num_released_rows
                                                     for s in core.running))
    core.pool.reset_peak()
    start = time.perf_counter()
    request = core.add_request(prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
                               cache_rows=False)
    while core.has_unfinished():
        core.step()
    elapsed = time.perf_counter() - start
    core.step_listeners.pop()
    return {"tokens": request.output().outputs[0].token_ids, "max_rows_held": max(held),
            "final_rows_held": held[-1], "peak_pages": core.pool.peak_pages_in_use,
            "seconds": elapsed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.window_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=30720)
    p.add_argument("--new", type=int, default=2048)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--budget", type=int, default=2048, help="the scheduler's tokens per step (its default)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    total = args.prompt + args.new
    with tempfile.TemporaryDirectory() as tmp:
        directory = mistral_dir(Path(tmp) / "model", window=args.window, layers=args.layers, hidden=args.hidden,
                                max_len=max(total + 16, 2 * args.window))
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
        prompt = torch.randint(0, vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        pages = -(-total // args.page_size) + 8
        results = {}
        for release in (True, False):
            llm = LLM(directory, dtype="float32", device="cpu", page_size=args.page_size, num_pages=pages,
                      max_num_batched_tokens=args.budget)
            results["released" if release else "kept"] = run(llm, prompt, args.new, release=release)
    same = results["released"].pop("tokens") == results["kept"].pop("tokens")
    report = {"device": platform.processor() or "cpu", "args": vars(args), "same_tokens": same, **results}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = same and results["released"]["max_rows_held"] <= args.window + args.page_size
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
