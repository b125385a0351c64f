"""The Python standard library's sources as a text corpus, and the byte-level BPE tokenizer trained on it.

The standard library is on every machine that runs segkv, so the built-in models (the untrained
placeholder and the trained defaults) are made from it without downloading anything. This
module holds what the placeholder needs at run time; what only the training of the defaults
needs (the corpus digest, the split by file, the chat examples) is in ``tools/default_models/``,
outside the package.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable
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
