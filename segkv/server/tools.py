"""Tool calling on the request side: checked ``tools`` and ``tool_choice``, chat history with
tool calls and results for the template, and the constraint that forces a call.

A forced call (``tool_choice`` "required" or a named function) is one call in the parser's
own format: the wrapper text goes in the constraint's ``prefix``/``suffix`` and the call's
JSON (name and arguments, or the arguments alone where the format writes the name outside
the JSON) in its ``json_schema``. Several calls under constraint are not offered.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from segkv.sampling_params import StructuredOutput
from segkv.server.protocol import FieldError
from segkv.server.tool_parsers import DeepSeekV3ToolParser

TOOL_CHOICES = ("none", "auto", "required")



@dataclass(slots=True, frozen=True)
class ToolSettings:
    """The checked tool fields of one chat request: the tools as the template sees them, the
    choice ("none", "auto", "required" or a function name) and the names a call may use."""

    tools: list[dict] | None
    choice: str
    named: str | None
    parallel: bool

    @property
    def forced(self) -> bool:
        """True when the output must be a call (required or a named function)."""
        return self.choice == "required" or self.named is not None

    def allowed(self) -> list[dict]:
        """The function definitions a forced call may use."""
        functions = [t["function"] for t in self.tools or ()]
        return [f for f in functions if self.named is None or f["name"] == self.named]


NO_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without parameters


def _parameters(function: dict) -> dict:
    """The function's parameters schema (an object without properties when not given)."""
    parameters = function.get("parameters")
    return NO_PARAMETERS if parameters is None else parameters


