"""Loss-curve plot and results table of the built-in default models, from their ``metrics.json``.

    python -m tools.default_models.plot                      # prints the markdown table, draws the PNG
    python -m tools.default_models.plot --update-doc docs/default-models.md

The table goes between ``<!-- metrics:begin -->`` and ``<!-- metrics:end -->`` of the doc with
``--update-doc``. Drawing needs matplotlib (``pip install -e .[train]``); the table does not.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- metrics:begin -->", "<!-- metrics:end -->"


def plot(metrics: dict, png: Path) -> None:
    """Training loss (and MTP loss) per step with the validation points and the unigram level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for i, (directory, m) in enumerate(metrics["models"].items()):
        color = f"C{i}"
        steps = [p["step"] for p in m["curve"]]
        ax.plot(steps, [p["loss"] for p in m["curve"]], color=color, label=f"{directory} train")
        if any("mtp_loss" in p for p in m["curve"]):
            ax.plot(steps, [p["mtp_loss"] for p in m["curve"]], color=color, linestyle=":",
                    label=f"{directory} MTP (token t+2) train")
        ax.plot([p["step"] for p in m["valid"]], [p["loss"] for p in m["valid"]], "o--", color=color,
                markersize=3, label=f"{directory} validation")
        ax.axhline(math.log(m["unigram_test_perplexity"]), color="gray", linestyle="-.", linewidth=0.8)
    ax.text(0.99, 0.02 + 0, "gray: unigram model on the test split", transform=ax.transAxes, ha="right",
            fontsize=8, color="gray")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"segkv default models on the Python {metrics['python_version']} standard library")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def markdown_table(metrics: dict) -> str:
    """One row per model: size, training, held-out perplexity against the unigram baseline, MTP."""
    rows = [
        "| model | `--model` | parameters | file | steps (epochs) | selected step | test perplexity "
        "| unigram perplexity | MTP perplexity (t+2) | MTP top-1 | train time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for directory, m in metrics["models"].items():
        test = m["test"]
        mtp = f"{test['mtp_perplexity']:.2f}" if "mtp_perplexity" in test else "-"
        top1 = f"{test['mtp_top1']:.1%}" if "mtp_top1" in test else "-"
        rows.append(
            f"| {directory} | `{m['name']}` | {m['parameters'] / 1e6:.2f} M | {m['file_bytes'] / 1e6:.1f} MB "
            f"| {m['steps']} ({m['epochs']}) | {m['selected_step']} | **{test['perplexity']:.2f}** "
            f"| {m['unigram_test_perplexity']:.2f} | {mtp} | {top1} | {m['train_wall_time_s']:.0f} s |")
    c = metrics["corpus"]
    rows += [
        "",
        f"Test split: {c['files']['test']} files, {c['tokens']['test']:,} tokens; training split "
        f"{c['files']['train']} files, {c['tokens']['train']:,} tokens (with {c['chat_examples']} chat "
        f"examples). Corpus sha256 `{c['sha256'][:16]}...`, Python {metrics['python_version']}, "
        f"torch {metrics['torch_version']}, seed {metrics['seed']}, device {metrics['device']}, "
        f"total {metrics['wall_time_s']:.0f} s.",
    ]
    for directory, m in metrics["models"].items():
        sample = m["sample"]["greedy"].replace("`", "'")
        rows += ["", f"Greedy continuation by {directory}:", "", "```python", sample, "```"]
    return "\n".join(rows)


def update_doc(doc: Path, table: str) -> None:
    text = doc.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block")
    doc.write_text(pattern.sub(lambda _: f"{BEGIN}\n{table}\n{END}", text))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.default_models.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", type=Path, default=REPO / "segkv" / "default_models" / "metrics.json")
    p.add_argument("--png", type=Path, default=REPO / "docs" / "images" / "default-models-loss.png")
    p.add_argument("--no-png", action="store_true", help="only print the table")
    p.add_argument("--update-doc", type=Path, help="write the table into this markdown file's metrics block")
    args = p.parse_args(argv)
    metrics = json.loads(args.metrics.read_text())
    table = markdown_table(metrics)
    print(table)
    if args.update_doc:
        update_doc(args.update_doc, table)
    if not args.no_png:
        plot(metrics, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
