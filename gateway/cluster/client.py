"""`WorkerClient`: one worker's gRPC channel and stubs behind typed async methods.

The gateway's only gRPC edge: every method takes and returns gateway records
(`gateway/records.py`, `gateway/cluster/worker_records.py`), converts them in
`gateway/cluster/convert.py`, and turns a failed call into a `WorkerError` (an `APIError`) in
`gateway/cluster/worker_errors.py`. Every method takes its deadline (`timeout_s`) from the caller.
Event loop only.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.cluster import convert
from gateway.cluster.worker_errors import WorkerError, worker_error
from gateway.cluster.worker_records import (
    Embeddings,
    ExpertCounts,
    ExpertRecordOp,
    FlushResult,
    Health,
    KvEvents,
    KvTarget,
    ModelInfo,
    PrefillResult,
    Reservation,
    UpdateResult,
    WorkerLoad,
)
from gateway.records import GeneratedToken, Role, TokenChunk
from tandem.internal_auth import InternalCredentials
from tandem.sampling import SamplingSpec
from tandem.tracing import Metadata
from tandem.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

# gRPC backs off reconnecting to a worker that went away by up to 120 s; cap it at half a second, so that
# a worker that starts or restarts is seen by the pool's next probes (every 0.2 s while the pool cannot serve,
# gateway/cluster/pool.py). Keepalive pings every 10 s close a
# connection whose worker stopped answering (a wedged or frozen process, a dead host) within 15 s,
# failing the calls on it, even between calls; the workers accept pings that often (server_runtime/worker.py).
# Answers up to the workers' own send limit: a KV event snapshot lists every page of the pool, 8 bytes each.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


class WorkerClient:
    """The `role` worker at `address`: one channel carrying `credentials` (the internal token, TLS),
    opened at once and connected lazily. Each RPC method raises `WorkerError` when the call fails;
    the probes (`health`, `responds`, `model_info`) never raise for a failed call."""

    def __init__(
        self, role: Role | str, address: str, credentials: InternalCredentials = InternalCredentials()
    ) -> None:
        self.role = Role(role)
        self.address = address
        self._channel = credentials.open_channel(address, options=CHANNEL_OPTIONS)
        self._prefill = prefill_pb2_grpc.PrefillServiceStub(self._channel)
        self._decode = decode_pb2_grpc.DecodeServiceStub(self._channel)
        self._control = worker_pb2_grpc.WorkerServiceStub(self._channel)  # what every worker answers
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        """Close the channel; calls still on it fail with CANCELLED."""
        await self._channel.close()

    # --- probes ------------------------------------------------------------------------------

    async def health(self, timeout_s: float) -> Health:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return Health.NO_ANSWER
        return Health.SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else Health.NOT_SERVING

    async def responds(self, timeout_s: float) -> bool:
        """Whether the worker answers a health check now, whatever it answers."""
        return await self.health(timeout_s) is not Health.NO_ANSWER

    async def model_info(self, timeout_s: float) -> ModelInfo | None:
        """The worker's model info if its health service says SERVING (each call within `timeout_s`);
        None when it is not serving, or does not answer either call."""
        if await self.health(timeout_s) is not Health.SERVING:
            return None
        try:
            reply = await self._control.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return None
        return convert.model_info_from_proto(reply)

    # --- the handoff -------------------------------------------------------------------------

    async def reserve(
        self, request_id: str, prompt_ids: list[int], timeout_s: float, priority: int = 0, lora_name: str = ""
    ) -> Reservation:
        """Decode: hold KV pages for the prompt `prompt_ids` (running requests of a worse `priority`
        may be preempted for them). The worker matches the prompt in its prefix cache under the
        adapter `lora_name` ("" the base model): the pages it holds already are shared into the
        reservation (`Reservation.cached_tokens`) and left out of the target."""
        reply = await self._call(
            self._decode.Reserve(
                decode_pb2.ReserveRequest(
                    request_id=request_id,
                    prompt_len=len(prompt_ids),
                    priority=priority,
                    prompt_token_ids=prompt_ids,
                    lora_name=lora_name,
                ),
                timeout=timeout_s,
            )
        )
        return Reservation(convert.kv_target_from_proto(reply.kv_target), reply.ttl_ms, reply.cached_tokens)

    async def prefill(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingSpec,
        kv_target: KvTarget,
        logprob_start_len: int | None,
        timeout_s: float,
        priority: int = 0,
        metadata: Metadata = (),
        lora_name: str = "",
    ) -> PrefillResult:
        """Prefill: run the prompt, write its KV into `kv_target`, sample the first token. Cancelling
        the awaiting task cancels the RPC. `metadata`: the trace's context (`tandem.tracing`), if any;
        `lora_name`: the adapter to run under ("" the base model)."""
        request = prefill_pb2.PrefillRequest(
            request_id=request_id,
            token_ids=token_ids,
            sampling_params=convert.sampling_to_proto(sampling),
            kv_target=convert.kv_target_to_proto(kv_target),
            priority=priority,
            lora_name=lora_name,
        )
        if logprob_start_len is not None:
            request.logprob_start_len = logprob_start_len
        call = self._prefill.Prefill(request, timeout=timeout_s, metadata=metadata or None)
        return convert.prefill_from_proto(await self._call(call))

    async def cancel_prefill(self, request_id: str, kv_target: KvTarget, timeout_s: float) -> bool:
        """Prefill: stop the Prefill sent with `kv_target`; answers once its KV write is over, with
        whether one was running."""
        reply = await self._call(
            self._prefill.CancelPrefill(
                prefill_pb2.CancelPrefillRequest(
                    request_id=request_id, kv_target=convert.kv_target_to_proto(kv_target)
                ),
                timeout=timeout_s,
            )
        )
        return reply.was_running

    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        first_token: GeneratedToken,
        sampling: SamplingSpec,
        weights_id: str,
        kv_grant: str,
        timeout_s: float,
        priority: int = 0,
        metadata: Metadata = (),
        lora_name: str = "",
    ) -> DecodeStream:
        """Decode: start the reserved request from `first_token`; the stream yields the tokens after it
        (under the adapter `lora_name`, the prefill's; "" the base model)."""
        call = self._decode.Generate(
            decode_pb2.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                first_token=convert.token_to_proto(first_token),
                sampling_params=convert.sampling_to_proto(sampling),
                weights_id=weights_id,
                kv_grant=kv_grant,
                priority=priority,
                lora_name=lora_name,
            ),
            timeout=timeout_s,
            metadata=metadata or None,
        )
        return DecodeStream(self, call)

    def prefill_and_generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        timeout_s: float,
        priority: int = 0,
        metadata: Metadata = (),
        lora_name: str = "",
    ) -> DecodeStream:
        """Decode: prefill the prompt on this worker (no reservation, no KV transfer) and stream every
        token, the first included; the first chunk carries the prompt's queue and compute times."""
        call = self._decode.PrefillAndGenerate(
            decode_pb2.PrefillAndGenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                sampling_params=convert.sampling_to_proto(sampling),
                priority=priority,
                lora_name=lora_name,
            ),
            timeout=timeout_s,
            metadata=metadata or None,
        )
        return DecodeStream(self, call)

    async def abort(self, request_id: str, kv_write_settled: bool, timeout_s: float) -> bool:
        """End a request or drop a reservation, freeing its pages (at once when `kv_write_settled`:
        no KV write into them can still be in flight); whether the worker held anything for it."""
        reply = await self._call(
            self._control.Abort(
                common_pb2.AbortRequest(request_id=request_id, kv_write_settled=kv_write_settled), timeout=timeout_s
            )
        )
        return reply.found

    # --- embeddings, load and admin ----------------------------------------------------------

    async def embed(
        self,
        request_id: str,
        token_lists: list[list[int]],
        dimensions: int | None,
        timeout_s: float,
        token_type_lists: list[list[int]] | None = None,
    ) -> Embeddings:
        """Embedding prefill worker: one vector per token list (`dimensions` None: the full size;
        `token_type_lists`: each list's segments, a BERT pair's; None: all 0)."""
        types = token_type_lists or [[] for _ in token_lists]
        request = prefill_pb2.EmbedRequest(
            request_id=request_id,
            dimensions=dimensions,
            inputs=[prefill_pb2.EmbedInput(token_ids=ids, token_type_ids=t) for ids, t in zip(token_lists, types)],
        )
        reply = await self._call(self._prefill.Embed(request, timeout=timeout_s))
        return Embeddings([list(e.values) for e in reply.embeddings], reply.num_tokens)

    async def load(self, timeout_s: float) -> WorkerLoad:
        return convert.load_from_proto(
            await self._call(self._control.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout_s))
        )

    async def flush_cache(self, timeout_s: float) -> FlushResult:
        """Drop the prefix cache unless requests are in flight. A worker without one (an embedding
        worker answers UNIMPLEMENTED) has nothing to flush: a success with the message "no cache"."""
        try:
            reply = await self._control.FlushCache(common_pb2.FlushCacheRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return FlushResult(True, "no cache")
            raise self.error(exc) from None
        return FlushResult(reply.success, reply.message, reply.num_freed_pages)

    async def update_weights(self, model_path: str, timeout_s: float) -> UpdateResult:
        """Reload the weights in place from `model_path` (aborts the requests in flight)."""
        reply = await self._call(
            self._control.UpdateWeights(common_pb2.UpdateWeightsRequest(model_path=model_path), timeout=timeout_s)
        )
        return UpdateResult(reply.success, reply.message, reply.weights_id)

    async def load_lora_adapter(self, name: str, path: str, timeout_s: float) -> None:
        """Load the PEFT adapter at `path` (inside the worker's --lora-dir) under `name`."""
        await self._call(
            self._control.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name=name, path=path), timeout=timeout_s)
        )

    async def unload_lora_adapter(self, name: str, timeout_s: float) -> None:
        """Unload the adapter `name` once the requests using it have ended (the worker waits for them)."""
        await self._call(
            self._control.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(name=name), timeout=timeout_s)
        )

    async def expert_record(self, op: ExpertRecordOp, timeout_s: float) -> ExpertCounts | None:
        """Start, stop or dump the expert distribution record; the dump's counts, None for the others."""
        if op is ExpertRecordOp.START:
            await self._call(
                self._control.StartExpertDistributionRecord(
                    common_pb2.StartExpertDistributionRecordRequest(), timeout=timeout_s
                )
            )
            return None
        if op is ExpertRecordOp.STOP:
            await self._call(
                self._control.StopExpertDistributionRecord(
                    common_pb2.StopExpertDistributionRecordRequest(), timeout=timeout_s
                )
            )
            return None
        reply = await self._call(
            self._control.DumpExpertDistributionRecord(
                common_pb2.DumpExpertDistributionRecordRequest(), timeout=timeout_s
            )
        )
        return convert.expert_counts_from_proto(reply)

    def kv_events(self) -> KvEventStream:
        """Subscribe to the worker's KV events (SubscribeKvEvents): a snapshot of the pages its prefix
        cache holds, then what is stored and removed. No deadline: it runs until cancelled."""
        return KvEventStream(self._control.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest()))

    async def _call(self, call):
        """The answer of a unary call; its failure as a `WorkerError`."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise self.error(exc) from None

    def error(self, exc: grpc.aio.AioRpcError) -> WorkerError:
        """`exc` as the HTTP client sees it (the one table: `worker_errors.py`)."""
        return worker_error(exc, self.role, self.address)


class DecodeStream:
    """A Generate call under way: `read()` (or iterate) the decode worker's chunks in order;
    `cancel()` ends the call, which frees the request's pages on the worker."""

    def __init__(self, client: WorkerClient, call: grpc.aio.UnaryStreamCall) -> None:
        self._client = client
        self._call = call

    async def read(self) -> TokenChunk | None:
        """The next chunk; None once the worker closed the stream. A failed call raises `WorkerError`."""
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._client.error(exc) from None
        return None if message is grpc.aio.EOF else convert.chunk_from_proto(message)

    def cancel(self) -> None:
        self._call.cancel()

    def __aiter__(self) -> DecodeStream:
        return self

    async def __anext__(self) -> TokenChunk:
        chunk = await self.read()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class KvEventsEnded(Exception):
    """A worker's KV event stream ended: it closed it, the call failed (`detail` says how), or the
    worker does not know the RPC (`is_unsupported`: UNIMPLEMENTED, an older worker)."""

    def __init__(self, detail: str, is_unsupported: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.is_unsupported = is_unsupported


class KvEventStream:
    """A SubscribeKvEvents call under way: `read()` its messages in order; `cancel()` ends it. Its
    failures are not `WorkerError`s: no request waits on it, and it ends each time its worker restarts."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def read(self) -> KvEvents:
        """The next message; `KvEventsEnded` once the stream is over, however it ended."""
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            raise KvEventsEnded(f"{code.name}: {exc.details()}", code == grpc.StatusCode.UNIMPLEMENTED) from None
        if message is grpc.aio.EOF:
            raise KvEventsEnded("the worker closed the stream")
        return convert.kv_events_from_proto(message)

    def cancel(self) -> None:
        self._call.cancel()
