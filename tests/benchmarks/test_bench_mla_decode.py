"""CPU checks of the MLA decode benchmark (benchmarks/mla_decode.py): its grid, byte counts,
torch default path, unchecked cache writes, the case/plan/bench plumbing (timers faked) and the
summary. The timed runs themselves need a CUDA device."""

from __future__ import annotations

import json

import pytest
import torch

from segkv.attention import DeviceSpec, TorchReferenceBackend, attend_piece
from benchmarks import mla_decode as mla
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, KVLayout


def test_parsing_and_grid():
    assert mla.parse_ints("1, 8,32") == [1, 8, 32]
    assert mla.parse_dtypes("bfloat16,float16") == ["bfloat16", "float16"]
    for bad in ("", "0,2", "a"):
        with pytest.raises(ValueError):
            mla.parse_ints(bad)
    with pytest.raises(ValueError):
        mla.parse_dtypes("int8")
    assert mla.latent_bytes(1, 131072, 2) == 131072 * 576 * 2
    assert mla.latent_bytes(32, 2048, 4, latent_dim=10) == 32 * 2048 * 10 * 4

    args = mla.build_parser().parse_args([])
    cases, skipped = mla.grid(mla.parse_ints(args.batches), mla.parse_ints(args.contexts),
                              mla.parse_dtypes(args.dtypes), max_latent_gib=args.max_latent_gib)
    assert len(cases) == 2 * 4 * 5 and not skipped  # the grid fits the default limit
    assert cases[0] == mla.Case("bfloat16", 1, 2048) and cases[-1] == mla.Case("float16", 32, 131072)
    assert [c.dtype for c in cases[:20]] == ["bfloat16"] * 20  # dtype-major: one command per dtype
    assert max(c.latent_bytes for c in cases) == 32 * 131072 * 576 * 2

    cases, skipped = mla.grid([1, 32], [2048, 131072], ["bfloat16"], max_latent_gib=1.0)
    assert [(c.batch, c.context) for c in cases] == [(1, 2048), (1, 131072), (32, 2048)]
    assert [(c.batch, c.context) for c, _ in skipped] == [(32, 131072)]
    assert "4.5 GiB" in skipped[0][1]


def test_l2_copies_and_layer_dims():
    l2 = 50 * 2**20
    assert mla.l2_copies(2**40, l2) == 1
    assert mla.l2_copies(2 * l2, l2) == 2 and mla.l2_copies(2 * l2 - 1, l2) == 3
    assert mla.l2_copies(1, l2) == mla.MAX_L2_COPIES
    assert mla.l2_copies(1, l2, cap=2) == 2
    big, lite = mla.layer_dims(128), mla.layer_dims(16)
    assert (big.hidden_size, big.q_lora_rank, lite.hidden_size, lite.q_lora_rank) == (5120, 1536, 2048, None)
    assert big.latent_dim == mla.LATENT_DIM == 576 and big.qk_head_dim == 192 and big.v_head_dim == 128
    assert big.attention_shape("absorbed").key_dim == 576
    # DeepSeek-V2's softmax scale: 192 ** -0.5 x (0.1 x 0.707 x ln 40 + 1) ** 2
    assert mla.softmax_scale(big) == pytest.approx(192**-0.5 * (0.1 * 0.707 * 2.302585 * 1.602060 + 1) ** 2, rel=1e-5)


def test_torch_default_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 10, generator=gen)
    latent = torch.randn(3, 7, 10, generator=gen)
    out = mla.torch_default_attention(q, latent, rank=6, scale=0.3)
    assert out.shape == (3, 4, 6)
    for b in range(3):
        want, _ = attend_piece(q[b:b + 1], latent[b].unsqueeze(1), latent[b, :, :6].unsqueeze(1),
                               torch.tensor([7]), scale=0.3)
        torch.testing.assert_close(out[b], want[0], rtol=1e-5, atol=1e-5)
    assert mla.torch_default_attention(q.double(), latent.double(), rank=6, scale=0.3).dtype == torch.float64


def test_unchecked_writes_match_the_storage():
    layout = KVLayout(num_layers=2, kind="mla", kv_lora_rank=5, rope_dim=3)
    caches = [PagedKVCache(layout, CacheConfig(page_size=4, num_pages=3)) for _ in range(2)]
    rows = torch.randn(3, 8)
    slots = torch.tensor([0, 5, 11])
    caches[0].storage.write(1, slots, rows)
    unchecked = mla.UncheckedLatentWrites(caches[1].storage)
    unchecked.write(1, slots, rows.double())  # cast to the cache dtype, like the storage
    assert torch.equal(caches[0].storage.latent[1], caches[1].storage.latent[1])
    assert not caches[1].storage.latent[0].any()
    assert unchecked.key_cache(1).data_ptr() == unchecked.value_cache(1).data_ptr()
    assert unchecked.value_cache(1).shape == (3, 4, 1, 5)
    with pytest.raises(ValueError):
        mla.UncheckedLatentWrites(PagedKVCache(KVLayout(num_layers=1, num_kv_heads=1, head_dim=4),
                                               CacheConfig(page_size=4, num_pages=2)).storage)


