"""Tokenizer parity with transformers, chat templates, and streaming detokenization with stops."""

from __future__ import annotations

import json
import random

import jinja2
import pytest
import torch
from tokenizer_helpers import CHATML_TEMPLATE, LLAMA3_TEMPLATE, build_tiny_tokenizer, tiny_vocab_size

from segkv.tokenizer.detokenizer import IncrementalDetokenizer, StopChecker
from segkv.tokenizer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

STYLES = ("chatml", "llama3")
TEXTS = [
    "",
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\treturn x + 1  # café\n",
    "   leading and trailing spaces   ",
    "\n\n\tmixed\r\nwhitespace\u00a0nbsp",
    "naïve résumé über 日本語のテキスト 中文",
    "emoji 🙂🚀👍🏽 and 👨‍👩‍👧 family",
    "special <|im_end|> and <|bos|> inside text",
    "\ufffd a literal replacement char",
]
CHAT = [
    {"role": "system", "content": "You are terse. 🙂"},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "  And in 日本語?  "},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """style -> (segkv Tokenizer, transformers tokenizer, directory)."""
    out = {}
    for style in STYLES:
        directory = tmp_path_factory.mktemp(style)
        build_tiny_tokenizer(directory, style=style)
        hf = transformers.AutoTokenizer.from_pretrained(directory)
        out[style] = (Tokenizer.from_dir(directory), hf, directory)
    return out


def _rng(gen: torch.Generator) -> random.Random:
    return random.Random(int(torch.randint(2**31, (1,), generator=gen)))


# ----------------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizers, style, text):
    tok, hf, _ = tokenizers[style]
    for add in (True, False):
        ids = tok.encode(text, add_special_tokens=add)
        assert ids == hf.encode(text, add_special_tokens=add)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    if "<|" not in text:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("style", STYLES)
def test_properties_match_transformers(tokenizers, style):
    tok, hf, directory = tokenizers[style]
    assert tok.vocab_size == len(hf) == tiny_vocab_size(directory)
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.eos_token_ids == (hf.eos_token_id,)
    assert tok.pad_token_id == hf.pad_token_id is not None
    assert tok.model_max_length == hf.model_max_length == 2048
    assert tok.add_bos_token == (style == "llama3") == (hf.encode("x")[0] == hf.bos_token_id)
    assert set(hf.all_special_ids) <= tok.special_token_ids


def test_random_ids_decode_like_transformers(tokenizers, gen):
    rng = _rng(gen)
    for tok, hf, _ in tokenizers.values():
        for _ in range(50):
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


# ----------------------------------------------------------------------------- chat templates


