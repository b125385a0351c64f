"""Tool-call parsers: each format's calls become OpenAI tool calls; anything else stays content."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from segkv.server.tool_parsers import (
    PARSERS,
    ParsedOutput,
    ToolCall,
    default_parser,
    make_call_id,
    parser_for,
)

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MARKERS = {
    "hermes": ["<tool_call>"],
    "llama3_json": ["<|python_tag|>"],
    "mistral": ["[TOOL_CALLS]"],
    "deepseek_v3": [DS_CALLS_BEGIN],
}


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def render(fmt: str, calls: list[tuple[str, dict]], prefix: str = "", variant: int = 0) -> str:
    """Write ``calls`` as the model family ``fmt`` writes them (``variant`` picks a spelling)."""
    if fmt == "hermes":
        return prefix + "\n".join(f"<tool_call>\n{_dumps({'name': n, 'arguments': a})}\n</tool_call>"
                                  for n, a in calls)
    if fmt == "llama3_json":
        body = "; ".join(_dumps({"name": n, "parameters": a}) for n, a in calls)
        return body if variant and not prefix else prefix + "<|python_tag|>" + body
    if fmt == "mistral":
        if variant:
            return prefix + "".join(f"[TOOL_CALLS]{n}[ARGS]{_dumps(a)}" for n, a in calls)
        return prefix + "[TOOL_CALLS]" + _dumps([{"name": n, "arguments": a} for n, a in calls])
    if fmt == "deepseek_v3":
        body = "\n".join(f"{DS_CALL_BEGIN}function{DS_SEP}{n}\n```json\n{_dumps(a)}\n```{DS_CALL_END}"
                         for n, a in calls)
        return prefix + DS_CALLS_BEGIN + body + DS_CALLS_END
    raise AssertionError(fmt)


def summary(out: ParsedOutput):
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


FORMATS = sorted(MARKERS)
NESTED = {"query": {"filters": [{"field": "year", "op": ">=", "value": 2020}, None, True]}, "limit": 5.5}
UNICODE = {"city": "Zürich", "note": "東京 🌧 \"quoted\"\n\\path"}


def test_registry_names_and_errors():
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "deepseek_v3"}
    for name in PARSERS:
        assert parser_for(name).name == name
    with pytest.raises(ValueError, match="deepseek_v3, hermes, llama3_json, mistral"):
        parser_for("qwen")
    assert default_parser("qwen2") == default_parser("qwen3") == "hermes"
    assert default_parser("llama") == "llama3_json"
    assert default_parser("mistral") == "mistral"
    assert default_parser("deepseek_v3") == "deepseek_v3"
    assert default_parser("gpt2") is None


def test_call_ids_are_openai_style_and_seedable():
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", make_call_id())
    assert make_call_id() != make_call_id()
    assert make_call_id(random.Random(7)) == make_call_id(random.Random(7))
    # Mistral's templates refuse a call id that is not 9 alphanumerics when it comes back
    assert re.fullmatch(r"[A-Za-z0-9]{9}", make_call_id(style="mistral"))
    with pytest.raises(ValueError, match="openai, mistral"):
        make_call_id(style="uuid")
    text = render("hermes", [("f", {}), ("g", {})])
    a = parser_for("hermes").parse(text, random.Random(1))
    b = parser_for("hermes").parse(text, random.Random(1))
    assert [c.id for c in a.tool_calls] == [c.id for c in b.tool_calls]
    assert len({c.id for c in a.tool_calls}) == 2
    assert a.tool_calls[0].to_openai() == {
        "id": a.tool_calls[0].id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_tool_call_validates():
    with pytest.raises(ValueError):
        ToolCall("call_x", "", "{}")
    with pytest.raises(ValueError):
        ToolCall("call_x", "f", {"a": 1})


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", [0, 1])
def test_one_and_several_calls(fmt, variant):
    parser = parser_for(fmt)
    one = parser.parse(render(fmt, [("get_weather", {"city": "Paris"})], variant=variant))
    assert summary(one) == (None, [("get_weather", {"city": "Paris"})])
    assert one.tool_calls[0].arguments == '{"city": "Paris"}'
    calls = [("get_weather", {"city": "Paris"}), ("search", NESTED), ("now", {})]
    assert summary(parser.parse(render(fmt, calls, variant=variant))) == (None, calls)


@pytest.mark.parametrize("fmt", FORMATS)
def test_text_before_calls_nested_and_unicode(fmt):
    calls = [("search", NESTED), ("wetter_für", UNICODE)]
    out = parser_for(fmt).parse(render(fmt, calls, prefix="Let me look that up — ümlaut.\n\n"))
    assert summary(out) == ("Let me look that up — ümlaut.", calls)
    assert "Zürich" in out.tool_calls[1].arguments and "\\u" not in out.tool_calls[1].arguments


def test_arguments_given_as_json_string_are_normalised():
    inner = json.dumps({"a": [1, 2], "b": "ü"})  # ASCII-escaped, compact spacing varies
    text = f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(inner)}}}\n</tool_call>'
    out = parser_for("hermes").parse(text)
    assert out.tool_calls[0].arguments == '{"a": [1, 2], "b": "ü"}'
    compact = json.dumps(json.dumps({"x": 1}, separators=(",", ":")))
    text = f'[TOOL_CALLS][{{"name": "f", "arguments": {compact}}}]'
    assert parser_for("mistral").parse(text).tool_calls[0].arguments == '{"x": 1}'
    text = '<|python_tag|>{"name": "f", "parameters": "{\\"x\\":1}"}'
    assert parser_for("llama3_json").parse(text).tool_calls[0].arguments == '{"x": 1}'


def test_missing_or_null_arguments_are_an_empty_object():
    text = '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g", "arguments": null}</tool_call>'
    out = parser_for("hermes").parse(text)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", "{}"), ("g", "{}")]


@pytest.mark.parametrize("text", [
    "Hello! How can I help?", "", "   ", '{"answer": 42}', "[1, 2, 3]", "a; b; c",
    "Use <b>bold</b> and [links](x).", "```json\n{\"name\": \"f\"}\n```",
])
@pytest.mark.parametrize("fmt", FORMATS)
def test_no_calls_leaves_content_unchanged(fmt, text):
    assert parser_for(fmt).parse(text) == ParsedOutput(text, [])


MALFORMED = {
    "hermes": [
        '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {}} trailing\n</tool_call>',
        '<tool_call>\n{"name": "f", "argu',
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "f", "parameters": {',
        '<|python_tag|>{"name": "f"}',
        '{"name": 3, "parameters": {}}',
        '<|python_tag|>print("hi")',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"nom": "g"}]',
        '[TOOL_CALLS]f[ARGS]{"a": ',
        '[TOOL_CALLS] sure thing',
    ],
    "deepseek_v3": [
        f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{{"a": \n```{DS_CALL_END}{DS_CALLS_END}',
        f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n{{"a": 1}}{DS_CALL_END}{DS_CALLS_END}',
        f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}retrieval{DS_SEP}f\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}',
        f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{{"a": 1',
    ],
}


@pytest.mark.parametrize("fmt,block", [(f, b) for f, blocks in MALFORMED.items() for b in blocks])
def test_malformed_block_stays_content(fmt, block):
    parser = parser_for(fmt)
    text = "Before. " + block
    assert parser.parse(text) == ParsedOutput(text, [])


def test_malformed_block_among_good_ones_stays_content():
    bad = '<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>'
    text = render("hermes", [("a", {"x": 1})]) + "\n" + bad + "\n" + render("hermes", [("b", {})])
    out = parser_for("hermes").parse(text)
    assert summary(out) == (bad, [("a", {"x": 1}), ("b", {})])
    bad = f'{DS_CALL_BEGIN}function{DS_SEP}g\n```json\n{{oops}}\n```{DS_CALL_END}'
    good = f'{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{{}}\n```{DS_CALL_END}'
    out = parser_for("deepseek_v3").parse(f"Hi{DS_CALLS_BEGIN}{bad}{good}{DS_CALLS_END}")
    assert summary(out) == ("Hi" + bad, [("f", {})])
    out = parser_for("mistral").parse('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{oops}')
    assert summary(out) == ("[TOOL_CALLS]g[ARGS]{oops}", [("f", {"a": 1})])
    out = parser_for("llama3_json").parse('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {')
    assert summary(out) == ('{"name": "g", "parameters": {', [("f", {})])


def test_unterminated_hermes_call_and_closing_tag_inside_a_string():
    out = parser_for("hermes").parse('<tool_call>\n{"name": "f", "arguments": {"s": "</tool_call>"}}')
    assert summary(out) == (None, [("f", {"s": "</tool_call>"})])
    calls = [("f", {"s": "</tool_call><tool_call>"}), ("g", {"t": "\n```<｜tool▁call▁end｜>"})]
    for fmt in FORMATS:
        assert summary(parser_for(fmt).parse(render(fmt, calls))) == (None, calls)


def test_deep_nesting_does_not_raise():
    deep = "[" * 100_000 + "]" * 100_000
    for fmt, text in [("hermes", f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>'),
                      ("llama3_json", deep), ("mistral", "[TOOL_CALLS]" + deep)]:
        out = parser_for(fmt).parse(text)
        assert out.tool_calls == [] and out.content == text


# --- property tests ---------------------------------------------------------------------------

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,30}", fullmatch=True)
SCALARS = (st.none() | st.booleans() | st.integers(-10**18, 10**18)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
ARGS = st.dictionaries(st.text(max_size=10), VALUES, max_size=5)
CALLS = st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(FORMATS), calls=CALLS, prefix=st.text(max_size=30), variant=st.integers(0, 1),
       seed=st.integers(0, 2**32))
def test_round_trip(fmt, calls, prefix, variant, seed):
    if any(m in prefix for m in MARKERS[fmt]):
        prefix = ""
    out = parser_for(fmt).parse(render(fmt, calls, prefix, variant), random.Random(seed))
    assert summary(out) == (prefix.strip() or None, calls)
    assert [c.arguments for c in out.tool_calls] == [_dumps(a) for _, a in calls]
    id_pattern = r"[A-Za-z0-9]{9}" if fmt == "mistral" else r"call_[A-Za-z0-9]{24}"
    assert all(re.fullmatch(id_pattern, c.id) for c in out.tool_calls)


PIECES = st.sampled_from([
    "<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", DS_CALLS_BEGIN,
    DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP, "function", "\n```json\n", "\n```", '{"name": "f"',
    ', "arguments": {}', ', "parameters": {', "}", "]", "[", "{", ";", '"', " ", "\n", "x",
])


@settings(max_examples=300, deadline=None)
@given(fmt=st.sampled_from(FORMATS), pieces=st.lists(PIECES | st.text(max_size=5), max_size=25))
def test_arbitrary_text_never_raises(fmt, pieces):
    text = "".join(pieces)
    out = parser_for(fmt).parse(text)
    if not out.tool_calls:
        assert out.content == text
    for call in out.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("fmt,text,start", [
    ("hermes", "plain text", None), ("hermes", "see <tool_call>{", 4), ("hermes", "a <tool_c", 2),
    ("hermes", "a < b", None), ("hermes", "a <", 2),
    ("llama3_json", '  {"name"', 2), ("llama3_json", "use {x}", None), ("llama3_json", "x <|python", 2),
    ("mistral", "ok [TOOL", 3), ("mistral", "[TOOL_CALLS][", 0),
    ("deepseek_v3", "hi" + DS_CALLS_BEGIN, 2), ("deepseek_v3", "hi" + DS_CALLS_BEGIN[:3], 2),
])
def test_call_start_finds_markers_and_cut_off_marker_starts(fmt, text, start):
    assert parser_for(fmt).call_start(text) == start


def _streamed(fmt: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """The content and (name, arguments) calls a ToolStream sends for ``text`` grown at ``cuts``."""
    from segkv.server.tool_output import ToolStream

    stream, content, calls = ToolStream(parser_for(fmt)), "", {}
    ends = sorted(set(c for c in cuts if 0 < c < len(text)))
    for end, finished in [*((e, False) for e in ends), (len(text), True)]:
        piece, deltas = stream.feed(text[:end], finished)
        content += piece
        for delta in deltas:
            call = calls.setdefault(delta["index"], ["", ""])
            if "id" in delta:
                assert not call[0] and delta["type"] == "function"  # the name comes once, first
                call[0] = delta["function"]["name"]
            else:
                assert call[0]  # arguments only after the name
            call[1] += delta["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(FORMATS), calls=CALLS, prefix=st.text(max_size=20), variant=st.integers(0, 1),
       cuts=st.lists(st.integers(0, 400), max_size=40))
def test_streaming_sends_what_parsing_finds_and_no_marker_as_content(fmt, calls, prefix, variant, cuts):
    if any(m in prefix for m in MARKERS[fmt]):
        prefix = ""
    text = render(fmt, calls, prefix, variant)
    parsed = parser_for(fmt).parse(text)
    content, streamed = _streamed(fmt, text, cuts)
    assert streamed == [(c.name, c.arguments) for c in parsed.tool_calls]
    assert content.strip() == (parsed.content or "")
    assert not any(m in content for m in MARKERS[fmt])


@settings(max_examples=300, deadline=None)
@given(fmt=st.sampled_from(FORMATS), pieces=st.lists(PIECES | st.text(max_size=5), max_size=25),
       cuts=st.lists(st.integers(0, 200), max_size=30))
def test_streaming_arbitrary_text_matches_parsing(fmt, pieces, cuts):
    text = "".join(pieces)
    parsed = parser_for(fmt).parse(text)
    content, streamed = _streamed(fmt, text, cuts)
    if parsed.tool_calls:
        # a call the text after it later shows to be malformed cannot be taken back once sent
        found = [(c.name, c.arguments) for c in parsed.tool_calls]
        assert found[:len(streamed)] == streamed[:len(found)]
    else:
        assert content == text or streamed
