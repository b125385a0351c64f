"""The new-user defaults: --device auto, --dtype auto, the KV pool sized by --gpu-memory-utilization,
--max-model-len against the pool, Hugging Face ids from the local cache, and the start-up summary."""

from __future__ import annotations

import json

import pytest
import torch

import segkv.settings as settings
from model_helpers import build_model_dir, build_moe_dir
from segkv.cli import build_parser
from segkv.config import GIB, check_capacity, default_prefill_chunk, kv_cache_budget, resolve_dtype
from segkv.engine import LLM, AsyncEngine
from segkv.engine.llm import parse_device
from segkv.models.default_models import hf_hub_cache, is_hub_name, resolve_model_dir
from segkv.models.eagle3_loading import load_eagle3_head
from segkv.models.loader import checkpoint_weight_bytes, load_model
from segkv.spec.config import SpeculativeConfig
from segkv.spec.draft_model import DEFAULT_DRAFT_CACHE_BYTES
from segkv.spec.drafter_memory import DRAFTER_MARGIN_BYTES, drafter_bytes
from segkv.spec.eagle3 import DEFAULT_HEAD_CACHE_BYTES, resolve_head_dir

MIB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("auto-model")
    build_model_dir(directory, "qwen3")
    return directory


def _set_checkpoint_dtype(directory, dtype: str) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = dtype
    path.write_text(json.dumps(config))


# -- device and dtype ------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's choice")
def test_auto_device_is_the_cpu_here_and_auto_dtype_float32(model_dir):
    assert parse_device("auto") == torch.device("cpu")
    llm = LLM(model_dir, num_pages=64, page_size=8)  # the defaults: device and dtype "auto"
    assert (llm.device.type, llm.dtype) == ("cpu", torch.float32)
    assert llm.summary()["device"] == "cpu" and llm.summary()["dtype"] == "float32"
    assert llm.runner.prefill_chunk == default_prefill_chunk("cpu") == 512  # the device's default chunk


def test_prefill_chunk_defaults_by_device_and_an_explicit_one_wins(model_dir):
    assert (default_prefill_chunk("cuda"), default_prefill_chunk("cpu")) == (2048, 512)
    assert LLM(model_dir, num_pages=64, page_size=8, prefill_chunk=96).runner.prefill_chunk == 96
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        LLM(model_dir, num_pages=64, page_size=8, prefill_chunk=0)


