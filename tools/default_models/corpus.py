"""What only training makes of the standard-library corpus: its digest, the split by file, and
the ChatML examples (``segkv.models.stdlib_corpus`` reads the corpus and trains the tokenizer)."""

from __future__ import annotations

import ast
import hashlib
import sys
from collections.abc import Iterable, Sequence

from segkv.models.stdlib_corpus import IM_END, IM_START, Document


def corpus_sha256(docs: Sequence[Document]) -> str:
    """A digest of the corpus: every path and text, in order (what makes a training run repeatable)."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.path.encode() + b"\0" + doc.text.encode() + b"\0")
    return digest.hexdigest()


def split_corpus(docs: Sequence[Document], *, every: int = 50) -> dict[str, list[Document]]:
    """Split by file: ``docs[i]`` goes to ``test`` if ``i % every == 0``, to ``valid`` if
    ``i % every == every // 2``, else to ``train`` (no file is in two splits)."""
    if every < 3:
        raise ValueError(f"every must be >= 3 so that each split gets files, got {every}")
    split: dict[str, list[Document]] = {"train": [], "valid": [], "test": []}
    for i, doc in enumerate(docs):
        key = "test" if i % every == 0 else "valid" if i % every == every // 2 else "train"
        split[key].append(doc)
    return split


def chat_examples(docs: Iterable[Document], *, max_chars: int = 1500) -> list[tuple[str, str]]:
    """``(user, assistant)`` pairs made from the corpus's documented functions.

    The user asks with the function's ``def`` line (even-numbered functions) or its docstring's
    first line (odd-numbered); the assistant answers with the function's source. A few of these
    in training make chat-formatted requests answer with Python.
    """
    pairs = []
    for doc in docs:
        try:
            tree = ast.parse(doc.text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.col_offset:
                continue  # top-level functions only: their source needs no dedent
            summary = (ast.get_docstring(node) or "").strip().split("\n")[0]
            source = ast.get_source_segment(doc.text, node)
            if not summary or not source or len(source) > max_chars or node.decorator_list:
                continue
            question = source.split("\n")[0] if len(pairs) % 2 == 0 else summary
            pairs.append((question, source))
    return pairs


def format_chat(user: str, assistant: str) -> str:
    """One ChatML exchange, as ``segkv.models.stdlib_corpus.CHATML_TEMPLATE`` renders it, ending
    with the answer's end mark."""
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n"


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))
