"""Builds tiny byte-level BPE tokenizers on disk, loadable by segkv and by transformers."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Every tiny tokenizer has all of these, appended after the trained vocabulary.
SPECIAL_TOKENS = (
    "<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>",
    "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
)  # fmt: skip

# Qwen-style ChatML: no BOS; a default system prompt; tools rendered through ``tojson``.
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'system' and tools %}{% continue %}{% endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Llama-3 style: the template writes BOS itself and the tokenizer's post-processor adds it too.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = 'Today Date: ' + strftime_now('%d %b %Y') %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['user', 'assistant'] %}\n"
    "        {{- raise_exception('roles must be user or assistant, got ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

_STYLES = {
    # style -> (bos, eos, add_bos_token, template)
    "chatml": (None, "<|im_end|>", False, CHATML_TEMPLATE),
    "llama3": ("<|bos|>", "<|eot_id|>", True, LLAMA3_TEMPLATE),
}
_DEFAULT = object()

_WORDS = (
    "the quick brown fox jumps over lazy dog cache page segment token model attention query key value "
    "layer head batch chain fork restore request server stream hello world python engine prompt answer "
    "naïve café résumé über"
).split()
_CODE = (
    "def {0}(x):\n    return x + {1}",
    "for i in range({1}):\n    print(i, '{0}')",
    "import os\nclass {0}:\n    pass",
    "if {0} is None:\n\traise ValueError('{0}')",
    "{0} = [{1}, {1} * 2]  # {0}",
)
_EXTRA = ("日本語のテキスト", "中文分词测试", "emoji 🙂 🚀 👍🏽", "Ελληνικά και русский", "  spaced\n\n  out  ")


def training_corpus(num_strings: int = 400, *, seed: int = 0) -> list[str]:
    """A few hundred short English, Python and multilingual strings (deterministic for ``seed``)."""
    rng = random.Random(seed)
    corpus = list(_EXTRA)
    for i in itertools.count():
        if len(corpus) >= num_strings:
            break
        if i % 3 == 0:
            corpus.append(rng.choice(_CODE).format(rng.choice(_WORDS), rng.randrange(100)))
        else:
            corpus.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randrange(3, 12))) + ".")
    return corpus


def build_tiny_tokenizer(
    directory: str | Path,
    *,
    style: str = "chatml",
    chat_template: str | list[dict[str, str]] | None = _DEFAULT,  # type: ignore[assignment]
    vocab_size: int = 400,
    model_max_length: int = 2048,
    tokenizer_config: dict | None = None,
) -> None:
    """Train a byte-level BPE and write ``tokenizer.json`` and ``tokenizer_config.json``.

    ``style="chatml"`` (Qwen-like: no BOS, eos ``<|im_end|>``) or ``"llama3"`` (BOS
    ``<|bos|>`` added by a TemplateProcessing post-processor, eos ``<|eot_id|>``) picks the
    special tokens and the default chat template; ``chat_template`` overrides the template
    (``None`` writes none). ``vocab_size`` is the trainer's target for the base vocabulary;
    the special tokens come after it, so read the real size with :func:`tiny_vocab_size`.
    ``tokenizer_config`` entries are merged last, overriding the defaults.
    """
    if style not in _STYLES:
        raise ValueError(f"style must be one of {sorted(_STYLES)}, got {style!r}")
    bos, eos, add_bos, template = _STYLES[style]
    if chat_template is not _DEFAULT:
        template = chat_template
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
            ),
        ])
    tok.save(str(directory / "tokenizer.json"))

    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": "<|pad|>",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    if template is not None:
        config["chat_template"] = template
    config.update(tokenizer_config or {})
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def tiny_vocab_size(directory: str | Path) -> int:
    """The tokenizer's real vocabulary size (trained tokens plus special tokens): use it for models."""
    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
