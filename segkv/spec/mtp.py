"""Drafts from the model's own multi-token-prediction layers (``method: "mtp"``)."""

from __future__ import annotations

from segkv.cache.page_pool import OutOfPagesError
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
        for i, token in zip(ready, self.mtp.logits(hidden, 0).argmax(dim=-1).tolist()):
            out[i].append(token)
        appended = dict.fromkeys(ready, 0)
        active = [n for n, i in enumerate(ready) if rooms[i] > 1]  # positions in ``ready``
        depth = 1
        try:
            while active:
                chains = [seqs[ready[n]].chain for n in active]
                step = self.mtp.draft_step(chains, hidden[active], [out[ready[n]][-1] for n in active], depth)
                for n in active:
                    appended[ready[n]] += 1
                hidden = hidden.clone()
                hidden[active] = step
                for n, token in zip(active, self.mtp.logits(step, depth).argmax(dim=-1).tolist()):
                    out[ready[n]].append(token)
                active = [n for n in active if len(out[ready[n]]) < rooms[ready[n]]]
                depth += 1
        except OutOfPagesError:  # no room for a draft row: the drafts so far stand
            pass
        finally:
            for i, n in appended.items():
                if n:
                    seqs[i].chain.trim(n)
        return out
