"""Attention over pieces of the KV cache: plans, the planner, the exact merge, the backend."""

from segkv.attention.backend import AttentionBackend, BackendCapabilities, PreparedAttention
from segkv.attention.device import DeviceSpec
from segkv.attention.merge import LSE_API, merge_partials, merge_states
from segkv.attention.plan import (
    AttentionPlan,
    AttentionShape,
    Piece,
    Route,
    SequenceQuery,
    WorkItem,
    reduce_map_from_work,
)
from segkv.attention.planner import ROUTE_ENV, plan_attention
from segkv.attention.reference import TorchReferenceBackend, attend_piece, piece_slots

__all__ = [
    "AttentionBackend",
    "AttentionPlan",
    "AttentionShape",
    "BackendCapabilities",
    "DeviceSpec",
    "LSE_API",
    "Piece",
    "PreparedAttention",
    "ROUTE_ENV",
    "Route",
    "SequenceQuery",
    "TorchReferenceBackend",
    "WorkItem",
    "attend_piece",
    "merge_partials",
    "merge_states",
    "piece_slots",
    "plan_attention",
    "reduce_map_from_work",
]