def _function(tool: object, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise FieldError(f"{where} must be an object with type \"function\"", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise FieldError(f"{where}.function must be an object", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise FieldError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-'",
                         "tools")
    if "description" in function and not isinstance(function["description"], (str, type(None))):
        raise FieldError(f"{where}.function.description must be a string", "tools")
    parameters = _parameters(function)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise FieldError(f"{where}.function.parameters must be a JSON schema of an object "
                         "({\"type\": \"object\", ...})", "tools")
    return tool  # the template sees the tool as the client sent it


def tool_settings(extra: dict[str, Any]) -> ToolSettings:
    """The ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request's extra
    fields, checked (FieldError naming the field)."""
    tools = extra.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise FieldError("`tools` must be a list of function tools", "tools")
    tools = [_function(t, i) for i, t in enumerate(tools or [])] or None
    names = [t["function"]["name"] for t in tools or ()]
    if len(set(names)) != len(names):
        raise FieldError("`tools` must not name a function twice", "tools")
    parallel = extra.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise FieldError("`parallel_tool_calls` must be a boolean", "parallel_tool_calls")
    choice = extra.get("tool_choice")
    named = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise FieldError("`tool_choice` must be \"none\", \"auto\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if name not in names:
            raise FieldError(f"`tool_choice` names the function {name[:100]!r}, which is not in `tools`",
                             "tool_choice")
        choice, named = "function", name
    elif choice not in TOOL_CHOICES:
        raise FieldError("`tool_choice` must be \"none\", \"auto\", \"required\" or a named function",
                         "tool_choice")
    if choice == "required" and not tools:
        raise FieldError("`tool_choice` \"required\" needs `tools`", "tool_choice")
    return ToolSettings(tools=tools, choice=choice, named=named, parallel=parallel is not False)


def template_message(message: dict[str, Any], i: int) -> dict[str, Any]:
    """Check a history message's tool parts (``tool_calls`` of an assistant, ``tool_call_id`` of
    a tool result); the message is passed to the template as the client sent it, arguments
    strings included, as transformers does (FieldError naming ``messages``)."""
    where = f"messages[{i}]"
    calls = message.get("tool_calls")
    if calls is not None:
        if message["role"] != "assistant":
            raise FieldError(f"{where}: only assistant messages carry `tool_calls`", "messages")
        if not isinstance(calls, list):
            raise FieldError(f"{where}.tool_calls must be a list", "messages")
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                    or not isinstance(function.get("arguments", ""), (str, dict))
                    or not isinstance(call.get("id", ""), str)):
                raise FieldError(f"{where}.tool_calls[{j}] must be {{\"id\": ..., \"type\": \"function\", "
                                 "\"function\": {\"name\": ..., \"arguments\": ...}}", "messages")
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise FieldError(f"{where}: a tool message needs a `tool_call_id` string", "messages")
    return message


def check_parameter_schemas(settings: ToolSettings) -> None:
    """FieldError naming ``tools`` for a tool whose parameters are not a schema the
    constrained decoder can compile."""
    for i, tool in enumerate(settings.tools or ()):
        try:
            StructuredOutput(json_schema=_parameters(tool["function"]))
        except (ValueError, TypeError) as exc:
            raise FieldError(f"tools[{i}].function.parameters is not a valid JSON schema: {exc}",
                             "tools") from exc


# -- forced calls ------------------------------------------------------------------------------
def _anyof(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _call_schema(function: dict, key: str) -> dict:
    properties = {"name": {"const": function["name"]}, key: _parameters(function)}
    return {"type": "object", "properties": properties, "required": ["name", key]}


def call_constraint(parser: str, settings: ToolSettings):
    """The StructuredOutput that makes the output exactly one call of an allowed function in
    ``parser``'s format (ValueError from StructuredOutput for an invalid parameter schema)."""
    functions = settings.allowed()
    if parser == "hermes":
        schema = _anyof([_call_schema(f, "arguments") for f in functions])
        return StructuredOutput(json_schema=schema, prefix="<tool_call>\n", suffix="\n</tool_call>")
    if parser == "llama3_json":
        return StructuredOutput(json_schema=_anyof([_call_schema(f, "parameters") for f in functions]))
    if parser == "mistral":
        schema = _anyof([_call_schema(f, "arguments") for f in functions])
        return StructuredOutput(json_schema=schema, prefix="[TOOL_CALLS] [", suffix="]")
    if parser == "deepseek_v3":
        p = DeepSeekV3ToolParser
        head = f"{p.CALLS_BEGIN}{p.CALL_BEGIN}function{p.SEP}"
        tail = f"\n```{p.CALL_END}{p.CALLS_END}"
        if len(functions) == 1:  # the name is outside the JSON: it goes in the prefix
            return StructuredOutput(json_schema=_parameters(functions[0]),
                                    prefix=f"{head}{functions[0]['name']}\n```json\n", suffix=tail)
        return StructuredOutput(grammar=_deepseek_grammar(functions, head, tail))
    raise ValueError(f"no forced-call format for the tool-call parser {parser!r}")


_EBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z_][A-Za-z0-9_]*|.', re.S)


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _renamed(ebnf: str, prefix: str) -> str:
    """``ebnf`` with every rule name given ``prefix`` (string literals and classes untouched)."""
    names = set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*::=", ebnf, re.M))
    return "".join(prefix + t if t in names else t for t in _EBNF_TOKEN.findall(ebnf))


def _deepseek_grammar(functions: list[dict], head: str, tail: str) -> str:
    """An xgrammar EBNF for one DeepSeek V3 call of any of ``functions``: the name is written
    outside the JSON, so each function is an alternative of its own (name, then its arguments)."""
    import xgrammar

    rules, alternatives = [], []
    for i, function in enumerate(functions):
        try:
            schema = json.dumps(_parameters(function))
            args = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
        except Exception as exc:  # noqa: BLE001 - xgrammar's errors name the schema's problem
            raise ValueError(f"tools[{i}].function.parameters is not a usable JSON schema: {exc}") from exc
        rules.append(_renamed(str(args), f"t{i}_"))
        alternatives.append(f"({_ebnf_literal(function['name'] + chr(10) + '```json' + chr(10))} t{i}_root)")
    root = f"root ::= {_ebnf_literal(head)} ({' | '.join(alternatives)}) {_ebnf_literal(tail)}"
    return "\n".join([root, *rules])