def test_output_checks():
    want = torch.tensor([[1.0, -4.0], [2.0, 0.0]])
    assert mla.relative_error(want + 0.5, want) == pytest.approx(0.125)
    fns = {"base": [lambda: want], "same": [lambda: (want.clone(), None)], "off": [lambda: want * 2],
           "broken": [lambda: 1 / 0]}
    rel, errors = mla.check_outputs(fns, "base")
    assert rel == {"same": 0.0, "off": 1.0}
    assert errors == {"broken": "check: ZeroDivisionError: division by zero"}


class _CallOnce:
    """Stands in for the CUDA-graph timer: calls each function once, then reports 1 ms."""

    def __init__(self, fns):
        for fn in fns:
            fn()
        self.calls = len(fns)

    @classmethod
    def capture(cls, fns):
        return cls(fns)

    def ms(self) -> float:
        return 1.0


def test_case_plans_and_benches_on_the_cpu(monkeypatch):
    monkeypatch.setattr(mla, "Timer", _CallOnce)
    gen = torch.Generator().manual_seed(0)
    case = mla.Case("float32", 2, 40)
    data = mla.build_case(case, page_size=16, l2_bytes=1, gen=gen, device="cpu")
    storage = data.cache.storage
    assert data.copies == 1 and len(data.chains[0]) == 2
    for chain, slot in zip(data.chains[0], data.slots[0].tolist()):
        assert chain.num_rows == 40 and chain.slots()[-1] == slot
    flat = storage.latent[0].flatten(0, 1)
    assert torch.equal(data.contiguous[0][1], flat[torch.tensor(data.chains[0][1].slots())])
    assert data.positions[0].tolist() == [39, 39]

    reference = TorchReferenceBackend(page_size=16)
    plans = mla.plan_case(data, 16, spec=DeviceSpec.cpu(), backend=reference, reference=reference)
    # 40 rows are too few for the CPU planner to split: the split figure comes from a forced split
    assert plans.planner_route == "single" and plans.split_forced
    assert plans.describe["split"]["route"] == "split" and plans.describe["split"]["max_partitions"] == 2
    assert set(plans.metadata_host_ms["totals"]) == {"segkv_single", "segkv_split", "torch_reference"}

    # the torch default path over the gathered rows equals the paged single plan
    q = torch.randn(2, 16, mla.LATENT_DIM, generator=gen)
    scale = mla.softmax_scale(mla.layer_dims(16))
    paged, _ = reference.run(plans.prepared["segkv_single"][0], q, storage.key_cache(0), storage.value_cache(0),
                             scale=scale)
    torch.testing.assert_close(mla.torch_default_attention(q, data.contiguous[0], rank=512, scale=scale), paged,
                               rtol=1e-4, atol=1e-4)

    row = mla.bench_kernel(data, 16, plans, backend=reference, trials=5, bandwidth=1e9, gen=gen)
    assert set(row["variants"]) == set(mla.KERNEL_VARIANTS)
    assert row["timing"] == {name: "cuda_graph" for name in mla.KERNEL_VARIANTS} and not row["errors"]
    assert row["bytes"] == row["latent_bytes"] == 2 * 40 * 576 * 4
    assert row["variants"]["segkv_split"]["gbps"] == pytest.approx(row["bytes"] / 1e-3 / 1e9)
    assert row["speedup"] == {"split_vs_single": 1.0, "split_vs_torch": 1.0}
    assert set(row["relative_error"]) == {"segkv_single", "segkv_split"}
    assert max(row["relative_error"].values()) < 1e-5  # each variant checked against torch_default

    before = flat.clone()
    last = data.slots[0]
    row = mla.bench_layer(data, 16, plans, backend=reference, reference=reference, trials=5, bandwidth=1e9,
                          l2_bytes=1, gen=gen)
    assert set(row["variants"]) == set(mla.LAYER_VARIANTS) and row["layer_copies"] == 1
    assert max(row["relative_error"].values()) < 1e-4 and not row["errors"]
    assert row["bytes"] == row["latent_bytes"] + row["weight_bytes"] and row["weight_bytes"] > 4 * 2048 * 2048
    changed = (flat != before).any(dim=1).nonzero().flatten()
    assert changed.tolist() == sorted(last.tolist())  # only the new token's slots were written
    assert "metadata(host, untimed)=" in mla.format_row(row, 3.0)
    data.release()
    assert data.cache.stats()["pages_in_use"] == 0


