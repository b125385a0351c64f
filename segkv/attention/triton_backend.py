"""The Triton backend: the same plans as the reference, run by the kernels in ``kernels/``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from segkv.attention.plan import AttentionPlan

LSE_API_TRITON = "triton-merge"


@dataclass(slots=True)
class TritonPreparedPlan:
    """A plan as int32 device tensors (see ``kernels.paged_attention.attention_partials``)."""

    plan: AttentionPlan
    page_table: torch.Tensor
    page_rows: torch.Tensor
    page_key_start: torch.Tensor
    piece_page_start: torch.Tensor
    work_piece: torch.Tensor
    work_partial_start: torch.Tensor
    partial_row: torch.Tensor
    partial_offset: torch.Tensor
    reduce_ptr: torch.Tensor
    reduce_partials: torch.Tensor
    max_work_rows: int


class TritonBackend:
    """Runs attention plans with Triton kernels (CUDA, or the interpreter on the CPU)."""

    name = "triton"
    lse_api = LSE_API_TRITON

    def __init__(self, *, page_size: int, device: str | torch.device = "cuda", poison: bool = False) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self.poison = poison  # tests: fill outputs with NaN before every launch

    def prepare(self, plan: AttentionPlan) -> TritonPreparedPlan:
        """Flatten the plan into int32 tensors on the device (once per forward step)."""
        pages, rows, key_starts, starts = [], [], [], [0]
        for piece in plan.pieces:
            pages.extend(piece.page_ids)
            rows.extend(piece.page_rows)
            position = 0
            for n in piece.page_rows:
                key_starts.append(position)
                position += n
            starts.append(len(pages))
        work_start, offsets = [0], []
        for item in plan.work:
            work_start.append(work_start[-1] + len(item.query_rows))
            offsets.extend(item.causal_offsets)
        reduce_ptr, reduce_partials = [0], []
        for partials in plan.reduce_map:
            reduce_partials.extend(partials)
            reduce_ptr.append(len(reduce_partials))

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        return TritonPreparedPlan(
            plan=plan, page_table=t(pages), page_rows=t(rows), page_key_start=t(key_starts),
            piece_page_start=t(starts),
            work_piece=t([item.piece for item in plan.work]), work_partial_start=t(work_start),
            partial_row=t(list(plan.partial_rows)), partial_offset=t(offsets),
            reduce_ptr=t(reduce_ptr), reduce_partials=t(reduce_partials),
            max_work_rows=max((len(item.query_rows) for item in plan.work), default=1),
        )

    def run(
        self,
        prepared: TritonPreparedPlan,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        scale: float,
        out_dtype: torch.dtype | None = None,
        kv_transform=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer; same arguments and results as the reference backend."""
        from segkv.kernels.paged_attention import attention_partials, merge_partials

        if kv_transform is not None:
            raise ValueError("the Triton backend attends cached rows directly (no kv_transform)")
        plan = prepared.plan
        if query.shape[0] != plan.num_query_rows:
            raise ValueError(f"query has {query.shape[0]} rows, the plan {plan.num_query_rows}")
        if query.shape[1] % key_cache.shape[2]:
            raise ValueError(f"{query.shape[1]} query heads for {key_cache.shape[2]} KV heads")
        p = prepared
        part_out, part_lse = attention_partials(
            query=query, key_cache=key_cache, value_cache=value_cache, page_table=p.page_table,
            page_rows=p.page_rows, page_key_start=p.page_key_start, piece_page_start=p.piece_page_start, work_piece=p.work_piece,
            work_partial_start=p.work_partial_start, partial_row=p.partial_row, partial_offset=p.partial_offset,
            num_partials=plan.num_partials, max_work_rows=p.max_work_rows, scale=scale, poison=self.poison,
        )
        return merge_partials(partial_out=part_out, partial_lse=part_lse, reduce_ptr=p.reduce_ptr,
                              reduce_partials=p.reduce_partials, num_rows=plan.num_query_rows,
                              out_dtype=out_dtype or query.dtype, poison=self.poison)
