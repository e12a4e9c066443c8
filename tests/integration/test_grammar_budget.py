"""A grammar that takes too long to compile is refused, the worker's next grammar still compiles,
and the compiled-grammar cache stays bounded (real xgrammar on SmolLM2's vocabulary)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from engine import grammar
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from tandem.sampling import GrammarKind, GrammarSpec
from engine.weights import open_checkpoint
from server_runtime.engine_loop import EngineLoop
from server_runtime.metrics import WorkerMetrics

SLOW = GrammarSpec(GrammarKind.REGEX, "[a-z]{1,300000}")   # a second or more to compile here


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Engine:
    engine = Engine(open_checkpoint(str(smollm2_path)), EngineConfig(max_total_tokens=256), progress=False)
    engine.grammar.load()   # the vocabulary: loaded once, outside any budget
    return engine


def test_a_compile_over_its_budget_is_refused_and_later_compiles_still_run(engine: Engine) -> None:
    async def scenario() -> tuple[float, str]:
        loop = EngineLoop(engine, asyncio.get_running_loop(), WorkerMetrics("decode", "m", "0"))
        loop.start()   # a compiled grammar enters the engine through its thread
        try:
            started = time.monotonic()
            with pytest.raises(InvalidRequestError, match="too complex: compiling it took over 0.05 s") as refused:
                await loop.prepare_grammar(SLOW, timeout_s=0.05)
            waited = time.monotonic() - started
            # the abandoned compile holds the lane until it ends; then the next one runs within its own budget
            quick = GrammarSpec(GrammarKind.REGEX, "(yes|no)")
            await loop.prepare_grammar(quick, timeout_s=60)
            assert await loop.call(lambda engine: engine.grammar.lookup(quick) is not None)
            assert not await loop.call(lambda engine: engine.grammar.lookup(SLOW) is not None)
        finally:
            loop.stop()
        return waited, str(refused.value)
    waited, message = asyncio.run(scenario())
    assert waited < 1.0, waited
    assert "regex" in message


def test_the_compiled_grammar_cache_keeps_only_the_most_recent(engine: Engine, monkeypatch) -> None:
    monkeypatch.setattr(grammar, "CACHE_SIZE", 3)
    specs = [GrammarSpec(GrammarKind.REGEX, f"(a|b){{{i}}}") for i in range(1, 6)]
    for spec in specs:
        engine.grammar.prepare(spec)
    engine.grammar.prepare(specs[2])   # used again: now the most recent
    engine.grammar.prepare(GrammarSpec(GrammarKind.REGEX, "c"))
    assert list(engine.grammar._compiled) == [specs[4], specs[2], GrammarSpec(GrammarKind.REGEX, "c")]
