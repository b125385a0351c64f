"""Multi-token prediction on the paged cache: the MTP layers' rows and their forwards.

A DeepSeek-V3-style MTP layer at position ``t`` reads the main model's hidden state ``h_t`` and
the embedding of token ``t + 1``, runs one decoder layer (attending its own K/V rows of the
positions before) and predicts token ``t + 2``. Its K/V rows live in the chain's slots, in the
cache layers after the main model's (``DeepseekForCausalLM.kv_layout(..., mtp=True)``).

Row ``t``'s MTP input needs token ``t + 1``, known one step after the main model wrote row
``t``, so the MTP rows lag the main rows: :class:`MtpRunner` keeps, per chain, the main hidden
states of the rows whose MTP row is not written yet (the runner's ``hidden_listener``), and
:meth:`MtpRunner.catch_up` writes them once their next tokens are known. The last of those rows
is the chain's last row, whose next token is the sequence's pending one: its MTP output predicts
the token after the pending one, the first draft. Further drafts run the last MTP layer again on
rows appended for the purpose and trimmed afterwards (``draft``).

Rows of a chain shared with a fork or the prefix index carry the MTP values of the branch that
wrote them last; an MTP row only shapes drafts, which verification checks exactly, so that costs
acceptance at fork points, never correctness.
"""

from __future__ import annotations

import weakref

import torch

from segkv.attention.metadata import AttentionMetadata
from segkv.attention.plan import SequenceQuery
from segkv.cache.chain import KVChain
from segkv.layers.transfer import to_device
from segkv.runner.model_runner import PENDING_TOKEN, ModelRunner
from segkv.runner.row_states import RowStates, record_rows


