"""The prefill and decode workers: membership (static and DNS), readiness and load polling, which
prefill and decode workers may be paired (`compatibility.py`), each worker's KV event stream
(`kv_events.py`, followed while it is a member), and each request's `Route` through them
(`routing.py`). Each `Worker` (`worker.py`) talks to its process through its own `WorkerClient`."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

from gateway.cluster.admission import Admission
from gateway.cluster.compatibility import Mismatch, mismatches
from gateway.cluster.discovery import REFRESH_INTERVAL_S, RoleDiscovery
from gateway.cluster.kv_events import follow_kv_events
from gateway.cluster.prefix_index import PromptPages
from gateway.cluster.routing import Route, Router
from gateway.cluster.worker import Worker
from gateway.cluster.worker_records import KvEvents
from gateway.config import DEFAULT_MAX_QUEUE_WAIT_S, DEFAULT_MAX_QUEUED, RoutingConfig
from gateway.errors import WORKER_RETRY_AFTER_S, APIError
from gateway.metrics import GatewayMetrics
from gateway.records import Role
from tandem.internal_auth import InternalCredentials

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 1.0
# While the pool cannot serve (start-up, or every worker of a role down), probes run this often, so that
# the first worker to be ready is seen within a fraction of a second instead of within a poll interval.
_UNREADY_POLL_INTERVAL_S = 0.2
# A worker whose address left DNS gets no new requests, but its channel stays open this long so
# that streams already on it can finish (the gateway's default --request-timeout).
_RETIRED_CHANNEL_GRACE_S = 3600.0
_RESTORE_TIMEOUT_S = 300.0  # one adapter load on a worker that came back


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the gateway must know about the served model, as the workers report it."""

    model_path: str
    architecture: str
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # Embedding workers (GetModelInfoResponse): the vector size and the smaller sizes allowed.
    is_embedding: bool = False
    embedding_dim: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    is_classifier: bool = False  # the "vectors" are a sequence classifier's `embedding_dim` logits


