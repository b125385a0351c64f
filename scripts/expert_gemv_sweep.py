"""Launch sweep of the per-pair expert GEMV at DeepSeek-V2-Lite shapes (GPU machine).

For each (pairs, product) the expert weights are bf16 stacks of 64 experts (740 MB / 370 MB, far
beyond L2); 8 launches, each over fresh distinct experts, are captured in one CUDA graph, so the
timing is the kernels' alone (a decode step replays them from a graph too, not from Python).
Prints the median [min-max] over 10 replays of the time per launch in microseconds and the
weight bytes read per second, per launch configuration (outputs and inputs per step, warps, the
input loop unrolled or not), with the default configuration marked.
``--shared``: one token's launches with the shared experts as a decode step runs them (6 routed
pairs and DeepSeek-V2-Lite's two shared experts stacked, 8 distinct shared weight copies): the
gate/up launch writing ``silu(gate) * up`` and the plain down launch, each alone and as a pair,
against both in one launch (``kernels.expert_mlp``, the engine's), alternating.
``--block``: the norm-route launch and the experts' launch against the whole MoE block in one
launch (``kernels.expert_mlp.moe_block_one_token``, the engine's), alternating.
Usage: ``python3 scripts/expert_gemv_sweep.py [--shared | --block]``.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from functools import partial

import torch

from segkv.kernels.expert_gemv import (BLOCK_O, NUM_WARPS, default_block_i, default_unroll, expert_gemv,
                                       expert_gemv_with_shared)
from segkv.kernels.expert_mlp import counters_size, expert_mlp_one_token
from segkv.kernels.grouped_expert_gemm import grouped_expert_gemm

SHAPES = {"gate_up": (2816, 2048), "down": (2048, 1408)}  # (Out, In) per expert


def time_us(launches, reps: int = 10) -> list[float]:
    """Microseconds per launch: ``launches`` (callables) captured in one graph, replayed ``reps`` times."""
    for launch in launches:  # compile and warm up outside the capture
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(launches))
    return times


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}; bf16; 64 experts; median [min-max] of 10 graph replays, per launch")
    for name, (out_dim, in_dim) in SHAPES.items():
        weight = torch.randn(64, out_dim, in_dim, device=dev, dtype=torch.bfloat16, generator=gen)
        for pairs in (6, 48):
            x = torch.randn(pairs, in_dim, device=dev, dtype=torch.bfloat16, generator=gen)
            rows = torch.arange(pairs, device=dev)
            draws = [torch.randperm(64, device=dev, generator=gen)[:pairs] for _ in range(8)]
            nbytes = pairs * out_dim * in_dim * 2
            default = (BLOCK_O, default_block_i(pairs), NUM_WARPS, default_unroll(pairs))
            # 64 outputs and 2 warps were never the best in earlier sweeps (docs/benchmarks.md)
            for block_o, block_i, warps, unroll in itertools.product((8, 16, 32), (128, 256), (4,), (False, True)):
                launches = [partial(expert_gemv, x, rows, experts, weight, block_o=block_o, block_i=block_i,
                                    num_warps=warps, unroll=unroll) for experts in draws]
                _report(f"{name:8s} pairs {pairs:3d} block_o {block_o:3d} block_i {block_i:3d} warps {warps} "
                        f"unroll {int(unroll)}", time_us(launches), nbytes,
                        " <- default" if (block_o, block_i, warps, unroll) == default else "")
            _report(f"{name:8s} pairs {pairs:3d} grouped GEMM (its default launch)",
                    time_us([partial(grouped_expert_gemm, x, rows, experts, weight) for experts in draws]), nbytes, "")


def shared_launches() -> None:
    """One token's expert launches with the shared experts: the gate/up launch writing the
    activation and the down launch (:func:`expert_gemv_with_shared`, each timed alone), against
    both as one launch (:func:`expert_mlp_one_token`) and the pair of launches it replaces,
    alternating twice; microseconds per launch (or per pair) and the bytes of weight read per second."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden, inner, shared_inner, pairs = 2048, 1408, 2816, 6
    gate_up = torch.randn(64, 2 * inner, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    down = torch.randn(64, hidden, inner, device=dev, dtype=torch.bfloat16, generator=gen)
    s_gate_up = [torch.randn(2 * shared_inner, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
                 for _ in range(8)]
    s_down = [torch.randn(hidden, shared_inner, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(8)]
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    act = torch.randn(pairs, inner, device=dev, dtype=torch.bfloat16, generator=gen)
    s_act = torch.randn(1, shared_inner, device=dev, dtype=torch.bfloat16, generator=gen)
    draws = [torch.randperm(64, device=dev, generator=gen)[:pairs] for _ in range(8)]
    counters = torch.zeros(counters_size(pairs), dtype=torch.int32, device=dev)
    print(f"device {torch.cuda.get_device_name()}; one token, {pairs} routed pairs + 2 shared experts; "
          f"median [min-max] of 10 graph replays, per launch (per pair of launches where two)")
    up_bytes = (pairs * 2 * inner + 2 * shared_inner) * hidden * 2
    down_bytes = (pairs * inner + shared_inner) * hidden * 2

    def two_launches(e, wu, wd):
        a, sa = expert_gemv_with_shared(x, pairs, e, gate_up, x, wu, distinct_experts=True, activation=True)
        expert_gemv_with_shared(a, 1, e, down, sa, wd, distinct_experts=True)

    for _ in range(2):
        _report("gate/up with shared, activation written",
                time_us([partial(expert_gemv_with_shared, x, pairs, e, gate_up, x, w, distinct_experts=True,
                                 activation=True) for e, w in zip(draws, s_gate_up)]), up_bytes, "")
        _report("down with shared, plain",
                time_us([partial(expert_gemv_with_shared, act, 1, e, down, s_act, w, distinct_experts=True)
                         for e, w in zip(draws, s_down)]), down_bytes, "")
        _report("gate/up then down (two launches)",
                time_us([partial(two_launches, e, wu, wd) for e, wu, wd in zip(draws, s_gate_up, s_down)]),
                up_bytes + down_bytes, "")
        _report("gate/up and down in one launch",
                time_us([partial(expert_mlp_one_token, x, e, gate_up, down, wu, wd, counters)
                         for e, wu, wd in zip(draws, s_gate_up, s_down)]), up_bytes + down_bytes, "")


def block_launches() -> None:
    """One token's whole MoE block as a decode step runs it (DeepSeek-V2-Lite shapes: 64 experts,
    top-6, 2 shared experts; 8 distinct weight copies of the shared and router weights): the
    norm-route launch then the experts' one launch, against the block in one launch
    (:func:`moe_block_one_token`), alternating four times; microseconds per block."""
    from segkv.kernels.expert_mlp import moe_block_one_token
    from segkv.kernels.moe_ops import norm_route_topk

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden, inner, shared_inner, top_k = 2048, 1408, 2816, 6

    def weight(*shape):
        return (torch.randn(*shape, device=dev, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16)

    gate_up, down = weight(64, 2 * inner, hidden), weight(64, hidden, inner)
    copies = [(weight(2 * shared_inner, hidden), weight(hidden, shared_inner), weight(64, hidden)) for _ in range(8)]
    x, res = weight(1, hidden), weight(1, hidden)
    norm_w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    counters = torch.zeros(counters_size(top_k), dtype=torch.int32, device=dev)
    tickets = torch.zeros(1, dtype=torch.int32, device=dev)
    nbytes = (top_k * 3 * inner + 3 * shared_inner) * hidden * 2 + 64 * hidden * 2

    def two_launches(su, sd, router):
        h, _, _, ids = norm_route_topk(x, res, norm_w, 1e-6, router, top_k, tickets)
        expert_mlp_one_token(h, ids[0], gate_up, down, su, sd, counters)

    def one_launch(su, sd, router):
        moe_block_one_token(x, res, norm_w, 1e-6, router, top_k, tickets, gate_up, down, su, sd, counters)

    print(f"device {torch.cuda.get_device_name()}; one token's MoE block; median [min-max] of 10 graph replays, "
          f"per block")
    for _ in range(4):
        _report("norm-route launch, then the experts' launch",
                time_us([partial(two_launches, *c) for c in copies]), nbytes, "")
        _report("the block in one launch", time_us([partial(one_launch, *c) for c in copies]), nbytes, " (default)")


def _report(label: str, times: list[float], nbytes: int, mark: str) -> None:
    med = statistics.median(times)
    print(f"{label}: {med:7.1f} us [{min(times):.1f}-{max(times):.1f}] {nbytes / med / 1e3:7.0f} GB/s{mark}", flush=True)


if __name__ == "__main__":
    if "--block" in sys.argv[1:]:
        block_launches()
    elif "--shared" in sys.argv[1:]:
        shared_launches()
    else:
        main()
