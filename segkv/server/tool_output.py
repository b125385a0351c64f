"""Tool calls out of generated text: the text a parser reads, and the streaming extractor that
turns a growing output into content deltas and OpenAI ``delta.tool_calls`` pieces."""

from __future__ import annotations

from segkv.server.tool_parsers import (DeepSeekV3ToolParser, HermesToolParser, Llama3JsonToolParser,
                                       MistralToolParser, ParsedOutput, ToolCall, ToolParser)

ARGUMENT_PIECE = 32  # characters of arguments per streamed fragment
# the text of each format that a tokenizer may hold as special tokens (dropped by a plain decode)
FORMAT_TOKENS = {
    HermesToolParser.name: (HermesToolParser.OPEN, HermesToolParser.CLOSE),
    Llama3JsonToolParser.name: (Llama3JsonToolParser.TAG,),
    MistralToolParser.name: (MistralToolParser.MARK, "[ARGS]", "[CALL_ID]"),
    DeepSeekV3ToolParser.name: (DeepSeekV3ToolParser.CALLS_BEGIN, DeepSeekV3ToolParser.CALLS_END,
                                DeepSeekV3ToolParser.CALL_BEGIN, DeepSeekV3ToolParser.CALL_END,
                                DeepSeekV3ToolParser.SEP),
}


class CallText:
    """The output text a parser reads: the engine's text, except where the format's markers are
    special tokens, which a plain decode drops; then the ids are decoded again keeping those
    markers (and no other special token)."""

    def __init__(self, tokenizer, parser: ToolParser) -> None:
        self.tokenizer = tokenizer
        ids = (tokenizer.token_to_id(t) for t in FORMAT_TOKENS.get(parser.name, ()))
        self.keep = frozenset(i for i in ids if i is not None and i in tokenizer.special_token_ids)
        self.drop = tokenizer.special_token_ids - self.keep

    def __call__(self, text: str, token_ids: list[int]) -> str:
        if not self.keep or self.keep.isdisjoint(token_ids):
            return text
        kept = [t for t in token_ids if t not in self.drop]
        return self.tokenizer.decode(kept, skip_special_tokens=False)


def limit_calls(parsed: ParsedOutput, parallel: bool) -> ParsedOutput:
    """``parsed`` with only its first call when parallel calls are off."""
    if parallel or len(parsed.tool_calls) <= 1:
        return parsed
    return ParsedOutput(parsed.content, parsed.tool_calls[:1])


def call_deltas(index: int, call: ToolCall) -> list[dict]:
    """The ``delta.tool_calls`` entries of one call: index, id, type and name first (arguments
    empty), then the arguments in fragments, as OpenAI streams them."""
    function = {"name": call.name, "arguments": ""}
    first = {"index": index, "id": call.id, "type": "function", "function": function}
    args = call.arguments
    return [first, *({"index": index, "function": {"arguments": args[i:i + ARGUMENT_PIECE]}}
                     for i in range(0, len(args), ARGUMENT_PIECE))]


class ToolStream:
    """Splits one growing output into content and tool calls as it streams.

    Text before a call marker streams as content, except what may be the start of a marker
    (held until it is clearly not one) and trailing whitespace (which the final content does
    not keep when calls follow). A call is sent once the text after it shows it complete
    (another call parsed after it) or the output ends; at the end the whole text is parsed
    again and what was not sent follows: the remaining calls, or, when the call text could
    not be read, the rest as content.
    """

    def __init__(self, parser: ToolParser, *, parallel: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel
        self.sent = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content delta, ``delta.tool_calls`` entries) for the output grown to ``text``."""
        if finished:
            return self._finish(text)
        start = self.parser.call_start(text)
        safe = text if start is None else text[:start]
        safe = safe.rstrip().rstrip("\ufffd")  # a cut multi-byte character waits for its bytes
        content = ""
        if safe.strip() and len(safe) > len(self.sent):
            content, self.sent = safe[len(self.sent):], safe
        deltas: list[dict] = []
        if start is not None:
            found = self.parser.parse(text[start:]).tool_calls
            for call in found[len(self.calls):len(found) - 1]:  # the last may still grow
                deltas += self._send(call)
        return content, deltas

    def _send(self, call: ToolCall) -> list[dict]:
        if self.calls and not self.parallel:
            return []
        self.calls.append(call)
        return call_deltas(len(self.calls) - 1, call)

    def _finish(self, text: str) -> tuple[str, list[dict]]:
        final = self.parser.parse(text)
        deltas: list[dict] = []
        if len(final.tool_calls) > len(self.calls):
            for call in final.tool_calls[len(self.calls):]:
                deltas += self._send(call)
        if not final.tool_calls and self.calls:  # sent calls cannot be taken back
            return "", deltas
        target = text if not final.tool_calls else (final.content or "")
        for sent in (self.sent, self.sent.lstrip()):
            if target.startswith(sent):
                return target[len(sent):], deltas
        return "", deltas
