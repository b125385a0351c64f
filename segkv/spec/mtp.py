"""Drafts from the model's own multi-token-prediction layers (``method: "mtp"``)."""

from __future__ import annotations

import torch

from segkv.cache.page_pool import OutOfPagesError
from segkv.layers.transfer import to_device
from segkv.runner.mtp import MtpRunner


class MtpProposer:
    """Greedy drafts of a DeepSeek-V3-style model's MTP layers (see ``runner/mtp.py``).

    Each step first writes the MTP rows the sequence's last rows still lack (their next tokens are
    now known); the MTP output at the chain's last row gives the first draft, its argmax. Drafts
    ``2..k`` run the last MTP layer again on the previous MTP output and draft (vLLM's and SGLang's
    reuse for ``k`` above the layer count), on rows appended for the draft and trimmed after.
    Drafts are deterministic (argmax), so verification takes them as one-hot proposals.

    A sequence whose last rows have no recorded hidden states (a fork, or rows written before
    drafting began) proposes nothing that step; its plain decode step records them.
    """

    def __init__(self, mtp: MtpRunner) -> None:
        self.mtp = mtp

    def propose(self, seqs: list, rooms: list[int]) -> list[list[int]]:
        """``seqs``: sequences with ``chain`` and ``token_ids_from(start)`` (their tokens from
        ``start``; the last one pending, with no row yet); at most ``rooms[i]`` drafts each."""
        out: list[list[int]] = [[] for _ in seqs]
        ready, next_ids = [], []
        for i, s in enumerate(seqs):
            n = self.mtp.pending_rows(s.chain)
            if n:
                rows = s.chain.num_rows
                ready.append(i)
                next_ids.append(s.token_ids_from(rows - n + 1))  # through the pending token
        if not ready:
            return out
        hidden = self.mtp.catch_up([seqs[i].chain for i in ready], next_ids)
        # the drafts stay on the device until the last is drawn: one device-to-host copy per call
        tokens = self.mtp.logits(hidden, 0).argmax(dim=-1)
        columns = [tokens]  # draft j of every sequence in ``ready`` (stale where it stopped before)
        appended = dict.fromkeys(ready, 0)
        active = [n for n, i in enumerate(ready) if rooms[i] > 1]  # positions in ``ready``
        depth = 1
        try:
            while active:
                chains = [seqs[ready[n]].chain for n in active]
                whole = len(active) == len(ready)
                index = None if whole else to_device(active, torch.long, hidden.device)
                step = self.mtp.draft_step(chains, hidden if whole else hidden[index],
                                           tokens if whole else tokens[index], depth)
                for n in active:
                    appended[ready[n]] += 1
                picks = self.mtp.logits(step, depth).argmax(dim=-1)
                if whole:
                    hidden, tokens = step, picks
                else:
                    hidden, tokens = hidden.index_copy(0, index, step), tokens.index_copy(0, index, picks)
                columns.append(tokens)
                depth += 1
                active = [n for n in active if rooms[ready[n]] > depth]
        except OutOfPagesError:  # no room for a draft row: the drafts so far stand
            pass
        finally:
            for i, n in appended.items():
                if n:
                    seqs[i].chain.trim(n)
        table = torch.stack(columns, dim=1).tolist()
        for n, i in enumerate(ready):
            out[i] = table[n][: min(rooms[i], len(columns))]
        return out