class MtpRunner:
    """The MTP layers of ``runner.model`` over ``runner``'s cache (see the module docstring).

    The cache must hold the MTP layers' rows: ``runner.cache.layout.num_layers`` equals the main
    layers plus ``len(model.mtp)``. While an ``MtpRunner`` exists, the runner's forwards report
    their hidden states to it. Where the runner replays CUDA graphs, so do the MTP layers' forwards
    (one :class:`~segkv.runner.cuda_graphs.MtpGraphs` per layer, with the runner's window sizes):
    draft steps and catch-ups of up to a window's rows per sequence.
    """

    def __init__(self, runner: ModelRunner) -> None:
        model = runner.model
        mtp = getattr(model, "mtp", None)
        if not mtp:
            raise ValueError(f"{type(model).__name__} has no multi-token-prediction layers")
        main = model.cfg.num_layers
        if runner.cache.layout.num_layers != main + len(mtp):
            raise ValueError(f"the cache holds {runner.cache.layout.num_layers} layers; MTP drafting needs "
                             f"the {main} main layers and the {len(mtp)} MTP layers")
        self.runner = runner
        self.num_layers = len(mtp)
        self._pending: weakref.WeakKeyDictionary[KVChain, RowStates] = weakref.WeakKeyDictionary()
        runner.hidden_listener = self._record
        self.graphs = None
        if runner.graphs is not None:
            from segkv.runner.cuda_graphs import MtpGraphs

            main = runner.graphs
            self.graphs = [MtpGraphs(model, runner.cache, runner.device_spec, depth=d, device=runner.device,
                                     max_model_len=main.max_model_len, buckets=main.buckets,
                                     windows=main.windows, emulate=main.emulate) for d in range(len(mtp))]

    def _record(self, chains: list[KVChain], chunks: list[list[int]], hidden: torch.Tensor) -> None:
        """Keep each chunk's hidden rows (``hidden (T, hidden)``, chunks in order)."""
        record_rows(self._pending, chains, chunks, hidden)

    def pending_rows(self, chain: KVChain) -> int:
        """Rows at the end of ``chain`` whose MTP rows wait for :meth:`catch_up` (0: none known)."""
        record = self._pending.get(chain)
        if record is None or record.start >= chain.num_rows:
            return 0
        if record.end > chain.num_rows:
            record.truncate(chain.num_rows)
        return record.rows if record.end == chain.num_rows else 0

    @torch.inference_mode()
    def catch_up(self, chains: list[KVChain], next_ids: list[list[int]]) -> torch.Tensor:
        """Write the MTP rows of each chain's last ``len(next_ids[i])`` rows (``pending_rows``)
        with the tokens that follow them (the last one: the sequence's pending token); returns
        the MTP hidden state of each chain's last row, ``(B, hidden)``, whose logits
        (:meth:`logits`) predict the token after the pending one."""
        hidden, positions, slots, queries = [], [], [], []
        for chain, ids in zip(chains, next_ids):
            n = len(ids)
            record = self._pending.pop(chain)
            if record.rows != n or record.end != chain.num_rows:
                raise ValueError(f"catch_up of {n} rows, but {record.rows} wait at the chain's end")
            hidden.append(record.rows_from(record.start))
            positions += range(chain.num_rows - n, chain.num_rows)
            slots += chain.last_slots(n)
            queries.append(SequenceQuery.from_chain(chain, n))
        out = self._forward(queries, torch.cat(hidden), [t for ids in next_ids for t in ids], positions, slots,
                            depth=0, widths=[len(ids) for ids in next_ids])
        last = to_device(_ends(next_ids), torch.long, out.device)
        return out[last]

    @torch.inference_mode()
    def draft_step(self, chains: list[KVChain], hidden: torch.Tensor, token_ids: torch.Tensor,
                   depth: int) -> torch.Tensor:
        """One more draft: each chain gets one row appended (the caller trims it), where the MTP
        layer ``min(depth, layers - 1)`` reads ``hidden (B, hidden)`` (the previous MTP output)
        and the previous draft ``token_ids (B,)`` int64, still on the device (the host never waits
        for it). Returns the new MTP hidden states ``(B, hidden)``."""
        if token_ids.shape != (len(chains),):
            raise ValueError(f"token_ids must have shape ({len(chains)},), got {tuple(token_ids.shape)}")
        positions, slots, queries, appended = [], [], [], []
        try:
            for chain in chains:
                positions.append(chain.num_rows)
                slots += chain.append(1, token_ids=[PENDING_TOKEN])  # a draft row: trimmed, never kept
                appended.append(chain)
                queries.append(SequenceQuery.from_chain(chain, 1))
            return self._forward(queries, hidden, [PENDING_TOKEN] * len(chains), positions, slots, depth=depth,
                                 widths=[1] * len(chains), device_ids=token_ids)
        except BaseException:  # no row is left behind: the chains are as they were
            for chain in appended:
                chain.trim(1)
            raise

    def logits(self, mtp_hidden: torch.Tensor, depth: int) -> torch.Tensor:
        """``(N, hidden)`` MTP outputs -> float32 ``(N, vocab)`` logits."""
        return self.runner.model.compute_mtp_logits(mtp_hidden, depth=min(depth, self.num_layers - 1))

    def _forward(self, queries, hidden, next_ids, positions, slots, *, depth: int, widths: list[int],
                 device_ids: torch.Tensor | None = None):
        """The MTP layer's output hidden states of the step's rows; ``device_ids``: the token ids
        on the device (one-row steps; ``next_ids`` then hold placeholders)."""
        runner = self.runner
        depth = min(depth, self.num_layers - 1)
        mla_mode = runner.mla_mode_of([[0] * w for w in widths])
        plan = runner.plan(queries, mla_mode)
        graphs = None if self.graphs is None else self.graphs[depth]
        out = None  # None: no graph holds the step (a catch-up wider than a window, a plan too big)
        if graphs is not None and max(widths) == 1:
            out = graphs.run(next_ids, positions, slots, plan, mla_mode, hidden_in=hidden, device_ids=device_ids)
        elif graphs is not None and max(widths) <= max(graphs.windows, default=0):
            out = graphs.run_window(widths, next_ids, positions, slots, plan, mla_mode, list(range(len(positions))),
                                    hidden_in=hidden)
        if out is not None:
            return out
        meta = AttentionMetadata(backend=runner.backend, prepared=runner.backend.prepare(plan),
                                 storage=runner.cache.storage, slots=to_device(slots, torch.long, runner.device),
                                 mla_mode=mla_mode)
        ids = to_device(next_ids, torch.long, runner.device) if device_ids is None else device_ids
        pos = to_device(positions, torch.long, runner.device)
        return runner.model.mtp_forward(hidden, ids, pos, meta, depth=depth)




def _ends(groups: list[list[int]]) -> list[int]:
    out, total = [], 0
    for g in groups:
        total += len(g)
        out.append(total - 1)
    return out
