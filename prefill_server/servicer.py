"""PrefillService: run the prompt, write its KV into the decode server's pages (from the target's
`skip_tokens` on: the decode server holds the rest), return the first token."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from engine.errors import EngineError, InvalidRequestError, RequestAbortedError
from engine.page_allocator import pages_needed
from engine.request import FinishReason, Request
from kv_transfer import KVTransferError, RemotePages
from server_runtime.common_rpcs import add_worker_servicer
from server_runtime.context import WorkerContext
from server_runtime.convert import check_layout_matches, prompt_logprobs_to_proto, sampling_from_proto, token_to_proto
from server_runtime.errors import RequestFailedError, abort_with
from server_runtime.kv_grants import GrantChecker, GrantError, grant_key
from server_runtime.kv_send import KVSend, await_write
from server_runtime.lora_serving import held_lora
from server_runtime.spans import record_prefill
from server_runtime.worker import WorkerKind, start_engine_worker
from tandem import tracing
from tandem.request_log import bind_request_id
from tandem.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.grants = GrantChecker(grant_key(ctx.config.kv_grant_secret))
        self._running: dict[str, asyncio.Event] = {}  # grant -> set once that Prefill's write is over

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        bind_request_id(request.request_id)
        if self.ctx.is_draining:  # a gateway that has not seen NOT_SERVING yet; it may retry elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill worker is shutting down")
        grant = request.kv_target.grant
        try:  # first: a target without the decode server's grant for these pages gets no compute either
            self.grants.check(request.request_id, request.kv_target)
        except GrantError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        # No await between the check and this line: CancelPrefill sees the grant either unspent or running.
        over = self._running[grant] = asyncio.Event()
        received = time.perf_counter()
        send: KVSend | None = None
        try:
            send = self._kv_send(request)  # checked before any compute
            return await self._prefill(request, send, tracing.caller_context(context.invocation_metadata()), received)
        except (EngineError, KVTransferError) as exc:
            logger.warning("prefill %s failed: %s", request.request_id, exc)
            await abort_with(context, exc)
        finally:
            self._end_once_written(grant, over, send)

    def _end_once_written(self, grant: str, over: asyncio.Event, send: KVSend | None) -> None:
        """Forget the Prefill of `grant` and set `over` once no write of its KV can still land in the
        decode worker's pages: at once, unless the engine started the write, which a Prefill that timed
        out or that its caller cancelled does not wait for; then when the write settles. By now the
        engine has seen the request's abort (`_run_prefill`), so a write not started never starts."""

        def end() -> None:
            del self._running[grant]
            over.set()

        if send is None or not send.written.running():
            end()
            return
        loop = asyncio.get_running_loop()

        def end_soon(_: object) -> None:  # on the transport's thread
            with contextlib.suppress(RuntimeError):  # the worker has stopped: nobody waits any more
                loop.call_soon_threadsafe(end)

        send.written.add_done_callback(end_soon)

    async def CancelPrefill(
        self, request: prefill_pb2.CancelPrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.CancelPrefillResponse:
        rid, target = request.request_id, request.kv_target
        bind_request_id(rid)
        try:  # verified before anything is stopped; spent, so no Prefill can start with it from now on
            self.grants.revoke(rid, target)
        except GrantError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        over = self._running.get(target.grant)
        if over is None:  # never started, or already over
            return prefill_pb2.CancelPrefillResponse(was_running=False)
        await self.ctx.loop.stop_compute(rid, "cancelled by the gateway")
        await over.wait()  # set once the Prefill is over: its write too, if one had started
        return prefill_pb2.CancelPrefillResponse(was_running=True)

    async def _prefill(
        self, request: prefill_pb2.PrefillRequest, send: KVSend, trace: tracing.Context | None, received: float
    ) -> prefill_pb2.PrefillResponse:
        """Run the prompt and write its KV with `send`; `trace`: the caller's span, for this call's spans."""
        sampling = sampling_from_proto(request.sampling_params)
        if sampling.grammar is not None:  # compile off the engine thread, so running requests never wait
            await self.ctx.loop.prepare_grammar(sampling.grammar, self.ctx.config.grammar_compile_timeout_s)
        async with held_lora(self.ctx.loras, request.lora_name, self.ctx.loop) as lora:
            req = Request(
                request.request_id,
                list(request.token_ids),
                sampling,
                is_prefill_only=True,
                prompt_logprob_start=(request.logprob_start_len if request.HasField("logprob_start_len") else None),
                priority=request.priority,
                lora_id=lora.lora_id if lora else "",
                lora_slot=lora.slot_id if lora else None,
                kv_params=send,
            )
            return await self._run_prefill(request, req, send, trace, received)

    def _kv_send(self, request: prefill_pb2.PrefillRequest) -> KVSend:
        """Where the engine's KV connector writes `request`'s KV: the target's pages, for the prompt's pages
        after the `skip_tokens` the decode worker already holds."""
        target, layout = request.kv_target, self.ctx.facts.layout
        check_layout_matches(layout, target.layout)
        written = _written_pages(len(request.token_ids), target, layout.page_size)
        dst_pages = tuple(target.page_ids[: written.stop - written.start])
        dst = RemotePages(target.session_id, target.base_addr, layout.page_bytes, dst_pages)
        return KVSend(dst, written.start, target.grant_expires_unix_ms, self._transfer_timeout_s(request))

    async def _run_prefill(
        self,
        request: prefill_pb2.PrefillRequest,
        req: Request,
        send: KVSend,
        trace: tracing.Context | None,
        received: float,
    ) -> prefill_pb2.PrefillResponse:
        """Compute `req` (the engine request of `request`); the engine's KV connector writes its KV."""
        rid = request.request_id
        try:
            sink = await self.ctx.loop.submit(req)  # inside the try: a cancel right after still cleans up
            output = await sink.get()
            computed = sent = time.perf_counter()
            if output.finish_reason is FinishReason.ABORT:
                raise RequestAbortedError(f"prefill aborted: {output.abort_message}")
            if output.finish_reason is FinishReason.ERROR:
                raise RequestFailedError(output.abort_message)
            stats = await await_write(send)
            written = time.perf_counter()
        finally:  # stops a compute still going; pages a write still reads stay with the connector
            await asyncio.shield(self.ctx.loop.abort(rid))
        self.ctx.loop.metrics.record_prefill(
            len(request.token_ids), output.cached_tokens, stats.num_bytes, stats.seconds
        )
        started = output.prefill_started_at or received
        num_tokens, cached = len(request.token_ids), output.cached_tokens
        record_prefill(trace, received, started, computed, (sent, written), num_tokens, cached, stats.num_bytes)
        return prefill_pb2.PrefillResponse(
            request_id=rid,
            first_token=token_to_proto(output),
            cached_tokens=output.cached_tokens,
            queue_ms=(started - received) * 1000,
            compute_ms=(computed - started) * 1000,
            prompt_logprobs=prompt_logprobs_to_proto(output.prompt_logprobs),
            transfer_ms=stats.seconds * 1000,
            kv_bytes=stats.num_bytes,
            weights_id=output.weights_id,
        )

    def _transfer_timeout_s(self, request: prefill_pb2.PrefillRequest) -> float:
        """The request's own deadline for its KV write, else --transfer-timeout."""
        if request.HasField("transfer_timeout_ms"):
            return request.transfer_timeout_ms / 1000
        return self.ctx.config.transport.transfer_timeout_s

    async def Embed(
        self, request: prefill_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.EmbedResponse:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this worker serves a generation model; embeddings need a worker started with --is-embedding",
        )


def _written_pages(prompt_len: int, target: common_pb2.KvTarget, page_size: int) -> slice:
    """The prompt's pages to write into `target`: those after the `skip_tokens` the decode worker
    already holds. InvalidRequestError when the target does not fit the prompt."""
    skip = target.skip_tokens
    if skip < 0 or skip % page_size or skip >= prompt_len:
        raise InvalidRequestError(
            f"kv_target skips {skip} tokens: not a whole number of {page_size}-token pages "
            f"below the prompt's {prompt_len}"
        )
    first, num_pages = skip // page_size, pages_needed(prompt_len, page_size)
    if len(target.page_ids) < num_pages - first:
        raise InvalidRequestError(
            f"kv_target has {len(target.page_ids)} pages; the prompt needs {num_pages - first} after the skipped tokens"
        )
    return slice(first, num_pages)


def add_prefill_servicer(server: grpc.aio.Server, ctx: WorkerContext) -> str:
    """Register a generation worker's PrefillService; returns the service's full name."""
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(ctx), server)
    return prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


PREFILL = WorkerKind("prefill", start_engine_worker, (add_prefill_servicer, add_worker_servicer))
