"""Tool-call parsers: turn a model's generated text into OpenAI ``tool_calls`` plus content.

Each model family writes its calls in its own format; a parser reads one format. Parsers
are named as vLLM's ``--tool-call-parser`` names them (``hermes``, ``llama3_json``,
``mistral``, ``deepseek_v3``). Parsing never raises on model output: text that cannot be
read as a call (an unknown shape, malformed JSON inside a call block) stays content.

Arguments come back as a JSON string of an object, as OpenAI sends them: an argument
object is serialised compactly-spaced (``{"a": 1}``) with non-ASCII text kept as is, and an
argument given as a JSON string holding an object is decoded and serialised the same way.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import string
from dataclasses import dataclass, field

CALL_ID_PREFIX = "call_"
CALL_ID_LENGTH = 24
MISTRAL_ID_LENGTH = 9  # Mistral's chat templates refuse any other tool call id
_ID_ALPHABET = string.ascii_letters + string.digits
ID_STYLES = ("openai", "mistral")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity: OpenAI clients cannot read them


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_WS = re.compile(r"\s*")


def make_call_id(rng: random.Random | None = None, *, style: str = "openai") -> str:
    """A tool call id; deterministic when a ``random.Random`` is given. ``style`` "openai":
    ``call_`` + 24 random alphanumerics; "mistral": 9 alphanumerics (what Mistral's templates
    accept when the id comes back in the conversation)."""
    if style not in ID_STYLES:
        raise ValueError(f"unknown tool call id style {style!r}; valid: {', '.join(ID_STYLES)}")
    choice = secrets.choice if rng is None else rng.choice
    if style == "mistral":
        return "".join(choice(_ID_ALPHABET) for _ in range(MISTRAL_ID_LENGTH))
    return CALL_ID_PREFIX + "".join(choice(_ID_ALPHABET) for _ in range(CALL_ID_LENGTH))


@dataclass(slots=True)
class ToolCall:
    """One function call: its id, the function's name and its arguments as a JSON string."""

    id: str
    name: str
    arguments: str

    def __post_init__(self):
        if not self.id:
            raise ValueError("a tool call needs a non-empty id")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a tool call needs a non-empty function name")
        if not isinstance(self.arguments, str):
            raise ValueError("a tool call's arguments must be a JSON string")

    def to_openai(self) -> dict:
        """The call as an OpenAI chat completion message's ``tool_calls`` entry."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(slots=True)
class ParsedOutput:
    """Generated text split into content (None when nothing but calls) and tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def _arguments_json(value) -> str | None:
    """Arguments as a JSON object string, or None when they are not an object."""
    if value is None:
        value = {}
    if isinstance(value, str):
        try:
            value = _DECODER.decode(value) if value.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, dict):
        return None
    try:
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):  # nesting too deep to serialise
        return None


