"""The KV connector: what moves a request's KV between the engine's pool and somewhere else.

The engine drives one `KVConnector` (or none) from its own thread, at fixed points, and knows nothing
of transports, threads or the wire. What a request asks of it travels opaquely in `Request.kv_params`.

- Scheduler side: `on_finished(req)` when a prefill-only request's prompt is computed (its first token
  sampled). The connector answers whether it now owns the request's pages; if it does, the engine keeps
  them, counts the request as held (`Engine.holds`) and frees them only when `poll` reports it.
- Worker side: `start_saves()` at the end of each step's update, so the sends it accepted start as soon
  as their KV is in the pool, and `poll()` on every turn of the engine loop, which reports the requests
  whose sends are over (done, failed or past their deadline): their pages may go.

A send cannot be called back once started, so aborting a request whose send is running frees nothing:
the pages go when `poll` reports it. Loads into the pool (a decode worker's reservation, the host, disk
and store tiers) still go through `Engine.reserve` and `engine/prefix_cache.py`'s `PageTier`; they are
to join this interface as its load side.

Implementation: server_runtime/kv_send.py's `KVSendConnector` (a prefill worker's handoff to decode).
"""

from __future__ import annotations

from typing import Protocol

from engine.request import Request


class KVConnector(Protocol):
    def on_finished(self, req: Request) -> bool:
        """`req` (prefill-only) has its prompt's KV in `req.page_ids`: True if the connector sends it and
        owns the pages until `poll` names the request; False (nothing for it to do) frees them now."""
        ...

    def start_saves(self) -> None:
        """At the end of a step's update: start the sends `on_finished` accepted in it."""
        ...

    def poll(self) -> list[str]:
        """The request ids whose sends are over since the last call (each reported once)."""
        ...