class WorkerPool:
    """The prefill and decode workers: static addresses, plus `dns:///name:port` ones re-resolved
    (`gateway/cluster/discovery.py`) on every probe round once their refresh interval has passed.
    Every channel carries `credentials` (the internal token, TLS). Handoffs wait for decode KV space
    through `admission` and are placed by `router` (`routing`'s policy). Each ready worker with a
    prefix cache has its KV events followed into its `event_index`, counted in `metrics`."""

    def __init__(
        self,
        prefill_addrs: tuple[str, ...],
        decode_addrs: tuple[str, ...],
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        credentials: InternalCredentials = InternalCredentials(),
        admission: Admission | None = None,
        routing: RoutingConfig = RoutingConfig(),
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.admission = admission or Admission(DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUE_WAIT_S)
        self._metrics = metrics or GatewayMetrics()  # a pool built without an app keeps its own
        self.router = Router(routing)
        self._credentials = credentials
        self._discovery = {
            "prefill": RoleDiscovery("prefill", prefill_addrs, refresh_interval_s),
            "decode": RoleDiscovery("decode", decode_addrs, refresh_interval_s),
        }
        self.workers = {
            role: [Worker(role, a, credentials) for a in d.static_addresses] for role, d in self._discovery.items()
        }
        self._retired: list[tuple[float, Worker]] = []
        self._turns = {role: itertools.count() for role in self.workers}
        self._poller: asyncio.Task | None = None
        self._checked: dict[tuple[str, str], tuple[object, object, tuple[Mismatch, ...]]] = {}
        self._logged: dict[tuple[str, str], tuple[Mismatch, ...]] = {}
        # The LoRA adapters loaded at run time through this gateway (name -> the admin's path): a worker
        # that turns ready again (a restart keeps only its --lora-paths) is given those it lacks, once per turn.
        self.lora_paths: dict[str, str] = {}
        self._restored_turns: dict[str, int] = {}  # address -> the ready turn its adapters were restored for
        self._restores: set[asyncio.Task] = set()
        # Each followed worker's KV event task, with the ready turn it was started in: one that returned
        # (the worker does not know the RPC) is started again only once the worker turns ready again.
        self._kv_feeds: dict[Worker, tuple[int, asyncio.Task]] = {}

    def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for task in self._restores:
            task.cancel()
        feeds = [task for _, task in self._kv_feeds.values()]
        for worker in list(self._kv_feeds):
            self._unfollow(worker)
        await asyncio.gather(*feeds, return_exceptions=True)
        for worker in self.all_workers() + [w for _, w in self._retired]:
            await worker.client.close()

    def all_workers(self) -> list[Worker]:
        return self.workers["prefill"] + self.workers["decode"]

    async def probe_all(self) -> None:
        await self.refresh_members()
        await asyncio.gather(*(w.probe() for w in self.all_workers()))
        self.incompatible_pairs()  # logs each new mismatch once
        self._restore_adapters()
        self._follow_kv_events()

    def _restore_adapters(self) -> None:
        """Start loading the run-time adapters (`lora_paths`) a worker lacks on each worker that has
        turned ready since its last restore, in the background (the probes go on meanwhile)."""
        for worker in self.all_workers():
            if not worker.is_ready or worker.info is None:
                continue
            if self._restored_turns.get(worker.address) == worker.num_ready_changes:
                continue
            self._restored_turns[worker.address] = worker.num_ready_changes
            missing = {n: p for n, p in self.lora_paths.items() if n not in worker.info.lora_names}
            if missing:
                task = asyncio.create_task(_restore(worker, missing))
                self._restores.add(task)
                task.add_done_callback(self._restores.discard)

    def _follow_kv_events(self) -> None:
        """Start following the KV events of each ready worker with a prefix cache that has no stream
        task running (`kv_events.follow_kv_events`); stop for one that came back without a cache."""
        for worker in self.all_workers():
            info = worker.info
            if info is not None and (info.prefix_cache_disabled or info.is_embedding):
                self._unfollow(worker)
                continue
            if not worker.is_ready or info is None:
                continue
            turn, task = self._kv_feeds.get(worker, (-1, None))
            if task is not None and (not task.done() or turn == worker.num_ready_changes):
                continue
            task = asyncio.create_task(follow_kv_events(worker.client, worker.event_index, self._count_kv_events))
            self._kv_feeds[worker] = (worker.num_ready_changes, task)

    def _count_kv_events(self, events: KvEvents) -> None:
        self._metrics.observe_kv_events(events.is_snapshot, len(events.stored), len(events.removed))

    def _unfollow(self, worker: Worker) -> None:
        """Stop following the worker's KV events (it left the pool, or the pool closes)."""
        _, task = self._kv_feeds.pop(worker, (-1, None))
        if task is not None:
            task.cancel()

    def num_kv_events_live(self, role: Role) -> int:
        """Workers of `role` whose KV event stream is live (the router reads their cache exactly)."""
        return sum(w.event_index.is_live for w in self.workers[role])

    async def wait_restores(self) -> None:
        """Until the adapter restores under way have ended."""
        await asyncio.gather(*self._restores, return_exceptions=True)

    def num_ready(self, role: str) -> int:
        return sum(w.is_ready for w in self.workers[role])

    async def refresh_members(self) -> None:
        """Add a worker for each new address of a DNS spec; retire those whose address is gone."""
        for role, discovery in self._discovery.items():
            if not discovery.has_dns:
                continue
            wanted = await discovery.refresh()
            known = {w.address for w in self.workers[role]}
            for worker in self.workers[role]:
                if worker.address not in wanted:
                    logger.info("%s worker %s is gone from DNS; it gets no new requests", role, worker.address)
                    worker.is_ready = False
                    self._unfollow(worker)
                    self._retired.append((time.monotonic() + _RETIRED_CHANNEL_GRACE_S, worker))
            self.workers[role] = [w for w in self.workers[role] if w.address in wanted] + [
                Worker(role, a, self._credentials) for a in wanted if a not in known
            ]
        now = time.monotonic()
        expired = [w for deadline, w in self._retired if deadline <= now]
        self._retired = [(deadline, w) for deadline, w in self._retired if deadline > now]
        for worker in expired:
            await worker.client.close()

    async def _poll_forever(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(_POLL_INTERVAL_S if self.is_ready else _UNREADY_POLL_INTERVAL_S)

    @property
    def is_ready(self) -> bool:
        """Generation: a ready prefill and a ready decode worker that may be paired (same weights and
        KV layout). Embeddings (no decode role): a ready prefill worker."""
        if not self._discovery["decode"].specs:
            return any(w.is_ready for w in self.workers["prefill"])
        return any(self._pairs(frozenset(), routable_only=False).values())

    def lora_adapters(self) -> dict[str, int]:
        """Each LoRA adapter some ready worker holds, with its rank, in name order: what a request may
        name (routing then takes only the workers that hold it)."""
        found = {a.name: a.rank for w in self.all_workers() if w.is_ready and w.info for a in w.info.lora_adapters}
        return dict(sorted(found.items()))

    def pick(self, role: Role) -> Worker:
        """Round-robin over routable workers of `role` (embeddings, admin calls); 503 when there is none."""
        ready = [w for w in self.workers[role] if w.is_routable]
        if not ready:
            raise _unavailable(f"no {role} worker is ready")
        return ready[next(self._turns[role]) % len(ready)]

    def can_route(self, avoid: frozenset[str], lora_name: str = "") -> bool:
        """Whether some pair of routable workers whose addresses are not in `avoid` (and that both hold
        the adapter `lora_name`, if any) may be paired."""
        return any(self._pairs(avoid, lora_name=lora_name).values())

    def route(
        self,
        prompt: PromptPages,
        avoid: frozenset[str] = frozenset(),
        may_prefill_locally: bool = True,
    ) -> Route:
        """The workers of one request, counted in flight on each from now (`Route.end`): by the
        router's policy among routable workers not in `avoid` that may be paired, the decode worker
        first; then that worker alone when the router says it should prefill the prompt itself (and
        `may_prefill_locally`, and its pool could hold the prompt), else a prefill worker it may be
        paired with. 503 when no such pair exists. The router's prefix indexes learn the prompt only
        once the route's first call is sent (`Router.routed`, the trip's call). A prompt run under a
        LoRA adapter (`prompt.lora_name`) goes only to workers that hold it, on both legs."""
        pairs = self._pairs(avoid, lora_name=prompt.lora_name)
        decodes = [d for d, prefills in pairs.items() if prefills]
        if not decodes:
            raise self._no_pair_error(prompt.lora_name)
        decode = self.router.choose_decode(prompt, decodes)
        prefills = pairs[decode.worker]
        local = None
        if may_prefill_locally and _fits(decode.worker, len(prompt)):
            local = self.router.local_reason(len(prompt), decode.estimated_cached_tokens, prefills)
        policy = self.router.config.policy
        if local is not None:
            route = Route(None, decode.worker, policy, local, decode.reason)
        else:
            prefill = self.router.choose_prefill(prompt, prefills)
            route = Route(
                prefill.worker,
                decode.worker,
                policy,
                prefill.reason,
                decode.reason,
                prefill.estimated_cached_tokens,
                prefill.page_hashes,
            )
        route.estimated_decode_cached_tokens = decode.estimated_cached_tokens
        route.decode_page_hashes = decode.page_hashes
        route.begin()
        return route

    def loads(self) -> list[tuple[str, str, dict[str, float]]]:
        """Each worker's load as the router sees it: (role, address, measures), for the metrics."""
        found = []
        for worker in self.all_workers():
            measures = {"in_flight": float(worker.num_in_flight)}
            if worker.load is not None:
                measures.update(
                    running=worker.load.num_running, waiting=worker.load.num_waiting, free_pages=worker.num_free_pages
                )
            found.append((worker.role.value, worker.address, measures))
        return found

    def incompatible_pairs(self) -> list[tuple[Worker, Worker, tuple[Mismatch, ...]]]:
        """Every (prefill, decode) pair of workers that reported their model and may not be paired,
        with what differs. A pair's mismatch is logged once (again only if it changes)."""
        found = []
        for prefill in self.workers["prefill"]:
            for decode in self.workers["decode"]:
                if prefill.info is not None and decode.info is not None and (diff := self._mismatches(prefill, decode)):
                    found.append((prefill, decode, diff))
        return found

    def _pairs(
        self, avoid: frozenset[str], routable_only: bool = True, lora_name: str = ""
    ) -> dict[Worker, list[Worker]]:
        """Each usable decode worker with the usable prefill workers it may be paired with; with a
        `lora_name`, only the workers that hold that adapter are usable."""

        def usable(w: Worker) -> bool:
            if lora_name and not _holds(w, lora_name):
                return False
            return (w.is_routable if routable_only else w.is_ready) and w.address not in avoid

        prefills = [p for p in self.workers["prefill"] if usable(p)]
        return {d: [p for p in prefills if not self._mismatches(p, d)] for d in self.workers["decode"] if usable(d)}

    def _mismatches(self, prefill: Worker, decode: Worker) -> tuple[Mismatch, ...]:
        """What differs between two workers' model infos (cached until either reports again)."""
        if prefill.info is None or decode.info is None:
            return (Mismatch("model_info", "unreported", "unreported"),)
        key = (prefill.address, decode.address)
        cached = self._checked.get(key)
        if cached is not None and cached[0] is prefill.info and cached[1] is decode.info:
            return cached[2]
        found = mismatches(prefill.info, decode.info)
        self._checked[key] = (prefill.info, decode.info, found)
        if found and self._logged.get(key) != found:
            logger.warning(
                "prefill worker %s and decode worker %s are never paired: %s",
                prefill.address,
                decode.address,
                "; ".join(str(m) for m in found),
            )
        self._logged[key] = found
        return found

    def _no_pair_error(self, lora_name: str = "") -> APIError:
        """503 naming the role when it has no ready worker at all (or none holding the adapter
        `lora_name`), else saying none may be paired."""
        for role in ("prefill", "decode"):
            if not any(w.is_routable for w in self.workers[role]):
                return _unavailable(f"no {role} worker is ready")
        for role in ("prefill", "decode"):
            if lora_name and not any(w.is_routable and _holds(w, lora_name) for w in self.workers[role]):
                return _unavailable(f"no ready {role} worker holds the LoRA adapter `{lora_name}`")
        return _unavailable(
            "no ready prefill and decode workers may be paired: they must hold the same model weights and KV "
            "layout (update them to the same checkpoint and settings; /get_server_info lists what differs)"
        )

    def limits(self) -> ModelLimits:
        """The tightest limits over every worker that has reported; 503 before any has."""
        infos = [w.info for w in self.all_workers() if w.info is not None]
        if not infos:
            raise APIError(
                503, "no worker has reported its model yet", "service_unavailable", code="worker_unavailable"
            )
        first = infos[0]
        return ModelLimits(
            model_path=first.model_path,
            architecture=first.architecture,
            context_len=min(i.context_len for i in infos),
            vocab_size=first.vocab_size,
            eos_token_ids=tuple(first.eos_token_ids),
            is_embedding=first.is_embedding,
            embedding_dim=first.embedding_dim,
            is_matryoshka=first.is_matryoshka,
            matryoshka_dimensions=tuple(first.matryoshka_dimensions),
            is_classifier=first.is_classifier,
        )


async def _restore(worker: Worker, adapters: dict[str, str]) -> None:
    """Load `adapters` (name -> path) on a worker that came back without them, then probe it so that
    routing sees them; a refusal is logged (the worker serves the others and the base model)."""
    for name, path in adapters.items():
        try:
            await worker.client.load_lora_adapter(name, path, _RESTORE_TIMEOUT_S)
        except APIError as exc:
            logger.warning("could not load LoRA adapter %s again on %s: %s", name, worker.address, exc.message)
        else:
            logger.info("LoRA adapter %s loaded again on %s", name, worker.address)
    await worker.probe()


def _holds(worker: Worker, lora_name: str) -> bool:
    """Whether the worker reported the LoRA adapter `lora_name` loaded."""
    return worker.info is not None and lora_name in worker.info.lora_names


def _fits(decode: Worker, prompt_len: int) -> bool:
    """Whether the decode worker's whole pool could hold the prompt (prefilling it there may wait for pages)."""
    info = decode.info
    return info is not None and prompt_len < info.num_pages * max(1, info.kv_layout.page_size)


def _unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", code="worker_unavailable", retry_after_s=WORKER_RETRY_AFTER_S)