def test_auto_dtype_takes_the_checkpoints_on_cuda_and_float32_on_the_cpu():
    for name, dtype in [("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32),
                        ("torch.bfloat16", torch.bfloat16)]:
        assert resolve_dtype("auto", device_type="cuda", checkpoint_dtype=name) == dtype
        assert resolve_dtype("auto", device_type="cpu", checkpoint_dtype=name) == torch.float32
    assert resolve_dtype("auto", device_type="cuda", checkpoint_dtype=None) == torch.float32
    # an explicit dtype wins on either device
    assert resolve_dtype("float16", device_type="cpu", checkpoint_dtype="bfloat16") == torch.float16
    assert resolve_dtype("bfloat16", device_type="cuda", checkpoint_dtype="float32") == torch.bfloat16
    with pytest.raises(ValueError, match=r"torch_dtype 'float8_e4m3fn'.*--dtype"):
        resolve_dtype("auto", device_type="cuda", checkpoint_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", device_type="cpu")


# -- the KV budget ---------------------------------------------------------------------------

def test_kv_budget_from_an_h100s_numbers():
    total = 79_646 * MIB  # an H100 80GB as torch.cuda.mem_get_info reports it
    weights = 15 * GIB  # Llama-3.1-8B in bfloat16
    context = 600 * MIB  # CUDA context, cuBLAS workspace
    free = total - weights - context
    peak = 1200 * MIB  # the profiling forward's activations (doubled for graphs by the caller)
    budget = kv_cache_budget(total=total, free=free, weights=weights, peak=peak, utilization=0.9)
    expected = int(total * 0.9) - weights - context - peak - 256 * MIB
    assert budget == expected
    assert 52.9 * GIB < budget < 53 * GIB  # 71,681 - 15,360 - 600 - 1,200 - 256 MiB
    # a lower fraction leaves less, by exactly the difference
    lower = kv_cache_budget(total=total, free=free, weights=weights, peak=peak, utilization=0.5)
    assert budget - lower == int(total * 0.9) - int(total * 0.5)
    # memory other processes hold (total - free) comes off too
    shared = kv_cache_budget(total=total, free=free - 10 * GIB, weights=weights, peak=peak, utilization=0.9)
    assert budget - shared == 10 * GIB


def test_kv_budget_errors_name_the_numbers_and_flags():
    total, weights = 80 * GIB, 30 * GIB
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0\.3 allows 24\.00 GiB.*weights alone "
                                         r"take 30\.00 GiB"):
        kv_cache_budget(total=total, free=total - weights, weights=weights, peak=GIB, utilization=0.3)
    with pytest.raises(ValueError, match=r"no memory is left for the KV cache.*--max-num-batched-tokens"
                                         r".*--kv-cache-memory"):
        kv_cache_budget(total=total, free=total - weights, weights=weights, peak=6 * GIB, utilization=0.45)
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            kv_cache_budget(total=total, free=total, weights=0, peak=0, utilization=bad)


def test_max_model_len_above_the_pools_capacity_is_a_clear_error(model_dir):
    check_capacity(4096, capacity_tokens=4096, explicit=True)
    with pytest.raises(ValueError, match=r"--max-model-len is 5000 tokens, more than the KV cache holds: "
                                         r"4096 tokens.*--gpu-memory-utilization.*--kv-cache-memory"):
        check_capacity(5000, capacity_tokens=4096, explicit=True)
    # through the engine: 64 KiB holds few rows of the tiny model; the model's limit is 512
    llm = LLM(model_dir, page_size=8, kv_cache_bytes=64 << 10, max_model_len=16)
    capacity = llm.summary()["kv_cache_tokens"]
    assert 16 <= capacity < 512
    with pytest.raises(ValueError, match=rf"--max-model-len is 512 tokens.*holds: {capacity} tokens"):
        LLM(model_dir, page_size=8, kv_cache_bytes=64 << 10, max_model_len=512)
    with pytest.raises(ValueError, match=r"the model's maximum length \(--max-model-len unset\) is \d+ tokens"):
        LLM(model_dir, page_size=8, kv_cache_bytes=64 << 10)


def test_the_profiling_pass_runs_the_largest_step_and_sizes_the_pool(model_dir, monkeypatch):
    """The profiling forward runs (here on the CPU, the CUDA memory readings faked): sequences of
    prefill_chunk tokens up to the step's size, on a scratch pool; its peak counted twice with
    CUDA graphs; the engine's own pool untouched."""
    llm = LLM(model_dir, page_size=8, num_pages=64)
    total, free, peak = 80 * GIB, 60 * GIB, 300 * MIB
    readings = {"allocated": 5 * GIB}
    forwards = []
    real_forward = llm.runner.forward.__func__

    def forward(runner, inputs, **kwargs):
        forwards.append([len(i.token_ids) for i in inputs])
        return real_forward(runner, inputs, **kwargs)

    from segkv.runner.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "forward", forward)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: readings["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: readings["allocated"] + peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, total))
    budget = llm._profile_kv_budget(llm.cache.layout, page_size=8, tokens=40, prefill_chunk=16, route=None,
                                    mla_mode="auto", backend="auto", fused_ops=None, graphs=True)
    assert forwards == [[16, 16, 8]]
    assert budget == kv_cache_budget(total=total, free=free, weights=llm.weight_bytes, peak=2 * peak,
                                     utilization=0.9)
    assert llm.profile == {"tokens": 40, "peak_bytes": peak, "graphs_bytes": peak, "free_bytes": free,
                           "total_bytes": total, "drafter_bytes": 0}
    assert llm.cache.stats()["pages_in_use"] == 0


# -- a drafter's memory in the budget ---------------------------------------------------------

def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_a_checkpoints_weight_bytes_come_from_its_headers_as_the_loader_keeps_them(tmp_path):
    """The header estimate is the loaded model's parameter bytes, exactly: at the load dtype, the
    MoE router in float32 (qwen3_moe), a tied lm_head stored anyway counted once (qwen2)."""
    from safetensors.torch import load_file, save_file

    build_model_dir(tmp_path / "qwen3", "qwen3")
    build_model_dir(tmp_path / "qwen2", "qwen2")  # tie_word_embeddings: HF stores no lm_head
    weights = tmp_path / "qwen2" / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    build_moe_dir(tmp_path / "moe", "qwen3_moe")
    for name in ("qwen3", "qwen2", "moe"):
        directory = tmp_path / name
        sizes = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(directory, dtype=dtype)
            sizes[dtype] = checkpoint_weight_bytes(directory, dtype=dtype)
            assert sizes[dtype] == _param_bytes(model.parameters()), (name, dtype)
        if name == "moe":  # the float32 routers keep the bfloat16 total above half
            assert sizes[torch.float32] < 2 * sizes[torch.bfloat16]
        else:
            assert sizes[torch.float32] == 2 * sizes[torch.bfloat16]


def test_an_eagle3_heads_estimate_is_what_it_adds_to_the_target():
    """The built-in head over the built-in target: its own parameters (the embeddings are the
    target's) and its vocabulary map, in the target's dtype."""
    target_dir = resolve_model_dir("default")
    target = load_model(target_dir, dtype=torch.bfloat16)
    head_dir = resolve_head_dir("default", target_dir)
    head = load_eagle3_head(head_dir, target, dtype=torch.bfloat16)
    shared = {id(p) for p in target.parameters()}
    added = _param_bytes(p for p in head.parameters() if id(p) not in shared)
    added += _param_bytes([head.d2t, head.t2d])
    assert checkpoint_weight_bytes(head_dir, dtype=torch.bfloat16) == added
    config = SpeculativeConfig.parse({"method": "eagle3", "model": "default", "num_speculative_tokens": 2})
    assert drafter_bytes(config, dtype=torch.bfloat16, target_dir=target_dir) == (
        added + DEFAULT_HEAD_CACHE_BYTES + DRAFTER_MARGIN_BYTES)
    for off in (None, SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})):
        assert drafter_bytes(off, dtype=torch.bfloat16) == 0


