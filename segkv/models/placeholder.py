"""A small untrained Qwen3-style model built on first use, so ``--model default`` always works.

The weights are random (seeded) and the byte-level BPE tokenizer is trained on the Python
standard library's sources found on every machine: the server, the API and the cache all
work end to end, but the text is not meaningful. Trained default models replace it.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file

from segkv.models.qwen3 import Qwen3ForCausalLM

DEFAULT_NAME = "default"
_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def default_model_dir() -> Path:
    """Where the placeholder lives: ``$SEGKV_HOME/default-untrained`` (default ``~/.cache/segkv``)."""
    home = Path(os.environ.get("SEGKV_HOME", Path.home() / ".cache" / "segkv"))
    return home / "default-untrained"


def ensure_default_model(directory: Path | None = None, *, seed: int = 0) -> Path:
    """Build the placeholder model directory if it is not there yet; return its path."""
    directory = directory or default_model_dir()
    if (directory / "model.safetensors").is_file():
        return directory
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = _train_tokenizer(tmp)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
        "eos_token_id": 2, "bos_token_id": None,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM.from_hf_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp / "model.safetensors")
    if directory.exists():  # another process built it meanwhile
        import shutil

        shutil.rmtree(tmp)
    else:
        tmp.replace(directory)
    return directory


def resolve_model_dir(name: str) -> Path:
    """``"default"`` -> the placeholder's directory (built if needed); anything else -> a path."""
    return ensure_default_model() if name == DEFAULT_NAME else Path(name)


def _corpus(limit_bytes: int = 3_000_000):
    """Text of the Python standard library's modules (present on every machine)."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="ignore")
        total += len(text)
        yield text
        if total > limit_bytes:
            return


def _train_tokenizer(directory: Path, vocab_size: int = 2048) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": _CHATML, "model_max_length": 4096,
    }, indent=2))
    return tok.get_vocab_size()
