"""The AttentionBackend protocol: both backends satisfy it, and the lifecycle examples in the
docstrings run (on the CPU in Triton's interpreter) and match the other backend on fresh inputs."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from attention_helpers import ulp
from gpu_helpers import DEVICE
from segkv.attention import (
    AttentionBackend,
    AttentionShape,
    BackendCapabilities,
    DeviceSpec,
    PreparedAttention,
    SequenceQuery,
    TorchReferenceBackend,
    plan_attention,
)
from segkv.attention.triton_backend import TritonBackend
from segkv.cache import PagedKVCache
from segkv.config import CacheConfig, KVLayout


def lifecycle_example(cls: type) -> str:
    """The code block after the ``Lifecycle ...::`` line of ``cls``'s docstring."""
    lines = inspect.getdoc(cls).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Lifecycle") and line.endswith("::"))
    block = []
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip() + "\n"


def run_example(cls: type) -> dict:
    namespace: dict = {}
    exec(compile(lifecycle_example(cls), f"<{cls.__name__} lifecycle example>", "exec"), namespace)
    return namespace


def assert_within_contract(out: torch.Tensor, lse: torch.Tensor | None, ref: torch.Tensor,
                           ref_lse: torch.Tensor) -> None:
    """Both are float32 attention rounded once: float32 results agree to summation-order noise,
    half-precision ones within one unit in the last place; LSEs agree, ``-inf`` where the other is."""
    assert not torch.isnan(out).any()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = out.cpu(), ref.cpu()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)
    else:
        diff = (out.double() - ref.double()).abs()
        assert (diff <= ulp(ref) + 1e-5).all(), f"max diff {diff.max().item()}"
    if lse is not None:
        lse, ref_lse = lse.cpu(), ref_lse.cpu()
        assert lse.dtype == ref_lse.dtype == torch.float32 and not torch.isnan(lse).any()
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=0, atol=1e-4)


def rerun_layers(ns: dict, backend: AttentionBackend) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer of the example's step run again by ``backend`` on the same plan, query and cache
    (copied to the backend's device)."""
    prepared = backend.prepare(ns["plan"])
    storage, device = ns["cache"].storage, backend.device
    return [backend.run(prepared, ns["query"][layer].to(device), storage.key_cache(layer).to(device),
                        storage.value_cache(layer).to(device), scale=ns["dim"] ** -0.5)
            for layer in range(ns["num_layers"])]


def test_triton_lifecycle_example_matches_the_reference(gen):
    ns = run_example(TritonBackend)  # fresh inputs: ``gen`` seeded torch's generator for this test
    assert isinstance(ns["backend"], AttentionBackend)
    assert ns["plan"].num_query_rows == 40 and len(ns["outputs"]) == ns["num_layers"] == 2
    reference = rerun_layers(ns, TorchReferenceBackend(page_size=ns["page_size"], device=ns["device"]))
    for layer, (out, (ref, ref_lse)) in enumerate(zip(ns["outputs"], reference)):
        assert out.shape == (40, 8, 64) and out.dtype == torch.bfloat16
        assert_within_contract(out, ns["lse"] if layer == ns["num_layers"] - 1 else None, ref, ref_lse)
    # each layer has its own query and rows: the shared prepared plan did not repeat one layer's result
    assert not torch.equal(ns["outputs"][0], ns["outputs"][1])


def test_protocol_lifecycle_example_matches_the_triton_backend(gen):
    ns = run_example(AttentionBackend)
    assert isinstance(ns["backend"], TorchReferenceBackend)
    assert ns["plan"].num_query_rows == 2
    reference = rerun_layers(ns, ns["backend"])
    triton = rerun_layers(ns, TritonBackend(page_size=ns["page_size"], device=DEVICE, poison=True))
    for out, (ref, ref_lse), (other, other_lse) in zip(ns["outputs"], reference, triton):
        assert out.shape == (2, 4, 32) and out.dtype == torch.float32
        assert torch.equal(out, ref)
        assert_within_contract(other, other_lse, ref, ref_lse)


@pytest.mark.parametrize("cls", [TorchReferenceBackend, TritonBackend])
def test_backends_satisfy_the_protocol(cls):
    backend = cls(page_size=16, device=DEVICE)
    assert isinstance(backend, AttentionBackend)
    assert isinstance(backend.capabilities, BackendCapabilities)
    assert backend.page_size == 16 and backend.device == torch.device(DEVICE)
    assert set(backend.capabilities.kv_layouts) == {"mha", "mla"}
    assert backend.capabilities.kv_transform
    assert backend.capabilities.precision_modes == ("exact", "fast")
    assert not isinstance(object(), AttentionBackend)


def test_capability_values():
    torch_caps, triton_caps = TorchReferenceBackend.capabilities, TritonBackend.capabilities
    assert torch_caps.devices == ("cpu", "cuda") and not torch_caps.cuda_graphs
    assert triton_caps.devices == ("cuda",) and triton_caps.cuda_graphs
    with pytest.raises(AttributeError):
        triton_caps.cuda_graphs = False  # frozen


def test_prepared_plans_carry_their_plan(gen):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16)
    cache = PagedKVCache(layout, CacheConfig(page_size=16, num_pages=4))
    chain = cache.new_chain()
    chain.append(int(torch.randint(1, 30, (1,), generator=gen)))
    shape = AttentionShape(2, 1, 16, 16)
    plan = plan_attention([SequenceQuery.from_chain(chain, 1)], shape, DeviceSpec.cpu(), page_size=16)
    for cls in (TorchReferenceBackend, TritonBackend):
        backend = cls(page_size=16, device=DEVICE)
        prepared = backend.prepare(plan)
        assert isinstance(prepared, PreparedAttention) and prepared.plan is plan


@pytest.mark.parametrize("bad", [{"devices": ()}, {"devices": ("tpu",)}, {"kv_layouts": ("paged",)},
                                 {"precision_modes": ("approximate",)}])
def test_capabilities_are_validated(bad):
    fields = {"devices": ("cpu",), "kv_layouts": ("mha",), "kv_transform": False, "cuda_graphs": False,
              "precision_modes": ("exact",)}
    with pytest.raises(ValueError, match="BackendCapabilities"):
        BackendCapabilities(**{**fields, **bad})
