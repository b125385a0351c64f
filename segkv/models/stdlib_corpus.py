"""The Python standard library's sources as a text corpus, and the byte-level BPE tokenizer trained on it.

The standard library is on every machine that runs segkv, so the built-in models (the untrained
placeholder and the trained defaults) are made from it without downloading anything.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
END_OF_TEXT, IM_START, IM_END = SPECIAL_TOKENS
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Test suites, third-party packages, and the generated codec tables of ``encodings/`` (hex
# mappings, not Python as people write it).
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings",
                       "__pycache__"})


@dataclass(slots=True, frozen=True)
class Document:
    """One source file: its path relative to the standard library's root (POSIX) and its text."""

    path: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_corpus(root: Path | None = None, *, limit_bytes: int | None = None) -> list[Document]:
    """The library's ``*.py`` files sorted by relative path, minus :data:`SKIP_DIRS`.

    ``limit_bytes`` stops after the file that crosses that many bytes of text. Undecodable
    bytes become U+FFFD, so the same files always give the same text.
    """
    root = root or stdlib_root()
    paths = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
                   if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))
    docs, total = [], 0
    for rel, path in paths:
        text = path.read_bytes().decode("utf-8", errors="replace")
        docs.append(Document(rel, text))
        total += len(text.encode())
        if limit_bytes is not None and total >= limit_bytes:
            break
    return docs


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
    """One ChatML exchange, as :data:`CHATML_TEMPLATE` renders it, ending with the answer's end mark."""
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n"


def train_tokenizer(texts: Iterable[str], *, vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with :data:`SPECIAL_TOKENS` first (ids 0..2).

    Byte-level BPE training is deterministic: the alphabet is sorted and merge ties are broken
    by token ids, so the same texts give the same ``tokenizer.json``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, directory: Path, *, model_max_length: int) -> None:
    """``tokenizer.json`` and a ``tokenizer_config.json`` with the ChatML template (no BOS)."""
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": IM_END,
        "pad_token": END_OF_TEXT, "chat_template": CHATML_TEMPLATE, "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))