def _hf_chat(hf, messages, **kwargs):
    text = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return text, ids


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("with_system", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizers, style, with_system, add_generation_prompt):
    tok, hf, _ = tokenizers[style]
    messages = CHAT if with_system else CHAT[1:]
    text, ids = _hf_chat(hf, messages, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == text
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == ids
    if style == "llama3":  # the template writes BOS; encoding the chat must not add a second one
        assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids.count(tok.bos_token_id) <= 1


def test_chat_tools_and_named_templates(tmp_path):
    tool = {"type": "function", "function": {"name": "météo", "parameters": {"city": "東京", "n": 3}}}
    named = [
        {"name": "default", "template": LLAMA3_TEMPLATE},
        {"name": "tool_use", "template": CHATML_TEMPLATE},
    ]
    build_tiny_tokenizer(tmp_path, style="chatml", chat_template=named)
    tok, hf = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for tools in (None, [tool]):
        text, ids = _hf_chat(hf, CHAT, tools=tools, add_generation_prompt=True)
        assert tok.apply_chat_template(CHAT, tools=tools) == text
        assert tok.encode_chat(CHAT, tools=tools) == ids
    assert '"東京"' in tok.apply_chat_template(CHAT, tools=[tool])  # tojson keeps non-ASCII
    with pytest.raises(ValueError, match="tools"):
        tok.apply_chat_template(CHAT, tools=["not a schema"])


FEATURES_TEMPLATE = """{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
{%- if m.role == 'stop' %}{% break %}{% endif -%}
{%- set ns.count = ns.count + 1 -%}
{%- set c = m.content if m.content is string else (m.content | tojson(indent=2) if m.content is defined) -%}
<|{{ m.role }}|>{{ c }}
{%- if m.tool_calls is defined %} calls={{ m.tool_calls | tojson }}{% endif %}
{%- if m.reasoning_content is defined %} think={{ m.reasoning_content }}{% endif %}
{% generation %}[{{ loop.index }}]{% endgeneration %}
{%- endfor -%}
n={{ ns.count }} eos={{ eos_token }} pad={{ pad_token }} flag={{ enable_thinking | default('unset') }}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_template_features_match_transformers(tmp_path):
    (tmp_path / "m").mkdir()
    build_tiny_tokenizer(tmp_path / "m", style="chatml", chat_template=FEATURES_TEMPLATE)
    tok, hf = Tokenizer.from_dir(tmp_path / "m"), transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "ünïcode <b>"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"x": 1}}]},
        {"role": "assistant", "content": "ok", "reasoning": "because"},
        {"role": "stop", "content": "ignored"},
        {"role": "user", "content": "never"},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert tok.apply_chat_template(messages, template_kwargs=kwargs) == expected


def test_chat_template_file_wins_over_config(tmp_path):
    build_tiny_tokenizer(tmp_path, style="llama3")
    (tmp_path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    tok, hf = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    expected = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CHAT) == expected
    assert tok.apply_chat_template(CHAT).startswith("<|im_start|>system")


def test_raise_exception_and_sandbox(tokenizers, tmp_path):
    tok, hf, _ = tokenizers["llama3"]
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(ValueError, match="roles must be user or assistant"):
        tok.apply_chat_template(bad)
    with pytest.raises(jinja2.TemplateError):  # transformers raises its TemplateError for the same input
        hf.apply_chat_template(bad, tokenize=False)
    build_tiny_tokenizer(tmp_path, chat_template="{{ messages.append(1) }}{{ ''.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CHAT)


# ----------------------------------------------------------------------------- loading and errors


def test_eos_ids_and_config_variants(tmp_path):
    bos = {"content": "<|bos|>", "special": True, "__type": "AddedToken"}
    config = {"bos_token": bos, "model_max_length": 1e30}
    build_tiny_tokenizer(tmp_path, style="llama3", tokenizer_config=config)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [409, 410, 407]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 408}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token_id == transformers.AutoTokenizer.from_pretrained(tmp_path).bos_token_id
    assert tok.eos_token_ids == (410, 409, 407, 408)
    assert tok.model_max_length is None


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "missing")
    build_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"no": "content"}}))
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_dir(tmp_path)


def test_chat_errors(tokenizers, tmp_path):
    build_tiny_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CHAT)
    tok = tokenizers["chatml"][0]
    bad_chats = ([], "hi", {"role": "user"}, [{"role": "user"}], [{"content": "x"}], ["x"])
    bad_chats += ([{"role": 1, "content": ""}], [{"role": "user", "content": object()}])
    for bad in bad_chats:
        with pytest.raises(ValueError, match="role|content|messages"):
            tok.encode_chat(bad)
    with pytest.raises(ValueError, match="str"):
        tok.encode(b"bytes")


# ----------------------------------------------------------------------------- detokenizer


def _stream(tok, ids, rng, **kwargs):
    """Feed ``ids`` in chunks of 1-3; return (deltas, detokenizer)."""
    det = IncrementalDetokenizer(tok, **kwargs)
    deltas, i = [], 0
    while i < len(ids):
        step = rng.randrange(1, 4)
        deltas.append(det.add(ids[i : i + step] if step > 1 else ids[i]))
        i += step
    deltas.append(det.finish())
    return deltas, det


@pytest.mark.parametrize("style", STYLES)
def test_stream_of_valid_text_never_emits_replacement(tokenizers, style, gen):
    tok, rng = tokenizers[style][0], _rng(gen)
    split_chars = 0
    for text in TEXTS + ["日本語 🙂 中文分词测试 👍🏽 " * 3]:
        ids = tok.encode(text, add_special_tokens=False)
        split_chars += sum(tok.decode([i]).endswith("\ufffd") for i in ids)
        deltas, det = _stream(tok, ids, rng, skip_special_tokens=False)
        assert "".join(deltas) == det.output_text == text
        assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text
    assert split_chars > 10  # the test really streams characters cut between tokens


@pytest.mark.parametrize("skip", [True, False])
def test_stream_of_random_ids_equals_decode(tokenizers, gen, skip):
    rng = _rng(gen)
    for tok, _, _ in tokenizers.values():
        cjk = tok.encode("日本語 🙂 中文 🚀", add_special_tokens=False)
        for _ in range(200):
            n = rng.randrange(41)
            ids = [rng.choice(cjk) if rng.random() < 0.3 else rng.randrange(tok.vocab_size) for _ in range(n)]
            deltas, det = _stream(tok, ids, rng, skip_special_tokens=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
            assert det.token_ids == ids and not det.stopped


def _check_stop_stream(tok, ids, stop, rng):
    full = tok.decode(ids)
    # Text is cut before the stop string that ends first (at a tie, the longer one): exactly what
    # checking character by character gives, whatever the chunking of the stream.
    hits = sorted((full.find(s) + len(s), full.find(s)) for s in stop if s in full)
    expected = full[: hits[0][1]] if hits else full
    deltas, det = _stream(tok, ids, rng, stop=stop)
    emitted = ""
    for delta in deltas:  # nothing is ever emitted that the final answer retracts
        emitted += delta
        assert expected.startswith(emitted)
    assert emitted == det.output_text == expected
    assert det.stopped == bool(hits)
    return det


def test_stop_string_split_across_tokens(tokenizers, gen):
    tok, rng = tokenizers["chatml"][0], _rng(gen)
    text = "The answer is 42. ###END### trailing text"
    ids = tok.encode(text, add_special_tokens=False)
    assert all("###END###" not in tok.decode([i]) for i in ids)  # the stop spans several tokens
    det = _check_stop_stream(tok, ids, ["###END###"], rng)
    assert det.output_text == "The answer is 42. " and det.stop_string == "###END###"
    det = IncrementalDetokenizer(tok, stop=["###END###"])
    assert det.add(ids) == "The answer is 42. " and det.add(ids[:3]) == "" and det.finish() == ""
    ids = tok.encode("say 🙂 then 🚀 go")
    det = _check_stop_stream(tok, ids, ["🚀", "then 🚀 g", "🙂 thx"], rng)
    assert det.output_text == "say 🙂 then " and det.stop_string == "🚀"  # "🚀" ends first
    det = _check_stop_stream(tok, tok.encode("a STOP b"), ["STOP", "a STOP"], rng)
    assert det.output_text == "" and det.stop_string == "a STOP"  # same end: the longer one
    det = _check_stop_stream(tok, tok.encode("ends with a partial ###EN"), ["###END###"], rng)
    assert det.output_text.endswith("###EN") and not det.stopped  # released by finish()


def test_random_stop_strings(tokenizers, gen):
    rng = _rng(gen)
    for tok, _, _ in tokenizers.values():
        for _ in range(150):
            text = " ".join(rng.choice(TEXTS[1:8]) for _ in range(3))
            ids = tok.encode(text, add_special_tokens=False)
            full = tok.decode(ids)
            stops = []
            for _ in range(rng.randrange(1, 4)):
                start = rng.randrange(len(full))
                never = "" if rng.random() < 0.7 else "\x00"  # a stop string that may never appear
                stops.append(full[start : start + rng.randrange(1, 8)] + never)
            _check_stop_stream(tok, ids, stops, rng)


def test_stop_checker_units():
    checker = StopChecker(["abc", "bcd"])
    assert checker.feed("xab") == "x" and checker.held == "ab"
    assert checker.feed("cd") == "" and checker.stop_string == "abc" and checker.stopped
    assert checker.feed("more") == "" and checker.flush() == ""
    checker = StopChecker("STOP")
    assert [checker.feed(c) for c in "aSTb"] == ["a", "", "", "STb"]
    assert checker.feed("ST") == "" and checker.flush() == "ST"
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(["ok", ""])


def test_detokenizer_prompt_context_and_finish(tokenizers):
    tok = tokenizers["llama3"][0]
    prompt, gen_ids = tok.encode("Tell me: "), tok.encode("naïve 🙂 done", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(det.add(i) for i in gen_ids) + det.finish()
    assert text == tok.decode(prompt + gen_ids)[len(tok.decode(prompt)) :] == "naïve 🙂 done"
    assert det.token_ids == gen_ids and det.finish() == ""
    with pytest.raises(ValueError, match="finish"):
        det.add(gen_ids[0])


# Tool-call history as the Qwen3 and DeepSeek V3 templates render it: calls with arguments as a
# string (as OpenAI clients send them) or a mapping, null content, and tool results
TOOL_HISTORY_TEMPLATE = """
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' + (message.content if message.content is string else '') }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '[none]' if message['content'] is none else '[text]' }}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response>[' + message.tool_call_id + ']<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if tools %}{{- tools | map(attribute='function') | map(attribute='name') | join(',') }}{%- endif %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@pytest.mark.parametrize("content", ["", "Let me look.", None])
@pytest.mark.parametrize("arguments", ['{"city": "Zürich"}', {"city": "Zürich", "n": [1, 2]}])
def test_tool_call_history_renders_as_transformers(tmp_path, content, arguments):
    build_tiny_tokenizer(tmp_path, style="chatml", chat_template=TOOL_HISTORY_TEMPLATE)
    tok, hf = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": content, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text, ids = _hf_chat(hf, messages, tools=tools, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tools=tools) == text
    assert tok.encode_chat(messages, tools=tools) == ids
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>[call_1]" in text
