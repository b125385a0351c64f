"""Measure KV cache bytes allocated by a fork and a follow-up turn: segkv against a contiguous cache."""

from __future__ import annotations

import argparse
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from segkv.cache import KVChain, PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout

SECTION = "## KV cache memory: forks and follow-up turns"
DOC_HEADER = "# Benchmarks\n\nResults of the scripts in `benchmarks/`, each with the command that made it.\n"
CHUNK_ROWS = 4096
NOTES = """\
Bytes that forking a conversation, then running one follow-up turn on the fork, allocate in
the KV cache. segkv: deltas of the pool's `bytes_allocated_total`, `bytes_copied` and
`pages_in_use` (peak delta: `peak_bytes_in_use` after `reset_peak()` minus bytes in use before).
The history is sealed turns `[big, s, s, s]`, `s = 2 x follow-up`; default compaction leaves
`[big, 2s, s]`, so the measured turn (append, `storage.write` of random rows into every layer,
seal) merges nothing; a turn that does merge also copies the small trailing segments (at most
`max_copy_rows` rows). The script fails unless a fork allocates and copies 0 bytes and the turn
allocates exactly `ceil(follow-up / page_size)` pages.

Baseline, in plain torch: what transformers' `DynamicCache` does, one `(1, heads, seq, head_dim)`
K and V per layer (MLA: one latent tensor with segkv's bytes per row, less than transformers'
non-absorbed DeepSeek cache), `torch.cat([old, new], dim=-2)` per update, a deep copy per fork.
Bytes allocated: `untyped_storage().nbytes()` of the tensors the copy or the cats created; peak
transient: most cache bytes alive above the start (old and grown tensor coexist during a cat).
The turn is one cat per tensor, the baseline's best case (decoding cats once per token).
Ratio: baseline bytes allocated / segkv bytes allocated."""


@dataclass(slots=True)
class Row:
    """One table row: what segkv's pool and the contiguous baseline spent on one operation."""

    operation: str
    history: int
    alloc: int  # segkv (pool counter deltas)
    pages: int
    copied: int
    peak: int
    base_alloc: int
    base_peak: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags; defaults give the 4-layer bf16 MHA toy configuration."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.cache_memory", description=__doc__)
    p.add_argument("--kind", choices=("mha", "mla"), default="mha")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="KV heads (mha only)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (mha only)")
    p.add_argument("--kv-lora-rank", type=int, default=512, help="mla only")
    p.add_argument("--rope-dim", type=int, default=64, help="mla only")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--histories", default="8192,32768", help="comma-separated history rows")
    p.add_argument("--follow-up", type=int, default=512, help="rows of the follow-up turn")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", default="docs/benchmarks.md", help="markdown file to update")
    p.add_argument("--no-docs", action="store_true", help="print only; leave the docs alone")
    return p.parse_args(argv)


def make_layout(args: argparse.Namespace) -> KVLayout:
    """The KVLayout the flags describe."""
    if args.kind == "mla":
        return KVLayout(num_layers=args.layers, kind="mla", kv_lora_rank=args.kv_lora_rank,
                        rope_dim=args.rope_dim, dtype=args.dtype)
    return KVLayout(num_layers=args.layers, kind="mha", num_kv_heads=args.heads,
                    head_dim=args.head_dim, dtype=args.dtype)


