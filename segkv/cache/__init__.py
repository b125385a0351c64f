"""Segmented paged KV cache: pages, segments, chains, snapshots and their storage."""

from segkv.cache.chain import ChainSnapshot, KVChain
from segkv.cache.compaction import segments_to_merge
from segkv.cache.kv_cache import PagedKVCache
from segkv.cache.page_pool import OutOfPagesError, PagePool
from segkv.cache.prefix_index import PrefixIndex, PrefixMatch
from segkv.cache.segment import ChainSpan, SegRef, Segment
from segkv.cache.storage import PagedKVStorage

__all__ = [
    "ChainSnapshot",
    "ChainSpan",
    "KVChain",
    "OutOfPagesError",
    "PagePool",
    "PagedKVCache",
    "PagedKVStorage",
    "PrefixIndex",
    "PrefixMatch",
    "SegRef",
    "Segment",
    "segments_to_merge",
]
