"""Tensor parallelism over gloo, ranks as processes on this machine: TP=2 and TP=4 give TP=1's
float32 logits (1e-5 relative) and greedy tokens for tiny Llama, Qwen3, Mistral and DeepSeek-V3
models (KV heads split, and replicated when fewer than the ranks; MLA heads split over a
replicated latent; experts split inside; an odd vocabulary padded), each rank holding its exact
share of the weights; the engine (generate, turns, forks) and the server (the openai client)
over ranks; a killed rank stops the server; what the ranks cannot share is refused."""

from __future__ import annotations

import pytest
import torch

from model_helpers import build_deepseek_dir, build_model_dir
from segkv.distributed import TensorParallel
from segkv.models.loader import load_model
from tp_helpers import greedy_run, run_ranks

STEPS = 6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


DEEPSEEK = {"first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2}


# (family, config, tensor-parallel sizes): 4 ranks where it shares differently (KV heads replicated);
# Mistral's window and Qwen3's q/k norms act within a rank's heads (Mistral: the engine test below)
@pytest.mark.parametrize("family,extra,sizes", [
    ("llama", {}, (2, 4)), ("qwen3", {}, (2,)), ("deepseek-v3", DEEPSEEK, (2,)),
    ("deepseek-v3", {**DEEPSEEK, "q_lora_rank": 24}, (4,))],
    ids=["llama", "qwen3", "deepseek-v3", "deepseek-v3-q-lora"])
def test_sharded_ranks_match_one_whole_model(family, extra, sizes, tmp_path, gen):
    """4 query heads, 2 KV heads (GQA) or a replicated latent (MLA: a dense layer, then 4 experts
    and a shared one), an odd vocabulary."""
    if family == "deepseek-v3":
        build_deepseek_dir(tmp_path / "model", **extra)
    else:
        build_model_dir(tmp_path / "model", family, **extra)
    whole = load_model(tmp_path / "model", dtype="float32")
    prompt = torch.randint(0, whole.cfg.vocab_size, (29,), generator=gen).tolist()
    want = greedy_run(whole, prompt, STEPS)
    for size in sizes:
        ranks = run_ranks(size, tmp_path / "model", prompt, STEPS, tmp_path)
        assert rel_err(ranks[0]["logits"], want["logits"]) < 1e-5
        assert ranks[0]["tokens"] == want["tokens"]
        assert [r["weight_bytes"] for r in ranks] == [share_bytes(whole, size)] * size
        assert share_bytes(whole, size) < want["weight_bytes"] / size * 1.3  # about 1/N


def share_bytes(whole, size: int) -> int:
    """A rank's parameter bytes: 1/N of q, o, gate, up and down; its KV heads' share of k and v
    (one of them each when there are fewer KV heads than ranks); ceil(V / N) vocabulary rows of
    the embeddings and the LM head (once if tied); norms whole."""
    cfg, total = whole.cfg, 0
    kv = getattr(cfg, "num_kv_heads", None)
    kv_share = 1 if kv is None else max(1, kv // size) / kv
    vocab_share = -(-cfg.vocab_size // size) / cfg.vocab_size
    whole_names = ("norm", "kv_a_proj_with_mqa", "q_a_proj", "mlp.gate.", "mtp.")  # MLA's latent, the router
    for name, p in {id(p): (n, p) for n, p in whole.named_parameters()}.values():
        share = (kv_share if ("k_proj" in name or "v_proj" in name)
                 else vocab_share if ("embed" in name or "lm_head" in name)
                 else 1 if any(w in name for w in whole_names) else 1 / size)
        total += round(p.numel() * share) * p.element_size()
    return total


def test_what_the_ranks_cannot_share_is_refused(tmp_path):
    build_model_dir(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) must be divisible by the tensor parallel size 3"):
        load_model(tmp_path / "llama", tensor_parallel=TensorParallel(rank=0, size=3))
    build_model_dir(tmp_path / "kv3", "llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads \\(3\\) must divide, or be divisible by"):
        load_model(tmp_path / "kv3", tensor_parallel=TensorParallel(rank=0, size=2))
    from model_helpers import build_moe_dir

    build_moe_dir(tmp_path / "moe", "mixtral")
    with pytest.raises(ValueError, match="tensor parallelism supports the grouped-query decoders"):
        load_model(tmp_path / "moe", tensor_parallel=TensorParallel(rank=0, size=2))
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        TensorParallel(rank=2, size=2)


def test_an_engine_over_ranks_gives_one_models_tokens(tmp_path, gen):
    """``LLM(tensor_parallel_size=N)``: rank 0 schedules and broadcasts every forward, the other
    ranks (processes) follow on their shards; generate (a batch, prefill in chunks), conversation
    turns and a fork give TP=1's greedy tokens; a conversation saved at TP=2 (every rank's KV
    heads gathered) loads at TP=2 and at TP=1 and continues as one never saved; ``close`` stops
    the ranks."""
    from engine_helpers import conversation_tokens
    from segkv.engine import LLM
    from segkv.sampling_params import SamplingParams
    from segkv.sessions.conversation import Conversation

    build_model_dir(tmp_path / "model", "mistral", sliding_window=12)  # rows behind the window freed too
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (37, 5, 20)]
    turns = ("a first turn", "and a follow-up", "a fork's own turn")
    kw = dict(device="cpu", dtype="float32", page_size=16, num_pages=64, prefill_chunk=16)
    want = conversation_tokens(LLM(tmp_path / "model", **kw), prompts, params, turns)
    for size in (2,):
        llm = LLM(tmp_path / "model", tensor_parallel_size=size, **kw)
        assert llm.model.cfg.num_heads == 4 // size and llm.cache.layout.num_kv_heads == max(1, 2 // size)
        try:
            assert conversation_tokens(llm, prompts, params, turns) == want
            # a saved conversation holds every KV head: it continues alike at TP=2 and TP=1
            conv = llm.conversation()
            conv.say(turns[0], params)
            conv.save(tmp_path / "conversation.safetensors")
            again = Conversation.load(llm, tmp_path / "conversation.safetensors")
            continued = again.say(turns[1], params).output.token_ids
        finally:
            llm.close()
        assert all(p.exitcode == 0 for p in llm.ranks.processes)
        llm.close()  # twice is fine
        whole = LLM(tmp_path / "model", **kw)
        loaded = Conversation.load(whole, tmp_path / "conversation.safetensors")
        assert loaded.say(turns[1], params).output.token_ids == continued
        fresh = whole.conversation()
        fresh.say(turns[0], params)
        assert fresh.say(turns[1], params).output.token_ids == continued


@pytest.mark.parametrize("ahead", [False, True])
def test_ranks_replay_graphs_that_capture_the_all_reduces(ahead, tmp_path, gen, monkeypatch):
    """``cuda_graphs`` under tensor parallelism (emulated on the CPU: the graph code path, the
    Triton kernels in the interpreter): the warm-up captures every rank's graphs at the same steps,
    decode steps replay them on every rank (token ids launched ahead reach the other ranks by a
    device broadcast), and the tokens are TP=1's eager ones."""
    import dataclasses

    import segkv.settings as settings
    from segkv.engine import LLM
    from segkv.sampling_params import SamplingParams

    monkeypatch.setattr(settings, "SETTINGS", dataclasses.replace(settings.SETTINGS, lookahead=int(ahead)))
    build_model_dir(tmp_path / "model", "llama")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (9, 4)]
    kw = dict(device="cpu", dtype="float32", page_size=16, num_pages=64, max_model_len=64)
    want = [o.outputs[0].token_ids for o in LLM(tmp_path / "model", **kw).generate(prompts, params)]
    llm = LLM(tmp_path / "model", tensor_parallel_size=2, cuda_graphs="emulate", backend="triton", **kw)
    try:
        llm.warm_up(max_batch=2, max_num_batched_tokens=16)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        replays = llm.runner.graphs.replays
    finally:
        llm.close()
    assert got == want and replays >= 4
    assert all(p.exitcode == 0 for p in llm.ranks.processes)


def test_tensor_parallel_settings_not_served_yet_are_refused(tmp_path):
    from segkv.engine import LLM

    build_model_dir(tmp_path / "model", "llama")
    for kw, what in (({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
                     ({"kv_cache_dtype": "fp8"}, "FP8 KV cache"), ({"tensor_parallel_size": 0}, "positive")):
        with pytest.raises(ValueError, match=what):
            LLM(tmp_path / "model", device="cpu", **{"tensor_parallel_size": 2, **kw})


def _follower_pids(pid: int) -> list[int]:
    """The server's tensor-parallel ranks: its children started by multiprocessing's spawn (not
    its resource tracker)."""
    from pathlib import Path

    out = []
    for child in _children(pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            out.append(child)
    return out


def test_a_server_over_two_ranks_serves_the_openai_client_and_stops_when_a_rank_dies(tmp_path):
    """``segkv serve --tensor-parallel-size 2``: the openai client's greedy completion is TP=1's;
    a rank killed with SIGKILL ends the server with a non-zero exit code within 30 s."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import openai

    from segkv.engine import LLM
    from segkv.sampling_params import SamplingParams
    from server_helpers import free_port, wait_healthy

    build_model_dir(tmp_path / "model", "llama")
    want = LLM(tmp_path / "model", device="cpu").generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=8))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "segkv.cli", "serve", "--model", str(tmp_path / "model"),
                               "--device", "cpu", "--port", str(port), "--tensor-parallel-size", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        got = client.completions.create(model="model", prompt="def f(x):", max_tokens=8,
                                        temperature=0)
        assert got.choices[0].text == want[0].outputs[0].text
        (rank,) = _follower_pids(server.pid)
        os.kill(rank, signal.SIGKILL)
        start = time.monotonic()
        code = server.wait(timeout=30)
        assert code != 0 and time.monotonic() - start < 30
        assert "tensor-parallel segkv-tp-rank-1" in server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_two_torchrun_invocations_serve_one_model(tmp_path):
    """Two hosts' worth of torchrun (``--nnodes 2``, one rank each, gloo) on this machine: rank 0
    serves TP=1's completion; SIGTERM to its server stops both ranks cleanly."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    from segkv.engine import LLM
    from segkv.sampling_params import SamplingParams
    from server_helpers import free_port, wait_healthy

    build_model_dir(tmp_path / "model", "llama")
    want = LLM(tmp_path / "model", device="cpu").generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=8))
    master, port = free_port(), free_port()
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master),
         "-m", "segkv.cli", "serve", "--model", str(tmp_path / "model"), "--device", "cpu", "--port", str(port),
         "--tensor-parallel-size", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)]
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(launchers[0], base)
        got = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "model", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}).json()
        assert got["choices"][0]["text"] == want[0].outputs[0].text
        (server,) = [c for c in _children(launchers[0].pid)
                     if b"segkv.cli" in Path(f"/proc/{c}/cmdline").read_bytes()]
        import os

        os.kill(server, signal.SIGTERM)
        start = time.monotonic()
        assert [p.wait(timeout=60) for p in launchers] == [0, 0]
        assert time.monotonic() - start < 60
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
                p.wait()


