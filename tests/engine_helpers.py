"""Driving an engine core by hand in tests."""

from __future__ import annotations


def run_all(core, max_steps: int = 10_000) -> None:
    """Step ``core`` (an ``EngineCore``) until no request is unfinished; fail after ``max_steps``."""
    for _ in range(max_steps):
        if not core.has_unfinished():
            return
        core.step()
    raise AssertionError("requests did not finish")


def conversation_tokens(llm, prompts: list[list[int]], params, turns: tuple[str, str, str]) -> list[list[int]]:
    """Greedy tokens of ``prompts`` generated together, then of a conversation's first two
    ``turns`` and a fork's own third: what a change of route, chunk or backend must leave alone."""
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    conv = llm.conversation()
    out.append(conv.say(turns[0], params).output.token_ids)
    out.append(conv.say(turns[1], params).output.token_ids)
    out.append(conv.fork().say(turns[2], params).output.token_ids)
    return out
