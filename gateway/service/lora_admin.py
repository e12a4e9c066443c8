"""Loading and unloading LoRA adapters at run time on every generation worker (the admin routes of
SGLang and vLLM), and the adapters as model cards.

A load goes to every ready prefill and decode worker at once; if any refuses, the adapter is
unloaded again from those that took it, so no half-loaded adapter is left for the router to find.
An unload goes to every worker that holds the adapter (each waits for its requests on it to end).
Either way the workers are probed again after, so the pool's view of who holds what (and so the
routing and the names requests may give) is current when the route answers; the pool remembers the
loads (`WorkerPool.lora_paths`) and gives them to a worker that comes back without them. A worker's refusal
keeps its status (a bad path or bad files 400, an unknown name 404, an adapter in use or a worker
without slots 400) and its words, with no address and no path but the one the admin sent.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.cluster.worker import Worker
from gateway.errors import APIError, bad_request, public_message
from gateway.service.response_schemas import ModelCard
from gateway.service.state import GatewayState

logger = logging.getLogger(__name__)

_LOAD_TIMEOUT_S = 300.0
_UNLOAD_TIMEOUT_S = 60.0  # the worker waits up to 30 s for the requests on the adapter


async def load_adapter(state: GatewayState, name: str, path: str) -> None:
    """Load the adapter at `path` as `name` on every ready generation worker, or on none."""
    if not name or not path:
        raise bad_request("`lora_name` and `lora_path` are both required", "lora_name" if not name else "lora_path")
    if name in (state.config.served_model_name, state.config.model_path):
        raise bad_request(f"`{name}` is the served model's name: give the adapter another", "lora_name")
    if name in state.pool.lora_adapters():
        raise bad_request(f"The LoRA adapter `{name}` has already been loaded.", "lora_name")
    workers = _generation_workers(state)

    async def load(worker: Worker) -> APIError | None:
        try:
            await worker.client.load_lora_adapter(name, path, _LOAD_TIMEOUT_S)
        except APIError as exc:
            return exc
        return None

    errors = await asyncio.gather(*(load(w) for w in workers))
    failed = [e for e in errors if e is not None]
    if failed:
        loaded = [w for w, e in zip(workers, errors) if e is None]
        await asyncio.gather(*(_unload_quietly(w, name) for w in loaded))
    await _probe(workers)
    if failed:
        raise _public(failed[0], "lora_path", path)
    state.pool.lora_paths[name] = path
    logger.info("LoRA adapter %s loaded from %s on %d workers", name, path, len(workers))


async def unload_adapter(state: GatewayState, name: str) -> None:
    """Unload the adapter `name` from every worker that holds it; 404 when none does."""
    if not name:
        raise bad_request("`lora_name` is required", "lora_name")
    holders = [w for w in state.pool.all_workers() if w.info is not None and name in w.info.lora_names]
    if not holders:
        raise APIError(
            404, f"The LoRA adapter `{name}` cannot be found.", "not_found_error", "lora_name", "model_not_found"
        )

    async def unload(worker: Worker) -> APIError | None:
        try:
            await worker.client.unload_lora_adapter(name, _UNLOAD_TIMEOUT_S)
        except APIError as exc:
            return None if exc.status == 404 else exc  # gone there already: what was asked
        return None

    path = state.pool.lora_paths.pop(name, None)  # first: no worker coming back meanwhile gets it again
    errors = await asyncio.gather(*(unload(w) for w in holders))
    await _probe(holders)
    failed = [e for e in errors if e is not None]
    if failed:
        if path is not None:
            state.pool.lora_paths[name] = path
        raise _public(failed[0], "lora_name")
    logger.info("LoRA adapter %s unloaded from %d workers", name, len(holders))


def adapter_cards(state: GatewayState) -> list[ModelCard]:
    """A card per adapter the workers hold, its `parent` the served model; `root` is the path the
    admin loaded it from, or its name for one the workers were started with (no server path)."""
    return [
        ModelCard(
            id=name,
            created=state.started_at,
            root=state.pool.lora_paths.get(name, name),
            parent=state.config.served_model_name,
        )
        for name in state.pool.lora_adapters()
    ]


def _generation_workers(state: GatewayState) -> list[Worker]:
    """Every ready prefill and decode worker, once per address; 503 when there is none."""
    workers = list({w.address: w for w in state.pool.all_workers() if w.is_ready}.values())
    if not workers:
        raise APIError(503, "no worker is ready", "service_unavailable", code="worker_unavailable")
    return workers


async def _unload_quietly(worker: Worker, name: str) -> None:
    """Undo a load on one worker; a failure is only logged (the probe after shows what is left)."""
    try:
        await worker.client.unload_lora_adapter(name, _UNLOAD_TIMEOUT_S)
    except APIError as exc:
        logger.warning("could not unload the half-loaded LoRA adapter %s from %s: %s", name, worker.address, exc)


async def _probe(workers: list[Worker]) -> None:
    await asyncio.gather(*(w.probe() for w in workers))


def _public(error: APIError, param: str, keep: str = "") -> APIError:
    """A worker's refusal as the admin sees it: its status, never a 500 for the admin's input, no
    address and no path but `keep`."""
    detail = getattr(error, "detail", error.message)
    message = public_message(detail, keep=(keep,)) if error.status < 500 else error.message
    return APIError(
        error.status, message, error.type, param if error.status < 500 else None, error.code, error.retry_after_s
    )