def _variant(ms: float, spread: float = 0.01, fraction: float = 0.5) -> dict:
    return {"median_ms": ms, "min_ms": ms - spread, "max_ms": ms + spread, "gbps": 1.0,
            "fraction_of_bandwidth": fraction}


def _fake_row(level, heads, batch, context, route, single, split, torch_ms, fraction=0.5, forced=False):
    plan = {"route": route, "max_partitions": 8 if route == "split" else 1}
    row = {"level": level, "heads": heads, "batch": batch, "context": context, "dtype": "bfloat16",
           "page_size": 16, "planner_route": route, "split_forced": forced,
           "plans": {"single": {"route": "single", "max_partitions": 1}, "auto": plan,
                     "split": {"route": "split", "max_partitions": 8}},
           "timing": {}, "errors": {},
           "variants": {"segkv_single": _variant(single), "segkv_split": _variant(split, fraction=fraction),
                        mla.TORCH_VARIANT[level]: _variant(torch_ms)}}
    row["speedup"] = mla.speedups(row)
    return row


def test_summary_of_fabricated_rows(tmp_path, capsys):
    rows = [
        _fake_row("kernel", 16, 1, 32768, "split", single=0.10, split=0.05, torch_ms=2.0, fraction=0.85),
        _fake_row("kernel", 128, 1, 131072, "split", single=0.30, split=0.25, torch_ms=3.0, fraction=0.7),
        _fake_row("kernel", 16, 8, 8192, "split", single=0.10, split=0.13, torch_ms=1.0),  # slower, beyond noise
        _fake_row("kernel", 16, 32, 8192, "split", single=0.100, split=0.105, torch_ms=1.0),  # within noise
        _fake_row("kernel", 16, 32, 2048, "single", single=0.05, split=0.06, torch_ms=1.0, forced=True),
        _fake_row("kernel", 16, 1, 2048, "split", single=0.05, split=0.04, torch_ms=1.0),  # short context
        _fake_row("layer", 16, 1, 65536, "split", single=0.40, split=0.30, torch_ms=6.0),
    ]
    assert rows[0]["speedup"]["split_vs_single"] == pytest.approx(2.0)
    assert rows[0]["speedup"]["split_vs_torch"] == pytest.approx(40.0)
    summary = mla.summarise(rows)
    long_rows = summary["batch1_long_context"]
    assert [(e["level"], e["heads"], e["context"]) for e in long_rows] == [
        ("kernel", 16, 32768), ("kernel", 128, 131072), ("layer", 16, 65536)]
    assert long_rows[0]["meets"] == {"fraction": True, "vs_single": True, "vs_torch": True}
    assert long_rows[1]["meets"] == {"fraction": False, "vs_single": False, "vs_torch": False}
    assert "meets" not in long_rows[2] and long_rows[2]["split_vs_torch"] == pytest.approx(20.0)
    assert summary["rows"] == {"kernel": 6, "layer": 1}
    assert summary["planner_split"] == {"kernel": 5, "layer": 1}
    slower = summary["split_slower_than_single"]  # the forced split at B=32 ctx=2048 is not counted
    assert [(s["batch"], s["context"], s["beyond_noise"]) for s in slower] == [(8, 8192, True), (32, 8192, False)]
    assert slower[0]["slowdown"] == pytest.approx(1.3)

    text = "\n".join(mla.format_summary(summary))
    assert "85% of bandwidth, 2.00x single, 40.0x torch_default" in text
    assert "fraction MISSED, vs_single MISSED, vs_torch MISSED" in text
    assert "kernel level: planner chose split in 5 of 6 rows; split slower than single in 2 of them" in text
    assert "beyond min/max noise: yes" in text and "beyond min/max noise: no" in text
    line = mla.format_row(rows[4], 12.0)
    assert line.startswith("[   12s] kernel H= 16 B=32 ctx=  2048") and "(split forced x8)" in line
    assert "split/single=0.83x" in line

    # a grid split across two reports: one summary of both
    for i, part in enumerate((rows[:3], rows[3:])):
        (tmp_path / f"r{i}.json").write_text(json.dumps({"device": "GPU", "rows": part}))
    assert mla.main(["--summarise", str(tmp_path / "r0.json"), str(tmp_path / "r1.json")]) == 0
    out = capsys.readouterr().out
    assert "devices: GPU; 7 rows" in out and "split slower than single in 2 of them" in out
