"""Text to token ids and back for one model directory, with its Jinja chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

Messages = Sequence[Mapping[str, Any]]  # [{"role": ..., "content": ...}, ...]
Tools = Sequence[Mapping[str, Any]]  # JSON schemas of the tools a model may call

_NO_LIMIT = 10**29  # transformers writes int(1e30) for "no maximum length"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (assistant-mask markers); render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates may not set {name!r} on a namespace")


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's trick: a field may be called "self"
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(args[0], attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    options = {"indent": indent, "separators": separators, "sort_keys": sort_keys}
    return json.dumps(value, ensure_ascii=ensure_ascii, **options)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    """The sandboxed environment transformers renders chat templates with, and its globals."""
    extensions = [_GenerationTag, jinja2.ext.loopcontrols]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        namespace=_Namespace,
    )
    return env.from_string(source)


def _plain(value: Any, where: str) -> Any:
    """A copy of ``value`` made of JSON types only (what a sandboxed template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    for kind in (bool, int, float, str):  # subclasses (enums, numpy scalars) lose their extra methods
        if isinstance(value, kind):
            return kind(value)
    raise ValueError(f"{where} must hold JSON-like values only, got {type(value).__name__}")


def _normalize_messages(messages: Messages) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} mappings")
    out = []
    for i, message in enumerate(messages):
        valid = isinstance(message, Mapping) and isinstance(message.get("role"), str)
        if not valid or "content" not in message:
            raise ValueError(f"messages[{i}] needs a 'role' string and a 'content', got {message!r:.100}")
        # Like transformers: keys set to None are dropped; reasoning is aliased under its common names.
        msg = {k: _plain(v, f"messages[{i}].{k}") for k, v in message.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def _token_content(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config {key} must be a string or a dict with 'content', got {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _eos_ids(path: Path) -> list[int]:
    """``eos_token_id`` of a model JSON file (an int or a list; absent file or key: none)."""
    value = _read_json(path).get("eos_token_id")
    return [] if value is None else [int(v) for v in (value if isinstance(value, list) else [value])]


def _chat_templates(config: Mapping[str, Any], model_dir: Path) -> dict[str, str]:
    """Template name -> source; separate ``*.jinja`` files win over ``tokenizer_config.json``."""
    raw = config.get("chat_template")
    keys = {"name", "template"}
    named = isinstance(raw, list) and all(isinstance(t, Mapping) and keys <= t.keys() for t in raw)
    if raw is None or isinstance(raw, str):
        templates = {} if raw is None else {"default": raw}
    elif named:
        templates = {t["name"]: t["template"] for t in raw}
    else:
        raise ValueError(f"chat_template must be a string or a list of {{name, template}}, got {raw!r:.100}")
    files = {p.stem: p for p in sorted((model_dir / "additional_chat_templates").glob("*.jinja"))}
    if (model_dir / "chat_template.jinja").is_file():
        files["default"] = model_dir / "chat_template.jinja"
    return {name: path.read_text(encoding="utf-8") for name, path in files.items()} if files else templates


class Tokenizer:
    """A model's tokenizer (``tokenizer.json`` plus ``tokenizer_config.json``), matching transformers.

    Encoding follows ``tokenizer.json``'s post-processor, as transformers 5 does when that file
    exists: ``add_bos_token`` in the config does not change it. Chat templates render exactly
    as transformers' ``apply_chat_template`` (same sandbox, filters and globals), except that
    ``raise_exception`` raises ``ValueError`` and tools must already be JSON schemas.
    """

    def __init__(
        self,
        backend: _Backend,
        config: Mapping[str, Any],
        *,
        chat_templates: Mapping[str, str],
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        backend.no_truncation()
        backend.no_padding()
        # Named special tokens (bos_token, eos_token, ... and model-specific *_token keys) are
        # template variables; like transformers, any that the vocabulary lacks is added to it.
        self._named = {
            key: _token_content(value, key)
            for key, value in config.items()
            if key.endswith("_token") and isinstance(value, (str, Mapping))
        }
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = extra.values() if isinstance(extra, Mapping) else extra
        specials = [*self._named.values(), *(_token_content(t, "extra_special_tokens") for t in extra)]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        self._templates = dict(chat_templates)
        limit = config.get("model_max_length")
        self._max_length = int(limit) if limit is not None and int(limit) < _NO_LIMIT else None
        self._bos_id, self._pad_id, eos_id = (self._id(f"{name}_token") for name in ("bos", "pad", "eos"))
        self._eos_ids = tuple(dict.fromkeys([*([] if eos_id is None else [eos_id]), *extra_eos_ids]))
        self._adds_bos = self._bos_id is not None and self.encode("")[:1] == [self._bos_id]
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required), ``tokenizer_config.json``, ``chat_template.jinja``
        and the eos ids of ``generation_config.json`` and ``config.json``."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        config = _read_json(model_dir / "tokenizer_config.json")
        extra_eos = _eos_ids(model_dir / "generation_config.json") + _eos_ids(model_dir / "config.json")
        templates = _chat_templates(config, model_dir)
        return cls(_Backend.from_file(str(path)), config, chat_templates=templates, extra_eos_ids=extra_eos)

    def _id(self, key: str) -> int | None:
        token = self._named.get(key)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added and special tokens included (transformers' ``len(tokenizer)``)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the tokenizer's eos, then generation_config's, then config's."""
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_id

    @property
    def model_max_length(self) -> int | None:
        """The config's ``model_max_length``, or ``None`` when it is unset (or transformers' 1e30)."""
        return self._max_length

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special_tokens=True)`` starts with the BOS token."""
        return self._adds_bos

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special tokens (those ``skip_special_tokens`` drops)."""
        return self._special_ids

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (e.g. BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"encode needs a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte runs become U+FFFD, as in transformers."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = True,
        tools: Tools | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` (each with ``role`` and ``content``) to the prompt string.

        ``tools`` are JSON schemas (the ``tool_use`` template is chosen when there is one);
        ``template_kwargs`` are extra variables (e.g. ``enable_thinking``), which override the
        special-token variables (``bos_token``, ``eos_token``, ...).
        """
        if not self._templates:
            raise ValueError("this tokenizer has no chat_template; chat requests need one")
        name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
        if name not in self._templates:
            raise ValueError(f"several chat templates and no 'default' among {sorted(self._templates)}")
        chat = _normalize_messages(messages)
        if tools is not None:
            if isinstance(tools, (str, Mapping)) or not all(isinstance(t, Mapping) for t in tools):
                raise ValueError("tools must be a list of JSON-schema mappings")
            tools = _plain(list(tools), "tools")
        variables = {**self._named, **_plain(dict(template_kwargs or {}), "template_kwargs")}
        variables.update(messages=chat, tools=tools, documents=None)
        variables["add_generation_prompt"] = add_generation_prompt
        return _compile(self._templates[name]).render(**variables)

    def encode_chat(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = True,
        tools: Tools | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat, encoded without special tokens (the template writes
        BOS itself when the model wants one), as transformers' ``apply_chat_template`` does."""
        text = self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        return self.encode(text, add_special_tokens=False)
