"""The KV connector: what moves a request's KV between the engine's pool and somewhere else. No torch.

The engine drives one `KVConnector` from its own thread, at fixed points, and knows nothing of
transports, threads or the wire. What a request asks of it travels opaquely in `Request.kv_params`.
This base class moves nothing; a worker's connector overrides the side it serves.

Send side (a prefill worker; server_runtime/kv_send.py's `KVSendConnector`):
- `on_finished(req)` when a prefill-only request's prompt is computed (its first token sampled). The
  connector answers whether it now owns the request's pages; if it does, the engine keeps them, counts
  the request as held (`Engine.holds`) and frees them only when `poll` reports its send over.
- `start_saves()` at the end of each step's update, so the sends it accepted start as soon as their
  KV is in the pool.

Receive side (a decode worker; server_runtime/kv_receive.py's `KVReceiveConnector`): a request whose
prompt KV another process writes into this pool is a request in the engine from the start, `RECEIVING`,
holding its pages (`Engine.reserve`). It is admitted, and decodes, when its load is confirmed: the
caller submits it again with the first token (`ReceivedKV` in its `kv_params`). Until then:
- `on_reserved(req)` when it got its pages: the connector gives it a deadline;
- `on_received(req)` when it is admitted: the connector forgets it;
- `on_dropped(req, written_page_ids, write_settled)` when it ends unadmitted (aborted, expired, weights
  updated): True if a write into those pages may still land, so the connector keeps them (quarantine)
  and `poll` gives them back once that can no longer happen; False frees them now.

Both: `poll()`, on every turn of the engine loop, reports the sends that are over (their pages may go),
the receiving requests past their deadline (the engine drops them) and the quarantined pages now free.
A send cannot be called back once started, so aborting a request whose send is running frees nothing:
the pages go when `poll` reports it.

The prefix cache's slow tiers (host, disk, the cluster's store) load through `engine/prefix_cache.py`'s
`PageTier`, not through a connector.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass(frozen=True, slots=True)
class ReceivedKV:
    """`kv_params` of a request that confirms its reservation: the prompt's KV is in the reserved pages,
    computed elsewhere with the weights `weights_id` names (None: not checked), which sampled
    `first_token` (with `first_logprob`)."""

    first_token: int
    first_logprob: float
    weights_id: str | None = None


@dataclass(frozen=True, slots=True)
class ReservedPages:
    """What `Engine.reserve` answers: the pages to write (`page_ids`, from token `cached_tokens` on)
    and how many leading prompt tokens' KV this worker already holds (a whole number of pages)."""

    page_ids: list[int]
    cached_tokens: int = 0


@dataclass(slots=True)
class KVPoll:
    """What `KVConnector.poll` reports; each id and page list once."""

    sent: list[str] = field(default_factory=list)  # sends over (done, failed, past their deadline)
    expired: list[str] = field(default_factory=list)  # receiving requests past their deadline: drop them
    released: list[int] = field(default_factory=list)  # quarantined pages no write can reach any more


class KVConnector:
    """Moves nothing: prefill-only requests' pages are freed once computed, and no KV is taken in
    (`takes_kv_in`: whether `Engine.reserve` may make receiving requests at all)."""

    takes_kv_in = False

    def on_finished(self, req: Request) -> bool:
        """`req` (prefill-only) has its prompt's KV in `req.page_ids`: True if the connector sends it and
        owns the pages until `poll` names the request; False (nothing for it to do) frees them now."""
        return False

    def start_saves(self) -> None:
        """At the end of a step's update: start the sends `on_finished` accepted in it."""

    def on_reserved(self, req: Request) -> None:
        """`req` is RECEIVING (only with `takes_kv_in`): its `page_ids` cover its prompt, and the pages
        after its first `num_cached_tokens` tokens' are to be written from outside."""

    def on_received(self, req: Request) -> None:
        """`req`'s KV is confirmed and it is admitted: it no longer waits."""

    def on_dropped(self, req: Request, written_page_ids: list[int], write_settled: bool) -> bool:
        """`req` ended while RECEIVING. True if the connector keeps `written_page_ids` (the pages written
        from outside: a write may still land in them, unless `write_settled`) until `poll` releases
        them; False: the engine frees them now."""
        return False

    def poll(self) -> KVPoll:
        """What finished since the last call."""
        return KVPoll()
