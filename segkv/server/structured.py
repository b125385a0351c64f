"""Request fields to an output constraint: ``response_format`` (and vLLM's ``guided_*`` and
``structured_outputs`` extras) to a StructuredOutput."""

from __future__ import annotations

from typing import Any

from segkv.sampling_params import StructuredOutput
from segkv.server.protocol import FieldError

# vLLM's request extras: field -> the StructuredOutput argument it gives
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _make(param: str, **kwargs):
    try:
        return StructuredOutput(**kwargs)
    except (ValueError, TypeError) as exc:
        raise FieldError(f"`{param}`: {exc}", param) from exc


def _kind(param: str, kind: str, value: object):
    if kind == "json_schema":
        if value is True or value == {}:
            return _make(param, json_object=True)
        if not isinstance(value, dict):
            raise FieldError(f"`{param}` must be a JSON schema object", param)
        return _make(param, json_schema=value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise FieldError(f"`{param}` must be a non-empty list of strings", param)
        return _make(param, choice=tuple(value))
    if not isinstance(value, str) or not value:
        raise FieldError(f"`{param}` must be a non-empty string", param)
    return _make(param, **{kind: value})


def _response_format(value: object):
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _make(param, json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise FieldError("`response_format` json_schema needs a `json_schema` object "
                             "({\"name\": ..., \"schema\": {...}})", param)
        schema = spec.get("schema", {})
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise FieldError("`response_format.json_schema.strict` must be a boolean", param)
        if not isinstance(schema, dict):
            raise FieldError("`response_format.json_schema.schema` must be a JSON schema object", param)
        return _make(param, json_object=True) if not schema else _make(param, json_schema=schema)
    raise FieldError("`response_format` must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                     "{\"type\": \"json_schema\", \"json_schema\": {...}}", param)


def structured_output(extra: dict[str, Any]):
    """The StructuredOutput a request asks for through ``response_format``, ``guided_*`` or
    ``structured_outputs``, or None (FieldError naming the field; at most one may ask)."""
    found = []
    if extra.get("response_format") is not None:
        constraint = _response_format(extra["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    for name, kind in GUIDED_FIELDS.items():
        if extra.get(name) is not None:
            found.append((name, _kind(name, kind, extra[name])))
    if extra.get("structured_outputs") is not None:
        spec = extra["structured_outputs"]
        given = [k for k in STRUCTURED_KEYS if isinstance(spec, dict) and spec.get(k) is not None]
        if len(given) != 1:
            raise FieldError("`structured_outputs` must have exactly one of "
                             f"{', '.join(STRUCTURED_KEYS)}", "structured_outputs")
        found.append(("structured_outputs",
                      _kind("structured_outputs", STRUCTURED_KEYS[given[0]], spec[given[0]])))
    if len(found) > 1:
        names = " and ".join(f"`{name}`" for name, _ in found)
        raise FieldError(f"{names} each constrain the output; give one", found[1][0])
    return found[0][1] if found else None