def test_kv_budget_reserves_the_drafter_and_names_it_when_nothing_is_left():
    total, weights, peak = 80 * GIB, 16 * GIB, GIB
    free = total - weights - 512 * MIB
    plain = kv_cache_budget(total=total, free=free, weights=weights, peak=peak, utilization=0.9)
    drafter = 3 * GIB + 7
    assert plain - kv_cache_budget(total=total, free=free, weights=weights, peak=peak, utilization=0.9,
                                   reserved=drafter) == drafter
    assert kv_cache_budget(total=total, free=free, weights=weights, peak=peak, utilization=0.9,
                           reserved=plain - 1) == 1
    with pytest.raises(ValueError, match=rf"no memory is left for the KV cache.*speculative drafter.*needs "
                                         rf"{plain / GIB:.2f} GiB.*smaller drafter"):
        kv_cache_budget(total=total, free=free, weights=weights, peak=peak, utilization=0.9, reserved=plain)
    with pytest.raises(ValueError, match="no memory is left") as error:  # no drafter: none named
        kv_cache_budget(total=total, free=free, weights=weights, peak=plain + peak, utilization=0.9)
    assert "drafter" not in str(error.value)
    with pytest.raises(ValueError, match="reserved=-1"):
        kv_cache_budget(total=total, free=free, weights=weights, peak=peak, utilization=0.9, reserved=-1)


