"""The shortest text that completes a prefix of compact JSON: how JSON mode ends within its budget.

A model that never learned to close a string can write one until ``max_tokens`` runs out and
leave unparseable JSON. With the closing text known at every step, a constrained sequence whose
remaining tokens only just hold that text is made to write it (``GrammarState``): the output is
then a complete JSON value, whatever the model would have written.

:func:`json_closing` reads any whitespace between tokens; it completes an open string (``"``, an
escape first), a number
(a digit after ``-``, ``.``, ``e``), a literal (``tru`` -> ``e``), a key without its value
(``: null``), a member or element after a comma (``"": null``, ``null``) and closes every open
container in order.
"""

from __future__ import annotations

_LITERALS = ("true", "false", "null")
_HEX = "0123456789abcdefABCDEF"


def json_closing(prefix: str, *, spaced: bool = True) -> str:
    """The shortest string ``s`` such that ``prefix + s`` is a complete JSON value, for a
    ``prefix`` of JSON (``"{}"`` for the empty prefix, ``""`` for a complete value).
    ``spaced``: separators are ``": "`` and ``", "`` (xgrammar's JSON grammars), else ``":"`` and
    ``","``. ValueError when ``prefix`` is not the start of a JSON value."""
    colon = ": " if spaced else ":"
    pending_space = False  # after ":" or "," of spaced JSON, before its space
    stack: list[str] = []  # open containers, "{" or "["
    expect = "value"  # what comes next: value, key, colon, comma (or the container's end), end
    first = False  # right after "{" or "[": the container may end at once
    in_string = is_key = False
    escape = -1  # -1: no escape; 0: after "\"; 1..4: hex digits of "\u" still needed
    atom = ""  # a number or literal being written
    for ch in prefix:
        if in_string:
            if escape == 0:
                escape = 4 if ch == "u" else -1
            elif escape > 0:
                escape = escape - 1 if escape > 1 else -1
            elif ch == "\\":
                escape = 0
            elif ch == '"':
                in_string = False
                expect = "colon" if is_key else _after_value(stack)
            continue
        if atom:
            if _continues_atom(atom, ch):
                atom += ch
                continue
            _check_atom(atom)
            atom, expect = "", _after_value(stack)
        if ch in " \t\n\r":
            pending_space = False
            continue
        pending_space = False
        if expect == "value" and (ch in "-0123456789tfn"):
            atom, first = ch, False
        elif expect == "value" and ch == '"':
            in_string, is_key, first = True, False, False
        elif expect == "value" and ch in "{[":
            stack.append(ch)
            expect, first = ("key" if ch == "{" else "value"), True
        elif expect == "key" and ch == '"':
            in_string, is_key, first = True, True, False
        elif expect == "colon" and ch == ":":
            expect, pending_space = "value", spaced
        elif expect == "comma" and ch == ",":
            expect, pending_space = ("key" if stack[-1] == "{" else "value"), spaced
        elif (expect == "comma" or first) and stack and ch == {"{": "}", "[": "]"}[stack[-1]]:
            stack.pop()
            expect, first = _after_value(stack), False
        else:
            raise ValueError(f"not the start of compact JSON at {ch!r}: {prefix[-40:]!r}")
    out = " " if pending_space else ""
    if in_string:
        if escape == 0:
            out += "n"
        elif escape > 0:
            out += "0" * escape
        out += '"'
        expect = "colon" if is_key else _after_value(stack)
    elif atom:
        out += _finish_atom(atom)
        expect = _after_value(stack)
    if expect == "colon":
        out += colon + "null"
    elif expect == "key" and not first:
        out += '""' + colon + "null"
    elif expect == "value" and not first:
        out += "{}" if not stack else "null"
    for container in reversed(stack):
        out += "}" if container == "{" else "]"
    return out


def _after_value(stack: list[str]) -> str:
    return "comma" if stack else "end"


def _continues_atom(atom: str, ch: str) -> bool:
    if atom[0] in "tfn":
        word = next(w for w in _LITERALS if w[0] == atom[0])
        return len(atom) < len(word) and word[len(atom)] == ch
    return ch in "0123456789.eE+-"


def _check_atom(atom: str) -> None:
    if atom[0] in "tfn" and atom not in _LITERALS:
        raise ValueError(f"an incomplete literal {atom!r} followed by more text")


def _finish_atom(atom: str) -> str:
    if atom[0] in "tfn":
        return next(w for w in _LITERALS if w.startswith(atom))[len(atom):]
    return "0" if atom[-1] in "-+.eE" else ""
