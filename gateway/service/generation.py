"""Text generation on top of the handoff: incremental detokenization and stop strings.

Routes build a `GenerationRequest` and consume the cluster wing's `TokenChunk`s with their text filled
in; when a stop string matches, the handoff is closed early (which frees the decode server's pages at
once).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

from gateway.cluster.handoff import run_handoff
from gateway.cluster.pool import WorkerPool
from gateway.config import GatewayConfig
from gateway.errors import bad_request
from gateway.metrics import GatewayMetrics
from gateway.records import Finish, FinishReason, GeneratedToken, HandoffTimings, TokenChunk
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopStringMatcher
from gateway.text.tokenizer import Tokenizer
from tandem.sampling import SamplingSpec


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation. Text options: `skip_special_tokens`, `spaces_between_special_tokens` (False
    joins special tokens to their neighbours without the spaces some tokenizers put around them),
    and `no_stop_trim` (keep the matched stop string, or the text of the matched stop token, at the
    end of the text; by default both are trimmed, as in SGLang). `prompt_logprob_start` asks for
    the prompt's logprobs from that position; `arrived_at` is when the HTTP request arrived;
    `priority` orders it under contention (lower first; `gateway/caller.py`); `lora_name` is the
    LoRA adapter it runs under ("" the base model; `GatewayState.resolve_model`)."""

    prompt_ids: list[int]
    sampling: SamplingSpec
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    prompt_logprob_start: int | None = None
    arrived_at: float = field(default_factory=time.perf_counter)
    priority: int = 0
    lora_name: str = ""


@dataclass(slots=True)
class GenerationResult:
    """A whole generation, gathered from its chunks."""

    text: str = ""
    tokens: list[GeneratedToken] = field(default_factory=list)
    finish: Finish | None = None
    timings: HandoffTimings | None = None
    prompt_logprobs: list[GeneratedToken] = field(default_factory=list)
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0

    @property
    def output_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]

    def add(self, chunk: TokenChunk) -> None:
        self.text += chunk.text
        self.tokens.extend(chunk.tokens)
        self.finish = chunk.finish or self.finish
        self.timings = chunk.timings or self.timings
        self.prompt_logprobs = chunk.prompt_logprobs or self.prompt_logprobs
        self.spec_verify_ct = chunk.spec_verify_ct or self.spec_verify_ct
        self.spec_accepted_tokens = chunk.spec_accepted_tokens or self.spec_accepted_tokens


class GenerationService:
    """The generation logic every front shares (the OpenAI and native routes, the admin routes, and
    the gRPC API next): one per app, holding what a generation needs. Event loop only."""

    def __init__(
        self, pool: WorkerPool, config: GatewayConfig, tokenizer: Tokenizer | None, metrics: GatewayMetrics
    ) -> None:
        self.pool = pool
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        """Stream the chunks with their text; the last one carries `finish`. Without a tokenizer the text
        stays empty."""
        detokenizer = (
            IncrementalDetokenizer(
                self.tokenizer, request.skip_special_tokens, request.prompt_ids, request.spaces_between_special_tokens
            )
            if self.tokenizer is not None
            else None
        )
        stops = StopStringMatcher(request.stop)
        trim = _StopTokenTrim(request, self.pool)
        events = run_handoff(
            self.pool,
            self.config,
            self.metrics,
            request.request_id,
            request.prompt_ids,
            request.sampling,
            request.prompt_logprob_start,
            request.arrived_at,
            request.priority,
            request.lora_name,
        )
        async with contextlib.aclosing(events):
            async for chunk in events:
                ids = trim.text_ids(chunk)
                text = detokenizer.add(ids) if detokenizer else ""
                if chunk.finish is not None and detokenizer:
                    text += detokenizer.flush()
                result = stops.feed(text)
                if result.matched is not None:
                    kept = result.text + result.matched if request.no_stop_trim else result.text
                    yield replace(chunk, text=kept, finish=Finish(FinishReason.STOP, result.matched))
                    return
                if chunk.finish is None:
                    yield replace(chunk, text=result.text)
                    continue
                yield replace(chunk, text=result.text + stops.flush())
                return

    def check_batch_size(self, requests: list[GenerationRequest], param: str) -> None:
        """400 for a request that would start more generations (prompts x n) than the gateway allows."""
        if len(requests) > self.config.max_batch_requests:
            raise bad_request(
                f"this request asks for {len(requests)} generations (prompts x n); at most "
                f"{self.config.max_batch_requests} are allowed per request",
                param,
            )

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = GenerationResult()
        async for chunk in self.stream(request):
            result.add(chunk)
        return result

    async def gather(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Every request's whole result (`choices`, gathered)."""
        results = [GenerationResult() for _ in requests]
        async for index, chunk in self.choices(requests):
            results[index].add(chunk)
        return results

    async def started_choices(self, requests: list[GenerationRequest]) -> AsyncGenerator[tuple[int, TokenChunk], None]:
        """`choices`, once its first chunk has arrived. By then a generation was admitted, reserved and
        prefilled, so a streaming route that awaits this before it answers turns a refusal
        (no KV space, a full queue, a failed prefill) into a real status code, not an error event
        after a 200."""
        choices = self.choices(requests)
        first = await anext(choices)
        return _chained(first, choices)

    async def choices(self, requests: list[GenerationRequest]) -> AsyncGenerator[tuple[int, TokenChunk], None]:
        """Run several generations concurrently (n choices, several prompts) and merge their chunks as
        (index, chunk). If the consumer stops early, every unfinished generation is cancelled, which
        releases its pages on the workers."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, request: GenerationRequest) -> None:
            try:
                async for chunk in self.stream(request):
                    await queue.put((index, chunk))
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


async def _chained(
    first: tuple[int, TokenChunk], rest: AsyncGenerator[tuple[int, TokenChunk], None]
) -> AsyncGenerator[tuple[int, TokenChunk], None]:
    async with contextlib.aclosing(rest):
        yield first
        async for item in rest:
            yield item


class _StopTokenTrim:
    """Which generated ids reach the text: all of them but the eos / stop token id that ended
    generation (unless `no_stop_trim`). A token that may be that id is held back until the next
    event says whether it ended generation (it always does, unless eos is ignored, so holding it
    never delays real text)."""

    def __init__(self, request: GenerationRequest, pool: WorkerPool) -> None:
        self._enabled = not request.no_stop_trim
        eos = () if request.sampling.ignore_eos else pool.limits().eos_token_ids
        self._stop_ids = frozenset(request.sampling.stop_token_ids) | frozenset(eos)
        self._held: list[int] = []

    def text_ids(self, chunk: TokenChunk) -> list[int]:
        ids, self._held = self._held + chunk.token_ids, []
        if not self._enabled or not ids:
            return ids
        if chunk.finish is not None and chunk.finish.reason is FinishReason.STOP and chunk.finish.matched == ids[-1]:
            return ids[:-1]
        if chunk.finish is None and ids[-1] in self._stop_ids:
            self._held = ids[-1:]
            return ids[:-1]
        return ids
