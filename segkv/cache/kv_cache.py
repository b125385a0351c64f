"""PagedKVCache: a page pool, its storage and the compaction policy, handing out chains."""

from __future__ import annotations

from collections.abc import Callable

from segkv.cache.chain import KVChain, RowCopier
from segkv.cache.page_pool import PagePool
from segkv.cache.storage import PagedKVStorage
from segkv.cache.tiers import SegmentTiers
from segkv.config import CacheConfig, CompactionPolicy, KVLayout


class PagedKVCache:
    """The KV cache of one model: every chain it creates draws pages from one pool.

    >>> cache = PagedKVCache(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8),
    ...                      CacheConfig(page_size=16, num_pages=64))
    >>> chain = cache.new_chain()
    >>> slots = chain.append(5)          # reserve rows; each layer then writes its K/V
    """

    def __init__(
        self,
        layout: KVLayout,
        config: CacheConfig,
        *,
        device: str = "cpu",  # or a torch.device
        compaction: CompactionPolicy | None = None,
    ) -> None:
        self.layout = layout
        self.config = config
        self.compaction = compaction or CompactionPolicy()
        self.pool = PagePool(
            num_pages=config.num_pages,
            page_size=config.page_size,
            bytes_per_page=config.page_size * layout.row_bytes,
        )
        self.storage = PagedKVStorage(layout, self.pool, device=device)
        # what chains copy rows with (compaction, tree windows): the storage's copy, or one that
        # also has a tensor-parallel model's other ranks copy theirs (engine/tensor_parallel.py)
        self.copy_rows: RowCopier = self.storage.copy_rows
        # what snapshot files hold and how their rows are read and written: this storage's, or
        # (a tensor-parallel rank 0) every rank's KV heads gathered into the model's whole layout
        self.file_layout: KVLayout = layout
        self.read_rows: Callable[..., tuple] = self.storage.read
        self.write_rows: Callable[..., None] = self.storage.write
        # host and disk copies of sealed segments (cache.tiers.offload / bring_back), when attached
        self.tiers: SegmentTiers | None = None

    def attach_tiers(self, tiers: SegmentTiers) -> None:
        """Spill sealed segments to ``tiers``; a segment out of its pages whose last holder lets go
        takes its copy with it."""
        self.tiers = tiers
        self.pool.on_segment_dropped = tiers.discard

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def new_chain(self) -> KVChain:
        """An empty chain whose seals compact through this cache's storage."""
        return KVChain(self.pool, copy_rows=self.copy_rows, compaction=self.compaction)

    def stats(self) -> dict[str, int]:
        return self.pool.stats()
