"""Where a decode attention call's time goes: each stage-1 and merge program's timeline (CUDA only).

The planner's plan for ``--cases`` (batch x context; ``--shape``, ``--page-sizes``) runs in a
CUDA graph over enough copies of the data that L2 is cold for each call (as
``benchmarks.decode_attention`` times it), with the programs writing their stamps
(``kernels.attention.timeline``: ``%globaltimer`` at each program's start, after its PDL wait and at its
end; ``%clock64`` for durations). ``--cascade``: also 16 forks of a 32K prefix with 512 rows
each, the planner's cascade plan, its prefix (tall) and suffix programs apart. For each call it
prints, in us from the first stage-1 program's start: when programs start, wait and end
(percentiles), their durations, the merge's wait and end after the last stage-1 program, and
the bytes at the copy rate. ``python3 scripts/stage1_timeline.py --trials 5``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
from segkv.attention.triton_backend import TritonBackend
from benchmarks.decode_attention import (
    SHAPES,
    Timer,
    fill_random,
    forked_prefix,
    l2_copies,
    measured_read_bandwidth,
)
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, CompactionPolicy, KVLayout
from segkv.kernels.attention import paged_attention as pa
from segkv.kernels.attention.timeline import FIELDS

STAMP_ROWS = 1 << 16  # programs a stamp buffer holds (more than any launch here)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarise(s1: torch.Tensor, merge: torch.Tensor, t0: int, last_end: int) -> dict:
    """Stage-1 stamps of some programs and the merge's (rows of programs that recorded), times in
    us from ``t0`` (ns); ``last_end``: the last stage-1 program's end (ns)."""
    us = lambda t: (t - t0) / 1e3  # noqa: E731
    starts = [us(t) for t in s1[:, 0].tolist()]
    waits = [us(t) for t in s1[:, 1].tolist()]
    ends = [us(t) for t in s1[:, 2].tolist()]
    ghz = statistics.median(((s1[:, 5] - s1[:, 3]).double() / (s1[:, 2] - s1[:, 0]).clamp(min=1).double()).tolist())
    cycles_us = [(c2 - c0) / ghz / 1e3 for c0, c2 in zip(s1[:, 3].tolist(), s1[:, 5].tolist())]
    per_sm: dict[int, int] = {}
    for sm in s1[:, 6].tolist():
        per_sm[sm] = per_sm.get(sm, 0) + 1
    out = {
        "programs": len(ends), "sms": len(per_sm), "max_per_sm": max(per_sm.values()),
        "start_p50": pct(starts, 0.5), "start_max": max(starts), "wait_max": max(w - s for w, s in zip(waits, starts)),
        "end_p01": pct(ends, 0.01), "end_p10": pct(ends, 0.1), "end_p50": pct(ends, 0.5), "end_p90": pct(ends, 0.9),
        "end_max": max(ends), "dur_min": min(cycles_us), "dur_p50": pct(cycles_us, 0.5), "dur_max": max(cycles_us),
        "ghz": ghz,
    }
    if len(merge):  # the merge's programs, from the last stage-1 program's end
        after = lambda col: [us(t) - us(last_end) for t in merge[:, col].tolist()]  # noqa: E731
        m_start, m_wait, m_end = after(0), after(1), after(2)
        out.update({
            "merge_programs": len(m_end), "merge_start_p10": pct(m_start, 0.1), "merge_start_p50": pct(m_start, 0.5),
            "merge_start_p90": pct(m_start, 0.9), "merge_start_max": max(m_start), "merge_wait_min": min(m_wait),
            "merge_wait_p50": pct(m_wait, 0.5), "merge_wait_max": max(m_wait), "merge_end_p10": pct(m_end, 0.1),
            "merge_end_p50": pct(m_end, 0.5), "merge_end_max": max(m_end),
            "merge_after_wait_p50": pct([e - w for e, w in zip(m_end, m_wait)], 0.5),
            "merge_after_wait_max": max(e - w for e, w in zip(m_end, m_wait)),
            "span": us(merge[:, 2].max().item()),
        })
    return out