def test_the_profiled_budget_leaves_a_draft_models_memory_free(model_dir, monkeypatch):
    """With a draft model (here the target's own checkpoint), the pool is smaller by its loaded
    weight bytes, its cache pool and the margin, recorded in the profile; a reservation that
    leaves nothing is an error naming the drafter."""
    llm = LLM(model_dir, page_size=8, num_pages=64)
    total, free, peak = 80 * GIB, 60 * GIB, 300 * MIB
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 5 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 5 * GIB + peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, total))
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": str(model_dir),
                                     "num_speculative_tokens": 3})

    def budget(speculative):
        return llm._profile_kv_budget(llm.cache.layout, page_size=8, tokens=16, prefill_chunk=16, route=None,
                                      mla_mode="auto", backend="auto", fused_ops=None, graphs=False,
                                      speculative=speculative)

    plain = budget(None)
    reserved = llm.weight_bytes + DEFAULT_DRAFT_CACHE_BYTES + DRAFTER_MARGIN_BYTES
    assert plain - budget(draft) == reserved
    assert llm.profile["drafter_bytes"] == reserved
    free = total - int(total * 0.9) + peak + 256 * MIB + reserved - 1  # one byte short of room
    with pytest.raises(ValueError, match=r"no memory is left for the KV cache.*speculative drafter"):
        budget(draft)
    assert budget(None) > 0


# -- Hugging Face ids from the local cache ---------------------------------------------------

