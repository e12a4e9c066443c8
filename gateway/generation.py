"""Text generation on top of the handoff: incremental detokenization and stop strings.

Routes build a `GenerationRequest` and consume `TextDelta`s; when a stop string matches, the
handoff is closed early (which frees the decode server's pages at once).
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from gateway.config import GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer
from gateway.handoff import HandoffTimings, run_handoff
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
    token_ids: list[int]
    finish: Finish | None = None
    timings: HandoffTimings | None = None


@dataclass(slots=True)
class GenerationResult:
    """A whole generation, gathered from its deltas."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish: Finish | None = None
    timings: HandoffTimings | None = None

    def add(self, delta: TextDelta) -> None:
        self.text += delta.text
        self.output_ids.extend(delta.token_ids)
        self.finish = delta.finish or self.finish
        self.timings = delta.timings or self.timings


async def generate_text(pool: WorkerPool, config: GatewayConfig, tokenizer: Tokenizer,
                        request: GenerationRequest) -> AsyncIterator[TextDelta]:
    """Stream text deltas; the last one carries `finish`."""
    detokenizer = IncrementalDetokenizer(tokenizer, request.skip_special_tokens, request.prompt_ids)
    stops = StopStringMatcher(request.stop)
    events = run_handoff(pool, config, request.request_id, request.prompt_ids, request.sampling)
    async with contextlib.aclosing(events):
        async for event in events:
            text = detokenizer.add(event.token_ids)
            if event.finish_reason is not None:
                text += detokenizer.flush()
            result = stops.feed(text)
            if result.matched is not None:
                yield TextDelta(result.text, event.token_ids, Finish("stop", result.matched), event.timings)
                return
            if event.finish_reason is None:
                yield TextDelta(result.text, event.token_ids, None, event.timings)
                continue
            yield TextDelta(result.text + stops.flush(), event.token_ids,
                            Finish(event.finish_reason, event.matched_token_id, event.message), event.timings)
            return


async def generate_all(pool: WorkerPool, config: GatewayConfig, tokenizer: Tokenizer,
                       request: GenerationRequest) -> GenerationResult:
    result = GenerationResult()
    async for delta in generate_text(pool, config, tokenizer, request):
        result.add(delta)
    return result
