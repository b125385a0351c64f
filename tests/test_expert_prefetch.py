"""The expert items' L2 prefetch while they wait for their input (``SEGKV_EXPERT_PREFETCH_WAITING``):
where it is launched, that it compiles into the waiting items, and (on the GPU) that it changes no
result."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from segkv.kernels import expert_mlp

GPU = torch.cuda.is_available()

_COMPILE = """
import json
import torch
from segkv.kernels import expert_mlp
from segkv.kernels.moe_ops import prepare_norm_route
from segkv.kernels.offline_compile import compile_offline
bf = torch.bfloat16
x = torch.empty(1, 256, dtype=bf)
route = prepare_norm_route(x, torch.empty_like(x), torch.empty(256, dtype=bf), torch.empty(16, 256, dtype=bf), 4,
                           torch.zeros(1, dtype=torch.int32), scoring="softmax", norm_topk_prob=False, name="t")
launch = expert_mlp._prepare_experts("t", x, 4, torch.empty(16, 128, 256, dtype=bf), torch.empty(16, 256, 64, dtype=bf),
                                     torch.empty(192, 256, dtype=bf), torch.empty(256, 96, dtype=bf),
                                     torch.zeros(expert_mlp.counters_size(4), dtype=torch.int32), False)
b = "*bf16"
ptr = dict(XO=b, RES=b, NORM_W=b, RES_OUT=b, X=b, ROUTER_W=b, LOGITS="*fp32", WEIGHTS="*fp32", experts="*i64",
           TICKETS="*i32", eps="fp32", scale="fp32", GU=b, DOWN=b, ACT=b, OUT=b, SGU=b, SDOWN=b, SACT=b, SOUT=b,
           COUNTERS="*i32")
for prefetch in (False, True):
    meta = {**route.meta, "ROUTER_BLOCKS": route.blocks, **launch.meta, "EXACT_FP32": False, "USE_PDL": True,
            "PREFETCH": prefetch}
    k = compile_offline(expert_mlp._moe_block_kernel, meta, pointers=ptr, assemble=True)
    print(json.dumps({"registers": k.registers, "spills": k.spill_bytes,
                      "prefetches": k.ptx.count("cp.async.bulk.prefetch.L2")}))
"""


def test_prefetch_is_launched_only_where_bulk_prefetches_run(monkeypatch):
    """Off by default; asked for, only on a Hopper or later GPU outside the interpreter, for
    16-byte aligned rows of 16-bit weights."""
    device = "cuda" if GPU else "cpu"
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device=device)
    weights = (torch.zeros(4, 32, 64, dtype=torch.bfloat16, device=device),)
    assert not expert_mlp.PREFETCH_WAITING and not expert_mlp.prefetch_waiting(x, weights)
    monkeypatch.setattr(expert_mlp, "PREFETCH_WAITING", True)
    runs = GPU and torch.cuda.get_device_capability()[0] >= 9 and os.environ.get("TRITON_INTERPRET") != "1"
    assert expert_mlp.prefetch_waiting(x, weights) == runs
    assert not expert_mlp.prefetch_waiting(x, (weights[0].float(),))
    assert not expert_mlp.prefetch_waiting(x, (weights[0][..., :60],))  # rows of 120 bytes


def test_prefetch_compiles_into_the_waiting_items():
    """The whole MoE block compiled for sm_90 (no GPU needed; outside the interpreter, in a
    subprocess): three items wait for their input (shared gate/up, shared and routed down) and each
    then asks for its rows, with no more registers and no spills; without it, no prefetch."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    off, on = (json.loads(line) for line in run.stdout.splitlines())
    assert off["prefetches"] == 0 and on["prefetches"] == 3
    assert off["spills"] == on["spills"] == 0 and on["registers"] <= off["registers"] + 2


@pytest.mark.skipif(not GPU, reason="bulk prefetches need the GPU")
def test_prefetch_changes_no_result(gen, monkeypatch):
    """DeepSeek-V2-Lite's MoE block shapes, one token, twice on the same counters: bit-equal with
    and without the prefetch."""
    from segkv.kernels.expert_mlp import moe_block_one_token

    def w(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16).cuda()

    gate_up, down, s_gate_up, s_down = w(64, 2816, 2048), w(64, 2048, 1408), w(5632, 2048), w(2048, 2816)
    router, norm_w = w(64, 2048), (1 + 0.1 * torch.randn(2048, generator=gen)).to(torch.bfloat16).cuda()
    counters = torch.zeros(expert_mlp.counters_size(6), dtype=torch.int32, device="cuda")
    tickets = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(2):
        x, res = w(1, 2048), w(1, 2048)
        results = []
        for prefetch in (False, True):
            monkeypatch.setattr(expert_mlp, "PREFETCH_WAITING", prefetch)
            results.append(moe_block_one_token(x, res, norm_w, 1e-6, router, 6, tickets, gate_up, down, s_gate_up,
                                               s_down, counters, poison=True))
            assert not counters.any() and not tickets.any()
        assert expert_mlp.prefetch_waiting(x, (gate_up,))
        for a, b in zip(*results):
            assert not torch.isnan(a.float()).any() and torch.equal(a, b)
