"""`InferenceServicer`: tandem.api.v1's RPCs on the operations the HTTP routes call. Each RPC turns
its message into the route's body (requests.py), runs the same operation under the call's deadline
(the client's, capped by --request-timeout), and writes the answer into its response message
(convert.py). Errors end the call with their status (status.py), never OK: a stream that fails after
output began ends with the status too, and so does a generation a worker aborted."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from pydantic import BaseModel

from gateway.caller import bind_caller, caller_from
from gateway.errors import APIError
from gateway.grpc_api import requests
from gateway.grpc_api.calls import Calls
from gateway.grpc_api.convert import fill, to_values
from gateway.grpc_api.status import status_of
from gateway.service.chat import chat_completion
from gateway.service.completion import completion
from gateway.service.embeddings import embeddings_answer, encode_answer
from gateway.service.guard import unguarded
from gateway.service.model_info import model_info, model_list
from gateway.service.native_generate import run_generate
from gateway.service.request_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    EncodeRequest,
    RerankRequest,
    ScoreRequest,
)
from gateway.service.request_schemas import GenerateRequest as GenerateBody
from gateway.service.response_schemas import ChatCompletion, Completion, GenerateResponse
from gateway.service.scoring import rerank_answer, score_answer
from gateway.service.state import GatewayState
from gateway.service.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from tandem.api.v1 import (
    chat_pb2,
    completion_pb2,
    embed_pb2,
    generate_pb2,
    inference_service_pb2,
    inference_service_pb2_grpc,
    score_pb2,
)

T = TypeVar("T")


class InferenceServicer(inference_service_pb2_grpc.InferenceServiceServicer):
    def __init__(self, state: GatewayState) -> None:
        self._state = state
        self._calls = Calls()

    async def ChatComplete(self, request: chat_pb2.ChatCompletionRequest, context: grpc.aio.ServicerContext) -> Message:
        call_id = request.request_id or f"chatcmpl-{uuid.uuid4().hex}"

        async def work() -> Message:
            body = requests.record(ChatCompletionRequest, requests.chat_values(request))
            answer = await chat_completion(self._state, body, unguarded, call_id)
            assert isinstance(answer, ChatCompletion)
            _refuse_aborted(choice.finish_reason for choice in answer.choices)
            return fill(chat_pb2.ChatCompletionResponse(), _json(answer))

        return await self._run(context, call_id, "request_id", work)

    async def ChatCompleteStream(
        self, request: chat_pb2.ChatCompletionRequest, context: grpc.aio.ServicerContext
    ) -> None:
        call_id = request.request_id or f"chatcmpl-{uuid.uuid4().hex}"

        async def work() -> None:
            body = requests.record(ChatCompletionRequest, {**requests.chat_values(request), "stream": True})
            chunks = await chat_completion(self._state, body, unguarded, call_id)
            assert not isinstance(chunks, ChatCompletion)
            await _write_all(context, chunks, chat_pb2.ChatCompletionChunk)

        await self._run(context, call_id, "request_id", work)

    async def Complete(self, request: completion_pb2.CompletionRequest, context: grpc.aio.ServicerContext) -> Message:
        call_id = request.request_id or f"cmpl-{uuid.uuid4().hex}"

        async def work() -> Message:
            body = requests.record(CompletionRequest, requests.completion_values(request))
            answer = await completion(self._state, body, unguarded, call_id)
            assert isinstance(answer, Completion)
            _refuse_aborted(choice.finish_reason for choice in answer.choices)
            return fill(completion_pb2.CompletionResponse(), _json(answer))

        return await self._run(context, call_id, "request_id", work)

    async def CompleteStream(
        self, request: completion_pb2.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> None:
        call_id = request.request_id or f"cmpl-{uuid.uuid4().hex}"

        async def work() -> None:
            body = requests.record(CompletionRequest, {**requests.completion_values(request), "stream": True})
            chunks = await completion(self._state, body, unguarded, call_id)
            assert not isinstance(chunks, Completion)
            await _write_all(context, chunks, completion_pb2.CompletionChunk)

        await self._run(context, call_id, "request_id", work)

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> Message:
        call_id = request.rid or uuid.uuid4().hex

        async def work() -> Message:
            body = requests.record(GenerateBody, requests.generate_values(request, call_id))
            answer = await run_generate(self._state, body, unguarded)
            assert not isinstance(answer, AsyncIterator)
            outputs = answer if isinstance(answer, list) else [answer]
            _refuse_aborted_outputs(outputs)
            response = generate_pb2.GenerateResponse()
            for index, output in enumerate(outputs):
                fill(response.outputs.add(), {**_generate_json(output), "index": index})
            return response

        return await self._run(context, call_id, "rid", work)

    async def GenerateStream(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        call_id = request.rid or uuid.uuid4().hex

        async def work() -> None:
            body = requests.record(GenerateBody, {**requests.generate_values(request, call_id), "stream": True})
            events = await run_generate(self._state, body, unguarded)
            assert isinstance(events, AsyncIterator)
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    _refuse_aborted_outputs([event])
                    await context.write(fill(generate_pb2.GenerateOutput(), _generate_json(event)))

        await self._run(context, call_id, "rid", work)

    async def Embed(self, request: embed_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> Message:
        async def work() -> Message:
            body = requests.record(EmbeddingRequest, requests.embed_values(request))
            return fill(embed_pb2.EmbedResponse(), await embeddings_answer(self._state, body))

        return await self._run(context, None, "", work)

    async def Classify(self, request: embed_pb2.ClassifyRequest, context: grpc.aio.ServicerContext) -> Message:
        call_id = request.rid or uuid.uuid4().hex

        async def work() -> Message:
            body = requests.record(EncodeRequest, requests.classify_values(request, call_id))
            answer = await encode_answer(self._state, body, "/classify")
            response = embed_pb2.ClassifyResponse()
            for index, output in enumerate(answer if isinstance(answer, list) else [answer]):
                meta = output["meta_info"]
                fill(
                    response.outputs.add(),
                    {
                        "id": meta["id"],
                        "index": index,
                        "embedding": output["embedding"],
                        "prompt_tokens": meta["prompt_tokens"],
                    },
                )
            return response

        return await self._run(context, call_id, "rid", work)

    async def Score(self, request: score_pb2.ScoreRequest, context: grpc.aio.ServicerContext) -> Message:
        async def work() -> Message:
            body = requests.record(ScoreRequest, to_values(request))
            return fill(score_pb2.ScoreResponse(), await score_answer(self._state, body))

        return await self._run(context, None, "", work)

    async def Rerank(self, request: score_pb2.RerankRequest, context: grpc.aio.ServicerContext) -> Message:
        async def work() -> Message:
            body = requests.record(RerankRequest, to_values(request))
            return fill(score_pb2.RerankResponse(), await rerank_answer(self._state, body))

        return await self._run(context, None, "", work)

    async def Tokenize(
        self, request: inference_service_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> Message:
        async def work() -> Message:
            body = requests.record(TokenizeRequest, requests.tokenize_values(request))
            return fill(inference_service_pb2.TokenizeResponse(), await tokenize(self._state, body))

        return await self._run(context, None, "", work)

    async def Detokenize(
        self, request: inference_service_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> Message:
        async def work() -> Message:
            body = requests.record(DetokenizeRequest, to_values(request))
            return fill(inference_service_pb2.DetokenizeResponse(), await detokenize(self._state, body))

        return await self._run(context, None, "", work)

    async def ListModels(
        self, request: inference_service_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> Message:
        return fill(inference_service_pb2.ListModelsResponse(), _json(model_list(self._state)))

    async def GetModelInfo(
        self, request: inference_service_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> Message:
        return fill(inference_service_pb2.GetModelInfoResponse(), model_info(self._state))

    async def Abort(self, request: inference_service_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> Message:
        return inference_service_pb2.AbortResponse(found=self._calls.abort(request.request_id))

    async def _run(
        self, context: grpc.aio.ServicerContext, call_id: str | None, id_param: str, work: Callable[[], Awaitable[T]]
    ) -> T:
        """`work()` under the call's deadline, registered as `call_id` for Abort (None: not abortable),
        for the caller its metadata names (`gateway/caller.py`); any error ends the call with its status."""
        try:
            metadata = context.invocation_metadata() or ()
            bind_caller(caller_from((key, value) for key, value in metadata if isinstance(value, str)))
            with self._calls.registered(call_id, id_param) if call_id else contextlib.nullcontext():
                try:
                    async with asyncio.timeout(self._time_left(context)):
                        return await work()
                except asyncio.CancelledError:
                    if call_id and self._calls.was_aborted(call_id):
                        raise APIError(
                            499, f"request {call_id} was aborted by an Abort call", code="aborted_by_id"
                        ) from None
                    raise
        except APIError as exc:
            status = status_of(exc)
            await context.abort(status.code, status.details, status.trailing_metadata)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request ran past its deadline")
        raise AssertionError("context.abort raises")

    def _time_left(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        limit = self._state.config.request_timeout_s
        return limit if remaining is None else min(max(remaining, 0.0), limit)


async def _write_all(
    context: grpc.aio.ServicerContext, chunks: AsyncIterator[BaseModel], message_type: type[Message]
) -> None:
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            _refuse_aborted(choice.finish_reason for choice in getattr(chunk, "choices", ()))
            await context.write(fill(message_type(), _json(chunk)))


def _json(record: BaseModel) -> dict[str, Any]:
    return record.model_dump(mode="json")


def _generate_json(output: GenerateResponse) -> dict[str, Any]:
    """/generate's answer as a GenerateOutput's fields: `output_ids` only when there is no tokenizer."""
    values = _json(output)
    values.pop("token_ids", None)
    return values


def _refuse_aborted(finish_reasons: Iterable[Any]) -> None:
    if any(reason == "abort" for reason in finish_reasons):
        raise APIError(503, "a worker aborted the generation (a weights update, or a drain)", code="aborted")


def _refuse_aborted_outputs(outputs: list[GenerateResponse]) -> None:
    for output in outputs:
        finish = output.meta_info.finish_reason
        if finish is not None and finish.type == "abort":
            raise APIError(503, f"a worker aborted the generation: {getattr(finish, 'message', '')}", code="aborted")
