"""Streaming token ids to text deltas: whole UTF-8 characters only, stop strings cut OpenAI-style."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from segkv.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 6  # prompt tokens kept as decoding context (leading-space rules of some decoders)


@dataclass(slots=True)
class StopChecker:
    """Finds the first stop string in streamed text and holds back text that may start one.

    ``feed(delta)`` returns the text that is safe to emit now: never a partial stop string,
    and never the stop string itself (OpenAI semantics). Text is cut before the stop string
    that ends first, as if checked after every character. Once a stop string is seen,
    ``stopped`` is set, ``stop_string`` names it, and later feeds return ``""``.
    """

    stop: Sequence[str] = ()
    stopped: bool = field(default=False, init=False)
    stop_string: str | None = field(default=None, init=False)
    _held: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")

    @property
    def held(self) -> str:
        """Text received but not yet emitted, because it may be the start of a stop string."""
        return self._held

    def feed(self, delta: str) -> str:
        """Add ``delta``; return what can be emitted (the text before a stop string, if one ends here)."""
        if self.stopped:
            return ""
        text = self._held + delta
        # The stop string that ends first wins (at a tie, the one starting first): the result of
        # checking character by character, so it does not depend on how the text was chunked.
        hits = [(i + len(s), i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            _, index, self.stop_string = min(hits)
            self.stopped, self._held = True, ""
            return text[:index]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """End of stream without a stop string: release the held text."""
        text, self._held = ("" if self.stopped else self._held), ""
        return text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas whose concatenation equals ``decode(ids)``.

    Each step decodes a short window (as vLLM does) that starts at the previous chunk of
    emitted tokens, so decoders with context rules (a SentencePiece leading space) see that
    context; ``prompt_ids`` seeds it with the prompt's last tokens. While the window's text
    ends in U+FFFD (a UTF-8 character cut between tokens) nothing is emitted and the window
    grows; ``finish()`` releases a sequence that never completed as U+FFFD, as ``decode``
    renders it. (Exact for byte-level BPE; with SentencePiece byte fallback, random invalid
    byte runs may render their U+FFFDs differently, as that decoder judges a run as a whole.)
    Stop strings are applied to the decoded text through a :class:`StopChecker`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._checker = StopChecker(stop)
        # Window over self._ids: [prefix, read) was emitted already; [read, len) is pending.
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix = 0
        self._read = len(self._ids)
        self._num_context = len(self._ids)
        self._text: list[str] = []
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        """The generated ids received so far (prompt context excluded)."""
        return self._ids[self._num_context :]

    @property
    def output_text(self) -> str:
        """All text emitted so far (truncated before a stop string)."""
        return "".join(self._text)

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been reached (further ids are ignored)."""
        return self._checker.stopped

    @property
    def stop_string(self) -> str | None:
        return self._checker.stop_string

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append one or more generated ids; return the new text that may be shown now."""
        if self._finished:
            raise ValueError("add() after finish(): this detokenizer's stream has ended")
        if self.stopped:
            return ""
        new = [int(t) for t in token_ids] if isinstance(token_ids, Iterable) else [int(token_ids)]
        if not new:
            return ""
        self._ids.extend(new)
        return self._emit(self._checker.feed(self._decode_pending(final=False)))

    def finish(self) -> str:
        """End the stream: return the text still held (an incomplete character, a partial stop)."""
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        delta = self._checker.feed(self._decode_pending(final=True))
        return self._emit(delta + self._checker.flush())

    def _emit(self, delta: str) -> str:
        if delta:
            self._text.append(delta)
        return delta

    def _decode_pending(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        done = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if not final and text.endswith(_REPLACEMENT):
            return ""  # a character is still incomplete: wait for its remaining bytes
        self._prefix, self._read = self._read, len(self._ids)
        # Byte-level and SentencePiece decoders give ``text.startswith(done)``; should a decoder
        # rewrite earlier text, the characters past ``done``'s length are the best delta left.
        return text[len(done) :]
