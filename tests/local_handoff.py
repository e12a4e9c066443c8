"""The prefill-to-decode handoff between two engines of one process, as a prefill worker runs it without
gRPC: the real KV connector (server_runtime/kv_send.py) writes through the in-process transport."""

from __future__ import annotations

import time

from engine.engine import Engine
from kv_transfer import RemotePages
from kv_transfer.local_backend import LocalTransport
from server_runtime.kv_send import KVSend, KVSendConnector


class LocalHandoff:
    """Gives `prefill` a `KVSendConnector` whose writes land in `decode`'s pool. A context manager: its
    exit closes both transports."""

    def __init__(self, prefill: Engine, decode: Engine) -> None:
        self.prefill, self.decode = prefill, decode
        self.source, self.destination = LocalTransport(), LocalTransport()
        for transport, engine in ((self.source, prefill), (self.destination, decode)):
            transport.register(engine.runner.kv_pool.base_addr, engine.runner.kv_pool.num_bytes)
        prefill.kv_connector = self.connector = KVSendConnector(self.source, prefill.runner.kv_pool.base_addr)

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
