"""Running one request through an `Engine` to the end, for the tests of what the engine keeps between
requests (prefix cache, tiers): its tokens and how much of its prompt came from a cache."""

from __future__ import annotations

from engine.engine import Engine
from engine.request import Request, SamplingParams


def run_alone(engine: Engine, request_id: str, prompt: list[int], sampling: SamplingParams) -> tuple[list[int], int]:
    """Submit one request, step until the engine is idle; its tokens and its prompt tokens served from a cache."""
    engine.add_request(Request(request_id, list(prompt), sampling))
    tokens: list[int] = []
    cached = -1
    while engine.has_work:
        for out in engine.step():
            if out.token_id is not None:
                tokens.append(out.token_id)
            if cached < 0:
                cached = out.cached_tokens
    return tokens, cached