def history_turns(history: int, follow_up: int, policy: CompactionPolicy) -> list[int]:
    """Turn sizes of a history: one big first turn, then three turns of ``ratio * follow_up``.

    The first turn is bigger than ``policy.max_copy_rows`` so it is never copied. Sealing the
    second small turn merges it with the first (default compaction), leaving ``[big, 2s, s]``;
    the last segment holds ``ratio`` times the follow-up, so the measured turn merges nothing.
    """
    small = int(-(-policy.ratio * follow_up // 1))
    first = history - 3 * small
    if first <= policy.max_copy_rows:
        raise ValueError(f"history of {history} rows is too short: it needs a first turn of more "
                         f"than {policy.max_copy_rows} rows plus 3 turns of {small} rows")
    return [first, small, small, small]


def pool_pages(histories: list[int], follow_up: int, page_size: int, policy: CompactionPolicy) -> int:
    """Pages for the largest history, its compaction copy and one follow-up turn."""
    turns = history_turns(max(histories), follow_up, policy)
    return sum(-(-n // page_size) for n in [*turns, 2 * turns[-1], follow_up])


def random_rows(layout: KVLayout, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random new rows of one layer: ``(k, v)`` each (n, heads, head_dim) or ``(latent,)``."""
    if layout.kind == "mha":
        shape = (n, layout.num_kv_heads, layout.head_dim)
        return (torch.randn(shape, dtype=layout.dtype, device=device),
                torch.randn(shape, dtype=layout.dtype, device=device))
    return (torch.randn((n, layout.key_dim), dtype=layout.dtype, device=device),)


def append_turn(cache: PagedKVCache, chain: KVChain, num_rows: int, *, fresh: bool = True) -> None:
    """Append ``num_rows`` rows, write random K/V into every layer in chunks, then seal.

    ``fresh=False`` writes the same random chunk into every layer (a faster history build).
    """
    slots = torch.tensor(chain.append(num_rows), dtype=torch.long)
    for start in range(0, num_rows, CHUNK_ROWS):
        idx = slots[start:start + CHUNK_ROWS]
        rows = random_rows(cache.layout, len(idx), cache.storage.device)
        for layer in range(cache.layout.num_layers):
            if fresh and layer:
                rows = random_rows(cache.layout, len(idx), cache.storage.device)
            cache.storage.write(layer, idx, *rows)
    chain.seal()


def pool_delta(cache: PagedKVCache, op) -> tuple[object, dict[str, int]]:
    """Run ``op()`` and return its result with the pool counter deltas it caused."""
    pool = cache.pool
    alloc, copied = pool.bytes_allocated_total, pool.bytes_copied
    pages, used = pool.pages_in_use, pool.bytes_in_use
    pool.reset_peak()
    result = op()
    return result, {"alloc": pool.bytes_allocated_total - alloc, "copied": pool.bytes_copied - copied,
                    "pages": pool.pages_in_use - pages, "peak": pool.peak_bytes_in_use - used}


def nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``."""
    return sum(t.untyped_storage().nbytes() for t in tensors)


def contiguous_cache(layout: KVLayout, seq: int, device: torch.device) -> list[torch.Tensor]:
    """Baseline cache like transformers' DynamicCache, holding ``seq`` random rows.

    MHA: K and V of shape ``(1, num_kv_heads, seq, head_dim)`` per layer. MLA: one latent
    ``(1, 1, seq, kv_lora_rank + rope_dim)`` per layer (segkv's bytes per row).
    """
    mha = layout.kind == "mha"
    shape = (1, layout.num_kv_heads, seq, layout.head_dim) if mha else (1, 1, seq, layout.key_dim)
    count = layout.num_layers * (2 if mha else 1)
    return [torch.randn(shape, dtype=layout.dtype, device=device) for _ in range(count)]


def cat_update(tensors: list[torch.Tensor], num_rows: int) -> tuple[int, int]:
    """``torch.cat([old, new], dim=-2)`` of ``num_rows`` random rows onto every tensor, in place.

    Returns the bytes the cats created and the peak of live cache bytes above the start: a
    tensor's old and grown storage are alive together during its cat.
    """
    live = peak = start = nbytes(tensors)
    created = 0  # bytes of the grown tensors
    for i, old in enumerate(tensors):
        new = torch.randn(old.shape[:2] + (num_rows, old.shape[3]), dtype=old.dtype, device=old.device)
        grown = torch.cat([old, new], dim=-2)
        created, live = created + nbytes([grown]), live + nbytes([grown])
        peak, live = max(peak, live), live - nbytes([old])
        tensors[i] = grown  # the old tensor is freed here
    return created, peak - start


def measure_segkv(cache: PagedKVCache, history: int, follow_up: int) -> tuple[dict, dict, list[int]]:
    """Pool deltas of forking a ``history``-row chain and of a turn on the fork; its segments."""
    parent = cache.new_chain()
    for turn in history_turns(history, follow_up, cache.compaction):
        append_turn(cache, parent, turn, fresh=False)
    child, fork_delta = pool_delta(cache, parent.fork)
    _, turn_delta = pool_delta(cache, lambda: append_turn(cache, child, follow_up))
    segments = [ref.num_rows for ref in parent.refs]
    child.release()
    parent.release()
    assert cache.pool.pages_in_use == 0, "pages leaked by the benchmark"
    return fork_delta, turn_delta, segments


def measure_baseline(layout: KVLayout, history: int, follow_up: int, device: torch.device) -> tuple[int, ...]:
    """Contiguous cache: (fork bytes, turn bytes, turn peak); a fork is a deep copy."""
    parent = contiguous_cache(layout, history, device)
    child = [t.clone() for t in parent]
    return (nbytes(child), *cat_update(child, follow_up))


def check(row: Row, expected_pages: int, bytes_per_page: int) -> list[str]:
    """Failures of the exact expectations: ``expected_pages`` new pages, nothing copied."""
    want = expected_pages * bytes_per_page
    got = {"bytes allocated": (row.alloc, want), "peak delta": (row.peak, want),
           "pages in use delta": (row.pages, expected_pages), "bytes copied": (row.copied, 0)}
    return [f"{row.operation} @ {row.history} rows: {name} {value:,} != expected {exp:,}"
            for name, (value, exp) in got.items() if value != exp]


def format_table(rows: list[Row]) -> str:
    """The markdown table of all measured rows."""
    lines = ["| operation | history rows | segkv bytes allocated | segkv bytes copied | segkv peak delta "
             "| baseline bytes allocated | baseline peak transient | ratio |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        ratio = "∞ (segkv 0)" if r.alloc == 0 else f"{r.base_alloc / r.alloc:,.0f}×"
        lines.append(f"| {r.operation} | {r.history:,} | {r.alloc:,} ({r.pages} pages) | "
                     f"{r.copied:,} | {r.peak:,} | {r.base_alloc:,} | {r.base_peak:,} | {ratio} |")
    return "\n".join(lines)


def update_docs(path: Path, section: str) -> None:
    """Create ``path`` if needed and replace (or append) this benchmark's section only."""
    text = path.read_text() if path.exists() else DOC_HEADER
    start = text.find(SECTION)
    if start < 0:
        before, after = text.rstrip("\n") + "\n\n", ""
    else:
        end = text.find("\n## ", start + len(SECTION))
        before, after = text[:start], "" if end < 0 else "\n" + text[end + 1:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(before + section.rstrip("\n") + "\n" + after)


def config_line(args: argparse.Namespace, cache: PagedKVCache, chains: list[str]) -> str:
    """Device, layout, page and pool sizes, compaction policy and the history chains."""
    layout, pool, policy = cache.layout, cache.pool, cache.compaction
    shape = (f"{layout.num_kv_heads} KV heads x head_dim {layout.head_dim}" if layout.kind == "mha"
             else f"latent {layout.kv_lora_rank}+{layout.rope_dim}")
    return (f"device {args.device} ({platform.machine()}, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}); {layout.kind}, {layout.num_layers} layers, {shape}, "
            f"{str(layout.dtype).removeprefix('torch.')}; page size {pool.page_size} rows = "
            f"{pool.bytes_per_page:,} bytes per page (all layers); pool {pool.num_pages:,} pages; "
            f"default compaction (ratio {policy.ratio:g}, max copy {policy.max_copy_rows} rows); "
            f"history chains (segment rows): {'; '.join(chains)}")


def main(argv: list[str] | None = None) -> int:
    """Run every history length, print the table, check it, and update the docs on success."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    layout = make_layout(args)
    histories = [int(h) for h in args.histories.split(",") if h.strip()]
    policy = CompactionPolicy()  # the cache's default
    try:
        pages = pool_pages(histories, args.follow_up, args.page_size, policy)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    cache = PagedKVCache(layout, CacheConfig(page_size=args.page_size, num_pages=pages),
                         device=args.device, compaction=policy)
    rows, failures, chains = [], [], []
    turn_pages = cache.pool.pages_for_rows(args.follow_up)
    for history in histories:
        fork_delta, turn_delta, segments = measure_segkv(cache, history, args.follow_up)
        fork_bytes, turn_bytes, turn_peak = measure_baseline(layout, history, args.follow_up, args.device)
        chains.append(f"{history:,}: {segments}")
        measured = [Row("fork", history, **fork_delta, base_alloc=fork_bytes, base_peak=fork_bytes),
                    Row(f"follow-up turn (+{args.follow_up} rows)", history, **turn_delta,
                        base_alloc=turn_bytes, base_peak=turn_peak)]
        failures += check(measured[0], 0, cache.pool.bytes_per_page)
        failures += check(measured[1], turn_pages, cache.pool.bytes_per_page)
        rows += measured
    config, table = config_line(args, cache, chains), format_table(rows)
    print(config + "\n\n" + table)
    if failures:
        print("\nFAILED:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    if not args.no_docs:
        command = " ".join([".venv/bin/python -m benchmarks.cache_memory", *argv])
        update_docs(Path(args.docs), f"{SECTION}\n\n{NOTES}\n\n```\n{command}\n```\n\n{config}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
