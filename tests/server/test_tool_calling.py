"""Tool calling over HTTP with the openai client, through the real engine, on tiny models whose
tokenizers carry the tool parts of the chat templates of Qwen3 (hermes), Llama 3.1
(llama3_json), Mistral (mistral) and DeepSeek V3 (deepseek_v3).

The random models emit calls because the output is constrained: ``tool_choice`` "required"
or a named function, or ``structured_outputs`` choosing the exact call text (``tool_choice``
"auto", so the parser reads free text).
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch

from model_helpers import COMMON, build_deepseek_dir, gqa_families
from server_helpers import live_server
from tokenizer_helpers import build_tiny_tokenizer, tiny_vocab_size
from segkv.engine import LLM, AsyncEngine
from segkv.server.app import create_app
from segkv.server.tool_output import CallText, ToolStream
from segkv.server.tool_parsers import DeepSeekV3ToolParser, parser_for

MODEL = "tiny"

# -- the templates' tool parts, as the models' own chat templates write them -----------------------
QWEN3_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA31_TEMPLATE = """
{{- bos_token }}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

MISTRAL_TEMPLATE = """
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}{{- '"' + key + '": "' + val + '"' }}
                    {%- else %}{{- '"' + key + '": ' + val|tojson }}{%- endif %}
                    {%- if not loop.last %}{{- ", " }}{%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# DeepSeek V3's template renders calls and results (its tools are described by the client's
# system message, not by the template)
DEEPSEEK_V3_TEMPLATE = """
{%- if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}
{%- set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}
{%- for message in messages %}{%- if message['role'] == 'system' %}
    {%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}
    {%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}
{%- endif %}{%- endfor %}
{{- bos_token }}{{- ns.system_prompt }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{- '<｜User｜>' + message['content'] }}{%- endif %}
    {%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}
        {%- for tool in message['tool_calls'] %}
            {%- if not ns.is_first %}
                {%- if message['content'] is none %}
                    {{- '<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>' }}
                {%- else %}
                    {{- '<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>' }}
                {%- endif %}
                {%- set ns.is_first = true -%}
            {%- else %}
                {{- '\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>' }}
            {%- endif %}
        {%- endfor %}
        {{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
    {%- endif %}
    {%- if message['role'] == 'assistant' and 'tool_calls' not in message %}
        {%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{%- set ns.is_tool = false -%}
        {%- else %}{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{%- endif %}
    {%- endif %}
    {%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}
        {%- if ns.is_output_first %}{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}{%- set ns.is_output_first = false %}
        {%- else %}{{- '\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}{%- endif %}
    {%- endif %}
{%- endfor -%}
{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}
{%- if add_generation_prompt and not ns.is_tool %}{{- '<｜Assistant｜>' }}{%- endif %}
"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]},
                                          "hours": {"type": "integer", "minimum": 0, "maximum": 23}},
         "required": ["zone", "hours"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGS = {"city": "Paris", "unit": "c"}
RESULT = '{"temp_c": 21}'


def free_call_text(family: str) -> str:
    """'Sure. ' then a get_weather call as the family's model writes it."""
    args = json.dumps(ARGS)
    if family == "hermes":
        return f'Sure. <tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    if family == "llama3_json":
        return f'Sure. <|python_tag|>{{"name": "get_weather", "parameters": {args}}}'
    if family == "mistral":
        return f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {args}}}]'
    p = DeepSeekV3ToolParser
    return (f"Sure. {p.CALLS_BEGIN}{p.CALL_BEGIN}function{p.SEP}get_weather\n```json\n{args}\n```"
            f"{p.CALL_END}{p.CALLS_END}")


def build(directory, family: str) -> None:
    """A tiny random model of the family with its chat template; Mistral's ``[TOOL_CALLS]`` is a
    special token, as in Mistral's tokenizers (a plain decode drops it)."""
    if family == "deepseek_v3":
        build_tiny_tokenizer(directory, style="chatml", chat_template=DEEPSEEK_V3_TEMPLATE)
        vocab = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
        ids = {t["content"]: t["id"] for t in vocab}
        # the config's end-of-sequence id must be the tokenizer's (transformers' default, 1, is '"' here)
        build_deepseek_dir(directory, max_position_embeddings=2048, bos_token_id=ids["<|bos|>"],
                           eos_token_id=ids["<|im_end|>"])
        build_tiny_tokenizer(directory, style="chatml", chat_template=DEEPSEEK_V3_TEMPLATE)
        return
    hf_family, style, template, extra = {
        "hermes": ("qwen3", "chatml", QWEN3_TEMPLATE, {}),
        "llama3_json": ("llama3.1", "llama3", LLAMA31_TEMPLATE, {}),
        "mistral": ("mistral", "llama3", MISTRAL_TEMPLATE,
                    {"eos_token": "<|eos|>", "additional_special_tokens": ["[TOOL_CALLS]"]}),
    }[family]
    build_tiny_tokenizer(directory, style=style, chat_template=template, tokenizer_config=extra)
    config_cls, model_cls, hf_extra = gqa_families()[hf_family]
    vocab = tiny_vocab_size(directory) + len(extra.get("additional_special_tokens", ()))
    config = config_cls(vocab_size=vocab, **{**COMMON, **hf_extra, "max_position_embeddings": 2048})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(directory)


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "mistral", "deepseek_v3"])
def served(request, tmp_path_factory):
    family = request.param
    directory = tmp_path_factory.mktemp(f"tools-{family}")
    build(directory, family)
    llm = LLM(directory, page_size=8, num_pages=800)
    engine = AsyncEngine(llm)
    with live_server(create_app(engine, model_name=MODEL)) as base:  # the parser comes from the model
        yield family, llm, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    engine.shutdown()


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def check_ids(family: str, message) -> None:
    pattern = r"[A-Za-z0-9]{9}" if family == "mistral" else r"call_[A-Za-z0-9]{24}"
    assert all(re.fullmatch(pattern, c.id) and c.type == "function" for c in message.tool_calls)


def streamed(client, **request):
    """The SDK's own assembly of a streamed chat (its stream helper), and the content deltas."""
    with client.chat.completions.stream(model=MODEL, **request) as stream:
        contents = [event.delta for event in stream if event.type == "content.delta"]
        return stream.get_final_completion(), contents


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_parses_with_the_sdk_streamed_and_not(served, choice):
    family, _, client = served
    request = dict(messages=USER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=200)
    out = client.chat.completions.create(model=MODEL, **request)
    message = out.choices[0].message
    (name, args), = calls_of(message)  # one call under constraint
    if isinstance(choice, dict):
        assert name == "get_time"
    jsonschema.validate(args, SCHEMAS[name])
    check_ids(family, message)
    assert message.content is None and out.choices[0].finish_reason == "tool_calls"

    final, contents = streamed(client, **request)
    assert calls_of(final.choices[0].message) == [(name, args)]
    check_ids(family, final.choices[0].message)
    assert final.choices[0].finish_reason == "tool_calls" and not "".join(contents)


def test_free_text_calls_are_parsed_and_no_marker_streams_as_content(served):
    family, _, client = served
    text = free_call_text(family)
    request = dict(messages=USER, tools=TOOLS, temperature=0, max_tokens=300,
                   extra_body={"structured_outputs": {"choice": [text]}})
    out = client.chat.completions.create(model=MODEL, **request)
    message = out.choices[0].message
    assert calls_of(message) == [("get_weather", ARGS)] and message.content == "Sure."
    assert out.choices[0].finish_reason == "tool_calls"
    final, contents = streamed(client, **request)
    assert calls_of(final.choices[0].message) == [("get_weather", ARGS)]
    assert "".join(contents) == "Sure." and final.choices[0].message.content == "Sure."

    # tool_choice "none": no parsing, the call text is content
    plain = client.chat.completions.create(model=MODEL, **{**request, "tool_choice": "none"})
    assert plain.choices[0].message.tool_calls is None
    assert "get_weather" in plain.choices[0].message.content


FORMATS = {  # the tool result (and the call before it) as each template writes them
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": @ARGS@}\n</tool_call><|im_end|>',
               "<|im_start|>user\n<tool_response>\n@RESULT@\n</tool_response><|im_end|>\n<|im_start|>assistant\n"],
    "llama3_json": ['{"name": "get_weather", "parameters": "@ARGS_Q@"}<|eot_id|>',
                    '<|start_header_id|>ipython<|end_header_id|>\n\n"@RESULT_Q@"<|eot_id|>'],
    # the SDK's model_dump puts a function's arguments before its name; the template keeps the order
    "mistral": ['[TOOL_CALLS] [{"arguments": "@ARGS_Q@", "name": "get_weather", "id": "@ID@"}]<|eos|>',
                '[TOOL_RESULTS] {"content": @RESULT@, "call_id": "@ID@"}[/TOOL_RESULTS]'],
    "deepseek_v3": ["<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    "```json\n@ARGS@\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
                    "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>@RESULT@<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"],
}


def test_a_follow_up_with_the_tool_result_continues_the_conversation(served):
    family, llm, client = served
    weather = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=200,
                                           tool_choice=weather)
    call = first.choices[0].message.tool_calls[0]
    arguments = call.function.arguments  # as the SDK gives it: a JSON string, sent back unchanged
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0,
                                         max_tokens=4, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    # the prompt the server rendered: the template's call and result formats
    as_sent = [*USER, {**history[1], "content": ""}, history[2]]  # null content is templated as ""
    rendered = llm.tokenizer.apply_chat_template(as_sent, tools=TOOLS)
    assert out.usage.prompt_tokens == len(llm.tokenizer.encode(rendered, add_special_tokens=False))
    for piece in FORMATS[family]:
        piece = (piece.replace("@ARGS_Q@", json.dumps(arguments)[1:-1]).replace("@ARGS@", arguments)
                 .replace("@RESULT_Q@", json.dumps(RESULT)[1:-1]).replace("@RESULT@", RESULT)
                 .replace("@ID@", call.id))
        assert piece in rendered, (piece, rendered)


# -- the pieces, on text ---------------------------------------------------------------------------
def test_a_call_the_parser_cannot_read_stays_content_streamed_and_not():
    parser = parser_for("hermes")
    text = 'ok <tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call> done'
    assert parser.parse(text).tool_calls == [] and parser.parse(text).content == text
    stream, content = ToolStream(parser), ""
    for end in range(1, len(text)):
        piece, calls = stream.feed(text[:end], False)
        assert not calls and "<tool" not in piece
        content += piece
    piece, calls = stream.feed(text, True)
    assert content + piece == text and not calls


def test_only_the_first_call_is_kept_without_parallel_calls():
    text = "\n".join(f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>' for name in "ab")
    stream = ToolStream(parser_for("hermes"), parallel=False)
    deltas = [d for end in range(1, len(text) + 1) for d in stream.feed(text[:end], end == len(text))[1]]
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["a"]


def test_special_token_markers_are_read_back(tmp_path):
    build_tiny_tokenizer(tmp_path, style="llama3",
                         tokenizer_config={"additional_special_tokens": ["[TOOL_CALLS]"]})
    from segkv.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tmp_path)
    call = '[TOOL_CALLS] [{"name": "f", "arguments": {}}]'
    ids = tokenizer.encode(call + "<|eot_id|>", add_special_tokens=False)
    text = tokenizer.decode(ids)  # the engine's text: special tokens dropped
    assert "[TOOL_CALLS]" not in text
    read = CallText(tokenizer, parser_for("mistral"))(text, ids)
    assert read == call  # the marker back, the end-of-sequence token still dropped
    assert parser_for("mistral").parse(read).tool_calls[0].name == "f"


def test_the_cli_offers_every_parser():
    from segkv.cli import TOOL_CALL_PARSERS
    from segkv.server.tool_parsers import PARSERS

    assert TOOL_CALL_PARSERS == sorted(PARSERS)


def test_an_unknown_parser_is_refused_when_the_app_is_made():
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen'"):
        create_app(None, model_name=MODEL, tool_call_parser="qwen")
