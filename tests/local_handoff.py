"""The prefill-to-decode handoff between two engines of one process, as the workers run it without gRPC:
the real KV connectors (server_runtime/kv_send.py writes through the in-process transport;
server_runtime/kv_receive.py keeps the decode side's reservations)."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.engine import Engine
from engine.kv_connector import ReceivedKV
from engine.request import Request, SamplingParams, StepOutput
from kv_transfer import RemotePages
from kv_transfer.local_backend import LocalTransport
from server_runtime.kv_receive import KVReceiveConnector
from server_runtime.kv_send import KVSend, KVSendConnector


def take_kv_in(
    engine: Engine, ttl_s: float = 60.0, grace_s: float = 0.0, clock: Callable[[], float] = time.monotonic
) -> KVReceiveConnector:
    """Give `engine` a decode worker's KV connector, so it takes reservations; returns the connector."""
    engine.kv_connector = connector = KVReceiveConnector(ttl_s, grace_s, clock)
    return connector


def confirm(
    engine: Engine,
    request_id: str,
    prompt_ids: list[int],
    first_token: int,
    first_logprob: float,
    sampling: SamplingParams,
    weights_id: str | None = None,
    **fields: object,
) -> StepOutput | None:
    """Confirm `request_id`'s reservation with the prompt and its first token, as a decode worker's
    Generate does (`Engine.add_request` with `ReceivedKV`)."""
    received = ReceivedKV(first_token, first_logprob, weights_id)
    return engine.add_request(Request(request_id, list(prompt_ids), sampling, kv_params=received, **fields))  # type: ignore[arg-type]


class LocalHandoff:
    """Gives `prefill` a `KVSendConnector` whose writes land in `decode`'s pool, and `decode` a
    `KVReceiveConnector` (`receiver`). A context manager: its exit closes both transports."""

    def __init__(self, prefill: Engine, decode: Engine) -> None:
        self.prefill, self.decode = prefill, decode
        self.source, self.destination = LocalTransport(), LocalTransport()
        for transport, engine in ((self.source, prefill), (self.destination, decode)):
            transport.register(engine.runner.kv_pool.base_addr, engine.runner.kv_pool.num_bytes)
        prefill.kv_connector = self.connector = KVSendConnector(self.source, prefill.runner.kv_pool.base_addr)
        receiver = decode.kv_connector
        self.receiver = receiver if isinstance(receiver, KVReceiveConnector) else take_kv_in(decode)

    def target(self, page_ids: list[int], first_page: int = 0, timeout_s: float = 10.0) -> KVSend:
        """A `KVSend` into `decode`'s pages `page_ids`, for the prompt's pages from `first_page` on."""
        layout = self.decode.runner.layout
        dst = RemotePages(self.destination.session_id, self.decode.runner.kv_pool.base_addr, layout.page_bytes,
                          tuple(page_ids))
        return KVSend(dst, first_page, int((time.time() + 60) * 1000), timeout_s)

    def __enter__(self) -> LocalHandoff:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.source.close()
        self.destination.close()