def _call_from_object(obj, rng: random.Random | None, *, keys=("arguments", "parameters"),
                      args_required: bool = False, style: str = "openai") -> ToolCall | None:
    """``{"name": ..., "arguments"|"parameters": ...}`` as a ToolCall, or None if not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    present = [k for k in keys if k in obj]
    if args_required and not present:
        return None
    arguments = _arguments_json(obj[present[0]] if present else None)
    if arguments is None:
        return None
    return ToolCall(make_call_id(rng, style=style), obj["name"], arguments)


def _decode_at(text: str, pos: int):
    """(value, end) of the JSON value starting at ``pos`` after whitespace, or None."""
    pos = _WS.match(text, pos).end()
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def _finish(pieces: list[str], calls: list[ToolCall], text: str) -> ParsedOutput:
    """No calls: the text unchanged; else the text outside the calls, stripped (None if empty)."""
    if not calls:
        return ParsedOutput(text, [])
    content = "".join(pieces).strip()
    return ParsedOutput(content or None, calls)


class ToolParser:
    """Reads one model family's tool-call format out of generated text."""

    name = ""
    id_style = "openai"  # of :func:`make_call_id`
    markers: tuple[str, ...] = ()  # text that opens a call block

    def parse(self, text: str, rng: random.Random | None = None) -> ParsedOutput:
        """Split ``text`` into content and tool calls; ids from ``rng`` when given."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where the first call block may begin in ``text`` (a marker, or the start of one cut
        off at the end of ``text``), or None: everything before it is surely content."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        for start in range(max(0, len(text) - max(map(len, self.markers), default=0) + 1), len(text)):
            if any(m.startswith(text[start:]) for m in self.markers):
                found.append(start)
                break
        return min(found, default=None)


class HermesToolParser(ToolParser):
    """Qwen2/Qwen3 (Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN,)

    def parse(self, text, rng=None):
        pieces, calls, pos = [], [], 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            pieces.append(text[pos:start])
            body = start + len(self.OPEN)
            decoded = _decode_at(text, body)
            call = end = None
            if decoded is not None:
                after = _WS.match(text, decoded[1]).end()
                if text.startswith(self.CLOSE, after):
                    end = after + len(self.CLOSE)
                elif after == len(text):  # generation stopped before the closing tag
                    end = after
                if end is not None:
                    call = _call_from_object(decoded[0], rng)
            if call is None:  # malformed: the block, tags included, stays content
                close = text.find(self.CLOSE, body)
                end = len(text) if close < 0 else close + len(self.CLOSE)
                pieces.append(text[start:end])
            else:
                calls.append(call)
            pos = end
        pieces.append(text[pos:])
        return _finish(pieces, calls, text)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+: ``{"name": ..., "parameters": {...}}`` objects (after an optional
    ``<|python_tag|>``), several separated by ``;``; a JSON list of such objects also reads."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)

    def call_start(self, text):
        stripped = len(text) - len(text.lstrip())
        if text[stripped:stripped + 1] in ("{", "["):  # calls only when the output starts with JSON
            return stripped
        return ToolParser.call_start(self, text)

    def parse(self, text, rng=None):
        tag = text.find(self.TAG)
        if tag >= 0:
            prefix, body = text[:tag], tag + len(self.TAG)
        elif text.lstrip().startswith(("{", "[")):
            prefix, body = "", 0
        else:
            return ParsedOutput(text, [])
        calls, pos = [], body
        while (decoded := _decode_at(text, pos)) is not None:
            value, end = decoded
            objects = value if isinstance(value, list) else [value]
            found = [_call_from_object(o, rng, keys=("parameters", "arguments"), args_required=True)
                     for o in objects]
            if not found or None in found:
                break
            calls += found
            pos = _WS.match(text, end).end()
            if not text.startswith(";", pos):
                break
            pos += 1
        if not calls:
            return ParsedOutput(text, [])
        return _finish([prefix, text[pos:]], calls, text)


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; the newer
    ``[TOOL_CALLS]NAME[ARGS]{...}`` form (optionally with ``[CALL_ID]ID``) also reads."""

    name = "mistral"
    id_style = "mistral"
    MARK = "[TOOL_CALLS]"
    markers = (MARK,)
    _NAMED = re.compile(r"\s*([^\[\]\s{}]+)(?:\[CALL_ID\][A-Za-z0-9_-]*)?\[ARGS\]")

    def _block(self, text, pos, rng):
        """(calls, end) for the call block starting at ``pos`` (just after the mark), or None."""
        named = self._NAMED.match(text, pos)
        if named:
            decoded = _decode_at(text, named.end())
            if decoded is None:
                return None
            call = _call_from_object({"name": named.group(1), "arguments": decoded[0]}, rng,
                                     style=self.id_style)
            return None if call is None else ([call], decoded[1])
        decoded = _decode_at(text, pos)
        if decoded is None:
            return None
        objects = decoded[0] if isinstance(decoded[0], list) else [decoded[0]]
        calls = [_call_from_object(o, rng, style=self.id_style) for o in objects]
        return None if not calls or None in calls else (calls, decoded[1])

    def parse(self, text, rng=None):
        pieces, calls, pos = [], [], 0
        while (start := text.find(self.MARK, pos)) >= 0:
            pieces.append(text[pos:start])
            block = self._block(text, start + len(self.MARK), rng)
            if block is None:  # malformed: the rest up to the next mark stays content
                following = text.find(self.MARK, start + len(self.MARK))
                pos = len(text) if following < 0 else following
                pieces.append(text[start:pos])
                continue
            calls += block[0]
            pos = block[1]
        pieces.append(text[pos:])
        return _finish(pieces, calls, text)


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek V3: ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``."""

    name = "deepseek_v3"
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    markers = (CALLS_BEGIN,)
    _HEAD = re.compile(r"\s*function\s*<｜tool▁sep｜>([^\n<]+)\n```(?:json)?[ \t]*\n")
    _FENCE_END = re.compile(r"\s*```\s*<｜tool▁call▁end｜>")

    def _call(self, text, pos, rng):
        """(call, end) for the call whose begin tag ends at ``pos``, or None if malformed."""
        head = self._HEAD.match(text, pos)
        if not head:
            return None
        decoded = _decode_at(text, head.end())
        if decoded is None:
            return None
        fence = self._FENCE_END.match(text, decoded[1])
        if not fence:
            return None
        call = _call_from_object({"name": head.group(1).strip(), "arguments": decoded[0]}, rng)
        return None if call is None else (call, fence.end())

    def parse(self, text, rng=None):
        begin = text.find(self.CALLS_BEGIN)
        if begin < 0:
            return ParsedOutput(text, [])
        pieces, calls, pos = [text[:begin]], [], begin + len(self.CALLS_BEGIN)
        while True:
            start = _WS.match(text, pos).end()
            if text.startswith(self.CALLS_END, start):
                pos = start + len(self.CALLS_END)
                break
            if not text.startswith(self.CALL_BEGIN, start):
                break
            found = self._call(text, start + len(self.CALL_BEGIN), rng)
            if found is None:  # malformed: the call, tags included, stays content
                close = text.find(self.CALL_END, start)
                following = text.find(self.CALL_BEGIN, start + len(self.CALL_BEGIN))
                pos = len(text) if close < 0 else close + len(self.CALL_END)
                if 0 <= following < pos:
                    pos = following
                pieces.append(text[start:pos])
                continue
            calls.append(found[0])
            pos = found[1]
        pieces.append(text[pos:])
        return _finish(pieces, calls, text)


PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, DeepSeekV3ToolParser)
}
# Hugging Face ``model_type`` -> the parser of that family's chat template.
_DEFAULTS = {
    "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
    "llama": "llama3_json", "mistral": "mistral", "deepseek_v3": "deepseek_v3",
}


def parser_for(name: str) -> ToolParser:
    """The parser called ``name`` (vLLM's ``--tool-call-parser`` names)."""
    try:
        return PARSERS[name]()
    except (KeyError, TypeError):
        raise ValueError(f"unknown tool-call parser {name!r}; valid: {', '.join(sorted(PARSERS))}") from None


def default_parser(model_type: str) -> str | None:
    """The parser name for a Hugging Face ``model_type``, or None when the family has none."""
    return _DEFAULTS.get(model_type)
