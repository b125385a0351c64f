"""The attention backend protocol: plan once per step, run once per layer, state what it can do."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from segkv.attention.plan import AttentionPlan

KVTransform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# an FP8 cache's (k_scale, v_scale) of one layer: (Hkv,) float32 each (PagedKVStorage.kv_scales)
KVScales = tuple[torch.Tensor, torch.Tensor]
DEVICE_TYPES = ("cpu", "cuda")
KV_LAYOUTS = ("mha", "mla")  # KVLayout.kind: per-head K/V (MHA/GQA/MQA), or MLA's latent rows
PRECISION_MODES = ("exact", "fast")  # inside a piece (ARCHITECTURE.md's numerical contract)


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """What a backend can run, so callers branch on facts rather than on its class or name.

    ``devices``: torch device types it runs on. ``kv_layouts``: the ``KVLayout.kind`` caches it
    attends: ``"mha"`` (``key_cache``/``value_cache`` ``(pages, page_size, Hkv, D)``) and
    ``"mla"`` (one latent head; ``value_cache`` is a view of the latent rows' first
    ``kv_lora_rank`` columns). ``kv_transform``: ``run`` accepts a per-piece K/V transform
    (MLA's naive path decompresses latent rows). ``cuda_graphs``: it can prepare plans into
    fixed-capacity buffers, so a CUDA graph captured over ``run`` replays for later plans.
    ``precision_modes``: the contract's modes inside a piece that it implements. ``key_masks``: it
    runs plans whose work items carry key masks (``WorkItem.key_masks``: tree verify windows), in
    fixed-capacity buffers too where it has them. ``sinks``: ``run`` takes per-head attention
    sinks (``sinks=``, :func:`check_sinks`) for per-head K/V caches (``"mha"``); a backend
    without it refuses them.
    """

    devices: tuple[str, ...]
    kv_layouts: tuple[str, ...]
    kv_transform: bool
    cuda_graphs: bool
    precision_modes: tuple[str, ...]
    key_masks: bool = False
    sinks: bool = False

    def __post_init__(self) -> None:
        for field, allowed in (("devices", DEVICE_TYPES), ("kv_layouts", KV_LAYOUTS),
                               ("precision_modes", PRECISION_MODES)):
            values = getattr(self, field)
            if not values or not set(values) <= set(allowed):
                raise ValueError(f"BackendCapabilities.{field} must be a non-empty subset of {allowed}, "
                                 f"got {values!r}")


@runtime_checkable
class PreparedAttention(Protocol):
    """A plan prepared by a backend (its own index tensors); opaque except for the plan itself."""

    plan: AttentionPlan


@runtime_checkable
class AttentionBackend(Protocol):
    """Runs attention plans over the paged KV cache (``TorchReferenceBackend``, ``TritonBackend``).

    Lifecycle of one forward step: the planner turns the step's sequences into an
    :class:`~segkv.attention.plan.AttentionPlan`; ``prepare(plan)`` turns it into the backend's
    index tensors once per step (host work, one transfer); every layer then writes its new K/V
    rows and calls ``run(prepared, ...)`` with its own query and cache tensors. ``run`` follows
    the numerical contract: float32 scores, softmax and partials, the exact LSE merge, one
    rounding to the output dtype; a row that sees no key is 0 with LSE ``-inf``.

    ``run`` arguments (``R`` query rows in plan row order, ``Hq`` query heads, ``Hkv`` KV heads
    dividing ``Hq``):

    - ``query``: ``(R, Hq, Dk)``, float32, bfloat16 or float16;
    - ``key_cache``: ``(num_pages, page_size, Hkv, Dk)``; for an ``"mla"`` cache the latent rows
      ``(num_pages, page_size, 1, kv_lora_rank + rope_dim)``;
    - ``value_cache``: ``(num_pages, page_size, Hkv, Dv)``; for ``"mla"`` the view of the latent
      rows' first ``kv_lora_rank`` columns;
    - ``scale``: the softmax scale (explicit: MLA's is not ``Dk ** -0.5``); ``out_dtype``: the
      result's dtype (default ``query.dtype``); ``kv_transform``: maps each piece's gathered
      ``(key, value)`` rows to the per-head K/V attended (needs ``capabilities.kv_transform``);
      ``kv_scales``: for a ``float8_e4m3fn`` cache, ``(k_scale, v_scale)`` ``(Hkv,)`` float32 (one
      for an ``"mla"`` cache): the attention runs over ``fp8 * scale`` in float32; ``sinks``: per
      query head sink logits ``(Hq,)`` float32 on the query's device (gpt-oss; needs
      ``capabilities.sinks``, :func:`check_sinks`): one more term ``exp(sinks[h])`` with a zero
      value in each row's softmax denominator, folded in float32 before the single rounding; a row
      that sees no key is then 0 with LSE ``sinks[h]``.

    It returns ``(out, lse)``: ``(R, Hq, Dv)`` in ``out_dtype`` and ``(R, Hq)`` float32 (natural
    log). Backends need not support every layout or device: see ``capabilities``.

    Lifecycle (runnable; any backend runs it the same way, here the reference on the CPU)::

        import torch
        from segkv.attention import AttentionShape, DeviceSpec, SequenceQuery, plan_attention
        from segkv.attention import AttentionBackend, TorchReferenceBackend
        from segkv.cache import PagedKVCache
        from segkv.config import CacheConfig, KVLayout

        num_layers, page_size, q_heads, kv_heads, dim, dtype = 2, 16, 4, 1, 32, torch.float32
        layout = KVLayout(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype)
        cache = PagedKVCache(layout, CacheConfig(page_size=page_size, num_pages=32))
        backend: AttentionBackend = TorchReferenceBackend(page_size=page_size, device="cpu")
        assert layout.kind in backend.capabilities.kv_layouts

        # a 21-row history, forked; each sequence then decodes one row
        history = cache.new_chain()
        slots = history.append(21)
        for layer in range(num_layers):
            cache.storage.write(layer, slots, *torch.randn(2, 21, kv_heads, dim, dtype=dtype))
        history.seal()
        chains = [history, history.fork()]
        slots = [slot for chain in chains for slot in chain.append(1)]

        # once per step: plan, then prepare
        queries = [SequenceQuery.from_chain(chain, 1) for chain in chains]
        plan = plan_attention(queries, AttentionShape(q_heads, kv_heads, dim, dim), DeviceSpec.cpu(),
                              page_size=page_size)
        prepared = backend.prepare(plan)

        # per layer: write the layer's new rows, then attend them with the same prepared plan
        query = torch.randn(num_layers, plan.num_query_rows, q_heads, dim, dtype=dtype)
        outputs = []
        for layer in range(num_layers):
            cache.storage.write(layer, slots, *torch.randn(2, len(slots), kv_heads, dim, dtype=dtype))
            out, lse = backend.run(prepared, query[layer], cache.storage.key_cache(layer),
                                   cache.storage.value_cache(layer), scale=dim ** -0.5)
            outputs.append(out)  # (2, q_heads, dim) float32; lse (2, q_heads) float32
    """

    name: str  # shown in messages
    lse_api: str  # reported by /health
    page_size: int
    device: torch.device
    capabilities: BackendCapabilities

    def prepare(self, plan: AttentionPlan) -> PreparedAttention:
        """The plan as this backend's index tensors on its device: once per forward step, shared
        by every layer of it."""
        ...

    def run(
        self,
        prepared: PreparedAttention,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        scale: float,
        out_dtype: torch.dtype | None = None,
        kv_transform: KVTransform | None = None,
        kv_scales: KVScales | None = None,
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer (shapes and dtypes in the class docstring): ``(out, lse)``."""
        ...


def check_sinks(backend_name: str, capabilities: BackendCapabilities, sinks: torch.Tensor | None,
                query: torch.Tensor) -> None:
    """Validate ``run``'s ``sinks`` argument: None, or ``(Hq,)`` float32 on ``query``'s device,
    for a backend whose ``capabilities.sinks`` is set. Raises ValueError otherwise.

    Attention sinks (gpt-oss): ``sinks[h]`` is a learned logit in natural-log units, comparable to
    the scaled scores, that joins every row's softmax denominator of head ``h`` with a zero value:
    ``out = sum_k exp(s_k) v_k / (sum_k exp(s_k) + exp(sinks[h]))``,
    ``lse = log(sum_k exp(s_k) + exp(sinks[h]))``."""
    if sinks is None:
        return
    if not capabilities.sinks:
        raise ValueError(f"the {backend_name} backend does not take attention sinks (capabilities.sinks is False)")
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32:
        raise ValueError(f"sinks must be a float32 tensor, got {getattr(sinks, 'dtype', type(sinks))}")
    if sinks.shape != (query.shape[1],):
        raise ValueError(f"sinks must have shape ({query.shape[1]},) (one per query head), got {tuple(sinks.shape)}")
    if sinks.device != query.device:
        raise ValueError(f"sinks are on {sinks.device}, the query on {query.device}")
