"""Grammars compiled for one tokenizer, cached per constraint, with hit and miss counters."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from segkv.sampling_params import StructuredOutput
from segkv.tokenizer.tokenizer import Tokenizer

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (a JSON schema's is tens of KB to a few MB)


def _vocab_type(backend_json: dict[str, Any]) -> str:
    """``BYTE_LEVEL`` (GPT-2 style byte-to-unicode tokens), ``BYTE_FALLBACK`` (SentencePiece style
    ``<0xNN>`` tokens) or ``RAW``, from ``tokenizer.json``'s decoder, as xgrammar's HF detection."""
    decoder = backend_json.get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    if "ByteLevel" in kinds:
        return "BYTE_LEVEL"
    if "ByteFallback" in kinds:
        return "BYTE_FALLBACK"
    return "RAW"


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int):
    """``xgrammar.TokenizerInfo`` of ``tokenizer`` for logits ``vocab_size`` wide (the model's width
    may exceed the tokenizer's vocabulary: the ids beyond it are never allowed). Special tokens
    other than end-of-sequence get an empty string, which xgrammar never allows inside a grammar;
    the end-of-sequence ids are the stop tokens that end a completed grammar."""
    import xgrammar

    backend = tokenizer._backend  # the `tokenizers` object: raw token strings, decoder type
    kind = _vocab_type(json.loads(backend.to_str()))
    specials = tokenizer.special_token_ids - set(tokenizer.eos_token_ids)
    size = min(tokenizer.vocab_size, vocab_size)
    encoded = ["" if i in specials else (backend.id_to_token(i) or "") for i in range(size)]
    # SentencePiece-style tokenizers prepend a space ("▁") to the text: xgrammar must know it
    first = tokenizer.encode("a", add_special_tokens=False)[:1]
    prefix_space = kind == "BYTE_FALLBACK" and bool(first) and encoded[first[0]].startswith("\u2581")
    return xgrammar.TokenizerInfo(encoded, getattr(xgrammar.VocabType, kind), vocab_size=vocab_size,
                                  stop_token_ids=list(tokenizer.eos_token_ids) or None,
                                  add_prefix_space=prefix_space)


class GrammarCache:
    """Compiles :class:`StructuredOutput` constraints for one tokenizer and keeps the ``capacity``
    most recently used (keyed by :attr:`StructuredOutput.key`). ``hits``/``misses`` count lookups;
    the xgrammar compiler is made on the first miss, so an engine that never sees a constrained
    request never imports xgrammar. Thread-safe (the server and an offline caller may share it)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, capacity: int = DEFAULT_CACHE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._compiled: OrderedDict[tuple[str, str, str, str], Any] = OrderedDict()
        self._compiler = None
        self._texts: list[bytes] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._compiled)

    def compile(self, structured: StructuredOutput):
        """The ``xgrammar.CompiledGrammar`` of ``structured`` (compiled on a miss, then cached)."""
        key = structured.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self.hits += 1
                self._compiled.move_to_end(key)
                return compiled
            self.misses += 1
            if self._compiler is None:
                import xgrammar

                self._compiler = xgrammar.GrammarCompiler(tokenizer_info(self.tokenizer, self.vocab_size),
                                                          cache_enabled=False)
            compiled = self._compiler.compile_grammar(structured.to_grammar())
            self._compiled[key] = compiled
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
            return compiled

    def token_texts(self) -> list[bytes]:
        """Each token id's bytes as the grammar reads them (special tokens: empty)."""
        with self._lock:
            if self._texts is None:
                self._texts = list(tokenizer_info(self.tokenizer, self.vocab_size).decoded_vocab)
            return self._texts

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "size": len(self._compiled)}
