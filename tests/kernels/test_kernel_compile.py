"""The attention kernels compiled for Hopper (sm_90a) without a GPU: properties that otherwise only
show on the GPU, checked on every CI run.

* The stage-1 loops keep the next K/V (latent) tile in flight: Triton's pipeliner gives the tiles
  two shared-memory buffers and waits in the loop with copies outstanding. (With the page indices
  loaded in the tile's own iteration it kept one buffer and waited for everything, and every
  program paid a full memory latency per tile.)
* The largest launches the launchers make fit in a program's shared memory (float32 tiles of 64
  rows x 256-wide heads with two buffers did not, and failed on the GPU).

The kernels are compiled in one subprocess without ``TRITON_INTERPRET`` (the tests run the
kernels in Triton's interpreter, whose kernels cannot be compiled).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend cannot compile for sm_90a")

from segkv.kernels.offline_compile import MAX_SHARED_PER_PROGRAM  # noqa: E402

DECODE = [
    {"kernel": "gqa", "dtype": "bfloat16", "head_dim": 128, "page_size": 16, "rows": 1},
    # 8 heads per KV head (the 70B shape)
    {"kernel": "gqa", "dtype": "bfloat16", "head_dim": 128, "page_size": 16, "rows": 1, "group": 8},
    {"kernel": "latent", "dtype": "bfloat16", "page_size": 16, "rows": 1},
]
LARGEST = [
    {"kernel": "gqa", "dtype": "float32", "head_dim": 256, "page_size": 64, "rows": 1},  # 128 KB per tile
    {"kernel": "gqa", "dtype": "bfloat16", "head_dim": 256, "page_size": 64, "rows": 1},
    {"kernel": "gqa", "dtype": "bfloat16", "head_dim": 128, "page_size": 64, "rows": 16},  # 64-pair programs
    {"kernel": "latent", "dtype": "bfloat16", "page_size": 64, "rows": 1},
]  # (float32 latent and 64-pair tiles take 17-29 s each to compile: the tile-size rule covers them, see
#    test_pipeline_stages_shrink_to_fit_shared_memory)


def compile_cases(cases: list[dict], **env_vars: str) -> list[dict]:
    """The offline compiler's report of each case, in a subprocess without the interpreter (and
    with ``env_vars`` set)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env_vars
    out = subprocess.run([sys.executable, "-m", "segkv.kernels.offline_compile"], input=json.dumps(cases),
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == cases
    return results


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return compile_cases(DECODE + LARGEST)


@pytest.mark.parametrize("index", range(len(DECODE)), ids=[f"{c['kernel']}-g{c.get('group', 4)}" for c in DECODE])
def test_decode_loops_keep_the_next_tile_in_flight(compiled, index):
    r = compiled[index]
    assert r["num_stages"] == 3
    assert r["buffers"] >= 2, f"tiles not double-buffered: {r}"
    assert r["waits"] and r["waits"][0] >= 1, f"the loop waits for every copy: {r}"


@pytest.mark.parametrize("index", range(len(LARGEST)),
                         ids=[f"{c['kernel']}-{c['dtype']}-{c.get('head_dim', 576)}-p{c['page_size']}-r{c['rows']}"
                              for c in LARGEST])
def test_largest_launches_fit_in_shared_memory(compiled, index):
    r = compiled[len(DECODE) + index]
    assert 0 < r["shared"] <= MAX_SHARED_PER_PROGRAM, r


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_latent_value_split_compiles_for_narrow_ranks(dtype):
    """A batch of one query row splits the latent values per plan (halves, or quarters when asked);
    small models' ranks (16 heads of rank 32 / rope 16, as the engine's test models) compile, with
    each share kept at 16 or more value columns, rather than failing on the GPU at the first launch."""
    cases = [{"kernel": "latent", "dtype": dtype, "page_size": 16, "rows": 1, "rank": rank, "rope": 16,
              "heads": 4, "one_query": True} for rank in (16, 32)]
    reports = compile_cases(cases)
    assert all(r["shared"] > 0 and r["num_stages"] >= 1 for r in reports), reports
    assert all(r["mma"] != "none" for r in reports if dtype == "bfloat16"), reports


def test_the_latent_value_split_keeps_sixteen_columns_a_share():
    import torch

    from segkv.kernels.attention.mla_attention import default_mla_launch_config, mla_stage1_launch

    # the automatic split (0: halves that follow the plan) and forced quarters (4: whatever the plan)
    for rank, forced, split, adaptive in ((16, 0, 1, False), (32, 0, 2, True), (512, 0, 2, True),
                                          (16, 4, 1, False), (32, 4, 2, False), (64, 4, 4, False)):
        launch = dataclasses.replace(default_mla_launch_config(), value_split=forced)
        meta = mla_stage1_launch(dtype=torch.bfloat16, rank=rank, rope=16, num_heads=4, page_size=16,
                                 max_work_rows=1, element_size=2, num_rows=1, launch=launch)
        assert (meta["VALUE_SPLIT"], meta["ADAPTIVE"]) == (split, adaptive), (rank, forced, meta)
        assert meta["BLOCK_R"] // meta["VALUE_SPLIT"] >= 16


def test_the_merge_lets_the_next_kernel_launch_after_its_wait():
    """The merge lets the next kernel launch right after its wait for stage 1, for GQA and latent
    widths."""
    orders = [r["pdl"] for r in compile_cases([{"kernel": "merge", "dv": dv} for dv in (128, 512)])]
    assert orders == [["wait", "launch_dependents"]] * 2


def test_timeline_stamps_compile_away_unless_asked():
    """``STAMPS`` (``kernels.attention.timeline``, scripts/stage1_timeline.py): stage 1 and the merge read the
    global timer and the SM's clock at a program's start, after its PDL wait and at its end only
    when given a stamp buffer; the launches' default (None) reads no timer at all."""
    stage1 = {"kernel": "gqa", "dtype": "bfloat16", "head_dim": 128, "page_size": 32, "rows": 1, "pdl": True}
    merge = {"kernel": "merge", "dv": 128}
    reports = compile_cases([stage1, {**stage1, "stamps": True}, merge, {**merge, "stamps": True}])
    plain, stamped = {"globaltimer": 0, "clock64": 0}, {"globaltimer": 3, "clock64": 3}
    assert [r["timers"] for r in reports] == [plain, stamped, plain, stamped]
    assert reports[2]["pdl"] == reports[3]["pdl"] == ["wait", "launch_dependents"]


def test_latent_score_pieces_are_separate_mma_chains():
    """The scores' pieces (its share of the 512 latent columns, the 64 RoPE columns, the other
    shares) are summed apart, so Triton does not fold them into one chain of 36 MMA steps: the
    halves' longest chain is 16 and the quarters' 8; the program that takes all the values keeps
    its 32 (one product over its 512 columns); the P.V chains stay at 4 (two bf16 halves of P, 32
    rows)."""
    base = {"kernel": "latent", "dtype": "bfloat16", "page_size": 32, "rows": 1, "one_query": True}
    reports = compile_cases([base, {**base, "value_split": 4}])
    apart, apart_quarters = [r["chains"] for r in reports]
    # the row max and sum of the halves' and the whole values' programs, across the warps
    assert reports[0]["loop_reductions"] == 4
    assert max(apart) == 32 and apart.count(16) == 2 and 36 not in apart
    assert max(apart_quarters) == 8
    assert apart_quarters.count(4) >= 2  # the RoPE columns' chain and the P.V chain


def test_default_decode_program_structure():
    """A batch-1 decode program of the 8B shape (4 heads of 128 per KV head, 64-row tiles), as the
    launcher compiles it: one chain of 8 MMA steps for the scores (128 columns) and one of 8 for
    P.V (its two half-precision parts over 64 rows); the key columns split over the 4 warps
    (``[1, 4]``), so the row max and the row sum are the loop's 2 reductions across the warps and
    P reaches the P.V product through shared memory; no spills. (Keeping the row sums out of the
    loop, the products as separate chains, or each warp with its own rows of a tile compiled
    as intended but measured slower end to end on the H200: docs/benchmarks.md.)"""
    case = {"kernel": "gqa", "dtype": "bfloat16", "head_dim": 128, "page_size": 32, "rows": 1, "group": 4,
            "pdl": True, "assemble": True}
    (report,) = compile_cases([case])
    assert report["chains"] == [8, 8]
    assert report["loop_reductions"] == 2
    assert report["mma_warps"] == [[1, 4]] and report["loop_shared_stores"] >= 1
    assert report["spill_bytes"] == 0 and report["waits"][0] >= 1


def test_decode_programs_take_exp2_without_subnormals_and_32_bit_page_offsets():
    """The online softmax's exponentials are ``ex2.approx.ftz`` (the plain one makes ptxas add a
    subnormal fix-up to every element), and a cache of under 2^31 elements gets int32 page offsets:
    fewer 64-bit multiplies than the int64 variant, which larger caches take. (Row-major decode
    programs at pages of 16; at 32 and more they keep int64 offsets, measured faster.)"""
    base = {"dtype": "bfloat16", "rows": 1}
    cases = [{**base, "kernel": "gqa", "head_dim": 128, "page_size": 16, "wide": wide} for wide in (False, True)]
    cases += [{**base, "kernel": "latent", "page_size": 32, "one_query": True, "wide": wide} for wide in (False, True)]
    narrow, wide, latent_narrow, latent_wide = compile_cases(cases)
    for report in (narrow, wide, latent_narrow, latent_wide):
        assert report["ex2"] == ["ex2.approx.ftz.f32"]
    assert narrow["mul64"] < wide["mul64"]
    assert latent_narrow["mul64"] < latent_wide["mul64"]


@pytest.mark.parametrize("case", [
    {"kernel": "gqa", "dtype": "bfloat16", "head_dim": 128, "page_size": 16, "rows": 16, "assemble": True, "sass": True},
    {"kernel": "gqa", "dtype": "bfloat16", "head_dim": 128, "page_size": 32, "rows": 1, "assemble": True, "sass": True},
    {"kernel": "gqa", "dtype": "bfloat16", "head_dim": 128, "page_size": 16, "rows": 1, "assemble": True, "sass": True},
], ids=["tall-two-pages", "decode-two-pages", "decode-four-pages"])
def test_full_tiles_branch_past_the_score_mask(case):
    """A full, wholly visible tile (its page entries loaded as scalars: two pages, or four of 16
    rows in a 64-row decode tile) branches past the score mask (the key positions, a compare and a
    select per score): the tile loop has a skippable stretch; no spills."""
    (report,) = compile_cases([case])
    loop = report["sass"]["loops"][0]
    assert loop["mma"] > 0 and loop["skippable"] >= 20
    assert report["spill_bytes"] == 0


def test_prefill_and_many_head_latent_programs_take_warp_group_mmas():
    """The prefill programs (256 pairs, 8 warps; both modes) and the fast many-head latent programs
    (64 pairs, 8 warps) compile to Hopper's warp-group MMAs and fit a program's shared memory; the
    prefill programs spill at most a few hundred bytes (the 256-pair launch spills 0.2-0.5 KB and
    still ran 1.2x the spill-free 128-pair one; 16 warps or 512 pairs spill more and ran slower)."""
    cases = [{"kernel": "gqa", "dtype": "bfloat16", "head_dim": 128, "page_size": 32, "rows": 64, "fast": fast,
              "assemble": True} for fast in (False, True)]
    cases.append({"kernel": "latent", "dtype": "bfloat16", "page_size": 32, "rows": 1, "heads": 128, "fast": True})
    results = compile_cases(cases)
    for r in results[:2]:
        assert r["num_warps"] == 8 and r["mma"] == "wgmma" and r["spill_bytes"] <= 1024, r
        assert 0 < r["shared"] <= MAX_SHARED_PER_PROGRAM, r
    latent = results[2]
    assert latent["num_warps"] == 8 and latent["mma"] == "wgmma", latent
    assert 0 < latent["shared"] <= MAX_SHARED_PER_PROGRAM, latent
