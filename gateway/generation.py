"""Text generation on top of the handoff: incremental detokenization and stop strings.

Routes build a `GenerationRequest` and consume `TextDelta`s; when a stop string matches, the
handoff is closed early (which frees the decode server's pages at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from gateway.config import GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer
from gateway.handoff import GeneratedToken, HandoffTimings, run_handoff
from gateway.stop_strings import StopStringMatcher
from gateway.tokenizer import Tokenizer
from gateway.workers import WorkerPool
from tandem.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str                      # "stop" | "length" | "abort"
    matched: str | int | None = None  # the stop string or stop token id
    message: str = ""


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    tokens: list[GeneratedToken]
    finish: Finish | None = None
    timings: HandoffTimings | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


@dataclass(slots=True)
class GenerationResult:
    """A whole generation, gathered from its deltas."""

    text: str = ""
    tokens: list[GeneratedToken] = field(default_factory=list)
    finish: Finish | None = None
    timings: HandoffTimings | None = None

    @property
    def output_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    def add(self, delta: TextDelta) -> None:
        self.text += delta.text
        self.tokens.extend(delta.tokens)
        self.finish = delta.finish or self.finish
        self.timings = delta.timings or self.timings


async def generate_text(pool: WorkerPool, config: GatewayConfig, tokenizer: Tokenizer | None,
                        request: GenerationRequest) -> AsyncIterator[TextDelta]:
    """Stream text deltas; the last one carries `finish`. Without a tokenizer the text stays empty."""
    detokenizer = (IncrementalDetokenizer(tokenizer, request.skip_special_tokens, request.prompt_ids)
                   if tokenizer is not None else None)
    stops = StopStringMatcher(request.stop)
    events = run_handoff(pool, config, request.request_id, request.prompt_ids, request.sampling)
    async with contextlib.aclosing(events):
        async for event in events:
            text = detokenizer.add(event.token_ids) if detokenizer else ""
            if event.finish_reason is not None and detokenizer:
                text += detokenizer.flush()
            result = stops.feed(text)
            if result.matched is not None:
                yield TextDelta(result.text, event.tokens, Finish("stop", result.matched), event.timings)
                return
            if event.finish_reason is None:
                yield TextDelta(result.text, event.tokens, None, event.timings)
                continue
            yield TextDelta(result.text + stops.flush(), event.tokens,
                            Finish(event.finish_reason, event.matched_token_id, event.message), event.timings)
            return


async def generate_all(pool: WorkerPool, config: GatewayConfig, tokenizer: Tokenizer | None,
                       request: GenerationRequest) -> GenerationResult:
    result = GenerationResult()
    async for delta in generate_text(pool, config, tokenizer, request):
        result.add(delta)
    return result


async def generate_choices(pool: WorkerPool, config: GatewayConfig, tokenizer: Tokenizer | None,
                           requests: list[GenerationRequest]) -> AsyncIterator[tuple[int, TextDelta]]:
    """Run several generations concurrently (n choices, several prompts) and merge their deltas as
    (index, delta). If the consumer stops early, every unfinished generation is cancelled, which
    releases its pages on the workers."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, request: GenerationRequest) -> None:
        try:
            async for delta in generate_text(pool, config, tokenizer, request):
                await queue.put((index, delta))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