def _fake_cache(root, repo_id: str, source) -> object:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<hash>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def _point_cache(monkeypatch, **env) -> None:
    for name in ("HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(settings, "SETTINGS", settings.load_settings())


def test_hub_ids_resolve_in_the_local_cache(tmp_path, monkeypatch, model_dir):
    cache = tmp_path / "hub"
    snapshot = _fake_cache(cache, "acme/tiny-qwen", model_dir)
    _point_cache(monkeypatch, HF_HUB_CACHE=cache)
    assert hf_hub_cache() == cache
    assert is_hub_name("acme/tiny-qwen") and not is_hub_name("default") and not is_hub_name(str(model_dir))
    assert resolve_model_dir("acme/tiny-qwen") == snapshot
    llm = LLM("acme/tiny-qwen", page_size=8, num_pages=32)
    assert llm.model_dir == snapshot and llm.model.cfg.vocab_size > 0
    # HF_HOME/hub when HF_HUB_CACHE is unset
    _point_cache(monkeypatch, HF_HOME=tmp_path)
    assert hf_hub_cache() == cache and resolve_model_dir("acme/tiny-qwen") == snapshot
    # built-in names and directories are untouched
    assert resolve_model_dir(str(model_dir)) == model_dir
    assert resolve_model_dir("default").name == "qwen3-gqa"


def test_a_hub_id_absent_from_the_cache_is_a_clear_error(tmp_path, monkeypatch):
    cache = tmp_path / "empty-hub"
    cache.mkdir()
    _point_cache(monkeypatch, HF_HUB_CACHE=cache)
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_dir("acme/missing-model")
    message = str(info.value)
    assert "'acme/missing-model' is neither a directory nor in the local Hugging Face cache" in message
    assert str(cache) in message and "models--acme--missing-model" in message
    assert "HF_HUB_CACHE" in message and "HF_HOME" in message and "does not download" in message
    from segkv.cli import main

    assert main(["generate", "--model", "acme/missing-model", "--prompt", "x"]) == 2


# -- the summary and /health -----------------------------------------------------------------

def test_health_and_the_log_show_the_summary(model_dir, caplog):
    from fastapi.testclient import TestClient  # (the server's dependency: not imported by the GPU tests)

    from segkv.server.app import create_app

    with caplog.at_level("INFO", logger="segkv"):
        llm = LLM(model_dir, page_size=8, kv_cache_bytes=1 << 20, route="segments")
    assert any("KV cache" in r.getMessage() and "tokens" in r.getMessage() for r in caplog.records)
    engine = AsyncEngine(llm)
    try:
        body = TestClient(create_app(engine, model_name="m")).get("/health").json()
    finally:
        engine.shutdown()
    summary = body["engine"]
    assert summary == llm.summary()
    assert summary["device"] == str(llm.device) and summary["dtype"] == "float32"
    assert summary["weight_bytes"] == sum(p.numel() * p.element_size() for p in llm.model.parameters()) > 0
    row_bytes = llm.cache.layout.row_bytes
    assert summary["kv_cache_tokens"] == (1 << 20) // (8 * row_bytes) * 8
    assert summary["kv_cache_bytes"] == summary["kv_cache_tokens"] * row_bytes
    assert summary["kv_cache_source"] == "kv_cache_memory"
    assert summary["attention_routes"] == ["segments"]  # forced; else all four
    line = llm.describe_summary()
    assert f"{summary['kv_cache_tokens']:,} tokens" in line and "float32" in line


def test_the_cpu_default_pool_is_still_one_gib(model_dir):
    if torch.cuda.is_available():
        pytest.skip("the CPU default")
    llm = LLM(model_dir, page_size=16)
    assert llm.summary()["kv_cache_source"] == "cpu default"
    assert llm.cache.config.num_pages == (1 << 30) // (16 * llm.cache.layout.row_bytes)


# -- the command's flags ---------------------------------------------------------------------

def test_cli_defaults_and_checks(capsys):
    parser = build_parser()
    for command in (["serve"], ["generate", "--prompt", "x"], ["chat"]):
        args = parser.parse_args(command)
        assert (args.device, args.dtype, args.gpu_memory_utilization, args.kv_cache_memory) == \
            ("auto", "auto", 0.9, None)
        assert args.model == "default"
    args = parser.parse_args(["serve", "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "4",
                              "--dtype", "bfloat16", "--device", "cuda:1"])
    assert (args.gpu_memory_utilization, args.kv_cache_memory, args.dtype, args.device) == \
        (0.5, 4.0, "bfloat16", "cuda:1")
    for bad in (["--gpu-memory-utilization", "0"], ["--gpu-memory-utilization", "1.2"],
                ["--kv-cache-memory", "0"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])
    assert "(0, 1]" in capsys.readouterr().err


# -- on a GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
def test_on_cuda_auto_picks_the_gpu_the_checkpoint_dtype_and_a_pool_near_the_fraction(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    build_model_dir(tmp_path, "qwen3")
    _set_checkpoint_dtype(tmp_path, "bfloat16")
    llm = LLM(tmp_path)
    assert (llm.device.type, llm.dtype) == ("cuda", torch.bfloat16)
    summary = llm.summary()
    free, total = torch.cuda.mem_get_info(llm.device)
    share = (total - free) / total  # weights, context and the pool, after the pool is made
    print(f"profile {llm.profile}, pool {summary['kv_cache_bytes'] / GIB:.2f} GiB, share {share:.3f}")
    assert summary["kv_cache_source"] == "gpu_memory_utilization 0.9"
    assert 0.8 < share <= 0.9
    info = llm.warm_up(max_batch=64, max_num_batched_tokens=2048)
    free_after = torch.cuda.mem_get_info(llm.device)[0]
    print(f"warm-up added {info['bytes'] / MIB:.1f} MiB; reserved for graphs "
          f"{llm.profile['graphs_bytes'] / MIB:.1f} MiB; share after {(total - free_after) / total:.3f}")
    assert (total - free_after) / total <= 0.9
    out = llm.generate(["hello"], None)
    assert out[0].outputs[0].token_ids