def _children(pid: int) -> list[int]:
    from pathlib import Path

    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_each_rank_takes_its_own_gpu(monkeypatch):
    """On CUDA rank r of a host runs on ``cuda:r`` (NCCL binds one GPU to each rank); a device
    with an index, or fewer GPUs than ranks, is refused by name; the CPU stays the CPU."""
    from segkv.distributed.parallel import rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [rank_device("cuda", r) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="needs GPU 2, and 2 are visible"):
        rank_device("cuda", 2)
    with pytest.raises(ValueError, match="not cuda:1"):
        rank_device("cuda:1", 0)


def test_torchrun_local_ranks_choose_the_gpus(monkeypatch):
    """Under torchrun a rank's GPU is its ``LOCAL_RANK`` (rank 3 of two 2-GPU hosts: GPU 1);
    spawned on one host, its rank."""
    import dataclasses

    import segkv.settings as settings
    from segkv.engine.tensor_parallel import local_rank

    assert local_rank(3) == 3
    launched = dataclasses.replace(settings.SETTINGS, launcher_rank=3, launcher_world_size=4, launcher_local_rank=1)
    monkeypatch.setattr(settings, "SETTINGS", launched)
    assert local_rank(3) == 1


@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])
def test_fused_shards_match_one_whole_model(family, tmp_path, gen):
    """With the fused ops (stacked q/k/v and gate/up, fused norms, RoPE and cache writes; on the
    CPU through Triton's interpreter) the row-parallel products still sum over the ranks: TP=2
    gives the unfused whole model's logits (1e-5) and greedy tokens."""
    if family == "deepseek-v3":
        build_deepseek_dir(tmp_path / "model", **DEEPSEEK)
    else:
        build_model_dir(tmp_path / "model", family)
    whole = load_model(tmp_path / "model", dtype="float32")
    prompt = torch.randint(0, whole.cfg.vocab_size, (21,), generator=gen).tolist()
    want = greedy_run(whole, prompt, 3)
    ranks = run_ranks(2, tmp_path / "model", prompt, 3, tmp_path, fused=True)
    assert rel_err(ranks[0]["logits"], want["logits"]) < 1e-5 and not ranks[0]["logits"].isnan().any()
    assert ranks[0]["tokens"] == want["tokens"]
