"""The prefill and decode workers: readiness tracking and round-robin picking of prefill/decode pairs
that hold the same weights. Each `Worker` talks to its process through its own `WorkerClient`."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

from gateway.cluster.admission import Admission
from gateway.cluster.client import WorkerClient
from gateway.cluster.discovery import REFRESH_INTERVAL_S, RoleDiscovery
from gateway.cluster.worker_records import ModelInfo
from gateway.config import DEFAULT_MAX_QUEUE_WAIT_S, DEFAULT_MAX_QUEUED
from gateway.errors import WORKER_RETRY_AFTER_S, APIError
from gateway.records import Role
from tandem.internal_auth import InternalCredentials

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 1.0
_PROBE_TIMEOUT_S = 2.0
# A worker whose address left DNS gets no new requests, but its channel stays open this long so
# that streams already on it can finish (the gateway's default --request-timeout).
_RETIRED_CHANNEL_GRACE_S = 3600.0


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


class Worker:
    """One worker as the pool sees it: its `client`, and whether it is ready (its health service says
    SERVING and it reported its model `info`, kept from the last probe that got one)."""

    def __init__(
        self, role: Role | str, address: str, credentials: InternalCredentials = InternalCredentials()
    ) -> None:
        self.client = WorkerClient(role, address, credentials)
        self.is_ready = False
        self.info: ModelInfo | None = None

    @property
    def role(self) -> Role:
        return self.client.role

    @property
    def address(self) -> str:
        return self.client.address

    async def probe(self) -> bool:
        """Ask the worker's health service, then its model info (a restarted worker may come back with
        another context length or pool, and an update changes its weights)."""
        info = await self.client.model_info(_PROBE_TIMEOUT_S)
        ready = info is not None
        if info is not None:
            self.info = info
        if ready != self.is_ready:
            logger.info("%s worker %s is %s", self.role, self.address, "ready" if ready else "not ready")
        self.is_ready = ready
        return ready

    async def responds(self) -> bool:
        """Whether the worker answers a health check now; one that does not is marked unready until
        the next probe round finds it answering again."""
        if await self.client.responds(_PROBE_TIMEOUT_S):
            return True
        if self.is_ready:
            logger.warning("%s worker %s stopped responding; it gets no new requests", self.role, self.address)
        self.is_ready = False
        return False

    @property
    def weights_id(self) -> str | None:
        return self.info.weights_id if self.info is not None else None


class WorkerPool:
    """The prefill and decode workers: static addresses, plus `dns:///name:port` ones re-resolved
    (`gateway/cluster/discovery.py`) on every probe round once their refresh interval has passed.
    Every channel carries `credentials` (the internal token, TLS). Handoffs wait for decode KV space
    through `admission`."""

    def __init__(
        self,
        prefill_addrs: tuple[str, ...],
        decode_addrs: tuple[str, ...],
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        credentials: InternalCredentials = InternalCredentials(),
        admission: Admission | None = None,
    ) -> None:
        self.admission = admission or Admission(DEFAULT_MAX_QUEUED, DEFAULT_MAX_QUEUE_WAIT_S)
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

    def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for worker in self.all_workers() + [w for _, w in self._retired]:
            await worker.client.close()

    def all_workers(self) -> list[Worker]:
        return self.workers["prefill"] + self.workers["decode"]

    async def probe_all(self) -> None:
        await self.refresh_members()
        await asyncio.gather(*(w.probe() for w in self.all_workers()))

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
            await asyncio.sleep(_POLL_INTERVAL_S)

    @property
    def is_ready(self) -> bool:
        """Generation: a ready prefill and a ready decode worker that hold the same weights.
        Embeddings (no decode role): a ready prefill worker."""
        if not self._discovery["decode"].specs:
            return any(w.is_ready for w in self.workers["prefill"])
        return bool(self._paired_decodes())

    def pick(self, role: str) -> Worker:
        """Round-robin over ready workers of `role`; 503 when none is ready."""
        ready = [w for w in self.workers[role] if w.is_ready]
        if not ready:
            raise APIError(
                503,
                f"no {role} worker is ready",
                "service_unavailable",
                code="worker_unavailable",
                retry_after_s=WORKER_RETRY_AFTER_S,
            )
        return ready[next(self._turns[role]) % len(ready)]

    def pick_pair(self) -> tuple[Worker, Worker]:
        """A ready (prefill, decode) pair holding the same weights, round-robin over decode workers
        and then over the prefill workers that match; 503 when there is none."""
        decodes = self._paired_decodes()
        if not decodes:
            for role in ("prefill", "decode"):
                self.pick(role)  # 503 naming the role when it has no ready worker at all
            raise APIError(
                503,
                "no ready prefill and decode workers hold the same model weights (update them to the same checkpoint)",
                "service_unavailable",
                code="worker_unavailable",
                retry_after_s=WORKER_RETRY_AFTER_S,
            )
        decode = decodes[next(self._turns["decode"]) % len(decodes)]
        prefills = [w for w in self.workers["prefill"] if w.is_ready and w.weights_id == decode.weights_id]
        return prefills[next(self._turns["prefill"]) % len(prefills)], decode

    def _paired_decodes(self) -> list[Worker]:
        """Ready decode workers with a ready prefill worker of the same weights."""
        prefill_weights = {w.weights_id for w in self.workers["prefill"] if w.is_ready}
        return [w for w in self.workers["decode"] if w.is_ready and w.weights_id in prefill_weights]

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
        )