def program_classes(plan, programs: torch.Tensor, num_kv: int) -> list[str]:
    """Each stage-1 program's class by its work item: "tall" (several query rows: a shared
    piece's) or "one row". ``programs``: grid indices, x fastest, in the launch's order."""
    num_work = len(plan.work)
    work = [(i // num_kv) % num_work for i in programs.tolist()]  # a piece's KV heads side by side
    return ["tall" if len(plan.work[w].query_rows) > 1 else "one row" for w in work]


def timelines(label: str, calls: list, plans: list, num_kv: int, kv_bytes: int, bandwidth: float,
              trials: int) -> None:
    """Time ``calls`` (one per data copy) plain and stamped in graphs; print their timelines."""
    plain = Timer.capture(calls)
    stamps = [{name: torch.zeros(STAMP_ROWS, FIELDS, dtype=torch.int64, device="cuda") for name in ("stage1", "merge")}
              for _ in calls]
    stamped_calls = []
    for call, buffers in zip(calls, stamps):
        def stamped(call=call, buffers=buffers):
            pa.TIMELINE_STAMPS.update(buffers)
            try:
                return call()
            finally:
                pa.TIMELINE_STAMPS.clear()
        stamped_calls.append(stamped)
    timed = Timer.capture(stamped_calls)
    print(f"\n{label}: plan {plans[0].describe()}")
    print(f"  graph ms per call: plain {plain.ms():.4f}, stamped {timed.ms():.4f}; bytes at the copy rate "
          f"{kv_bytes / bandwidth * 1e6:.1f} us")
    rows: dict[str, list[dict]] = {}
    for _ in range(trials):
        for buffers in stamps:
            for t in buffers.values():
                t.zero_()
        timed.replay()
        torch.cuda.synchronize()
        for buffers, plan in zip(stamps, plans):
            stage1 = buffers["stage1"].cpu()
            recorded = torch.nonzero(stage1[:, 2]).flatten()
            s1 = stage1[recorded]
            merge = buffers["merge"][buffers["merge"][:, 2] != 0].cpu()
            t0, last_end = s1[:, 0].min().item(), s1[:, 2].max().item()
            rows.setdefault("all", []).append(summarise(s1, merge, t0, last_end))
            classes = program_classes(plan, recorded, num_kv)
            if len(set(classes)) > 1:
                for name in sorted(set(classes)):
                    keep = torch.tensor([c == name for c in classes])
                    rows.setdefault(name, []).append(summarise(s1[keep], merge[:0], t0, last_end))
    for name, found in rows.items():
        print(f"  -- {name} programs")
        for key in found[0]:
            vals = [r[key] for r in found]
            print(f"  {key:>24}: median {statistics.median(vals):9.2f}  [{min(vals):9.2f} .. {max(vals):9.2f}]")


def run_case(shape_name: str, batch: int, context: int, page_size: int, trials: int, bandwidth: float) -> None:
    q_heads, kv_heads, head_dim = SHAPES[shape_name]
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    copies = l2_copies(kv_bytes, torch.cuda.get_device_properties(0).L2_cache_size)  # L2 cold for each call
    pages = batch * -(-context // page_size)
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=copies * pages + 1), device="cuda",
                         compaction=CompactionPolicy(enabled=False))
    fill_random(cache, gen)
    kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
    shape = AttentionShape(q_heads, kv_heads, head_dim, head_dim)
    backend = TritonBackend(page_size=page_size, device="cuda")
    calls, plans = [], []
    for _ in range(copies):
        queries = []
        for _ in range(batch):
            chain = cache.new_chain()
            chain.append(context)
            queries.append(SequenceQuery.from_chain(chain, 1))
        plan = plan_attention(queries, shape, DeviceSpec.cuda(), page_size=page_size)
        prepared = backend.prepare(plan)
        q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
        calls.append(lambda p=prepared, q=q: backend.run(p, q, kc, vc, scale=head_dim**-0.5))
        plans.append(plan)
    timelines(f"{shape_name} batch {batch} / {context // 1024}K, pages of {page_size}", calls, plans, kv_heads,
              kv_bytes, bandwidth, trials)


def run_cascade(shape_name: str, page_size: int, trials: int, bandwidth: float, forks: int = 16,
                prefix: int = 32768, suffix: int = 512) -> None:
    q_heads, kv_heads, head_dim = SHAPES[shape_name]
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache, root, chains = forked_prefix(kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, forks=forks, prefix=prefix,
                                        suffix=suffix, page_size=page_size, generator=gen)
    plan = plan_attention([SequenceQuery.from_chain(c, 1) for c in chains], AttentionShape(q_heads, kv_heads, head_dim,
                                                                                          head_dim),
                          DeviceSpec.cuda(), page_size=page_size)
    backend = TritonBackend(page_size=page_size, device="cuda")
    prepared = backend.prepare(plan)
    q = torch.randn(forks, q_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    kc, vc = cache.storage.key_cache(0), cache.storage.value_cache(0)
    kv_bytes = 2 * (prefix + forks * suffix) * kv_heads * head_dim * 2
    timelines(f"{shape_name} cascade, {forks} forks of {prefix // 1024}K + {suffix}, pages of {page_size}",
              [lambda: backend.run(prepared, q, kc, vc, scale=head_dim**-0.5)], [plan], kv_heads, kv_bytes, bandwidth,
              trials)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--cases", default="1x32768,1x131072", help="batch x context, comma list ('' for none)")
    parser.add_argument("--page-sizes", default="32,16")
    parser.add_argument("--cascade", action="store_true", help="also the cascade, at each page size")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    bandwidth = measured_read_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy rate {bandwidth / 1e12:.2f} TB/s")
    for page_size in (int(p) for p in args.page_sizes.split(",")):
        for case in filter(None, args.cases.split(",")):
            batch, context = (int(x) for x in case.split("x"))
            run_case(args.shape, batch, context, page_size, args.trials, bandwidth)
            torch.cuda.empty_cache()
        if args.cascade:
            run_cascade(args.shape, page_size, args.trials, bandwidth)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
