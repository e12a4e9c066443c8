"""SGLang's admin operations: the server's and workers' info, the end-to-end health check, flushing
the prefix caches and reloading the weights on every worker."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import tandem
from gateway.cluster.worker import Worker
from gateway.cluster.worker_errors import WorkerError
from gateway.cluster.worker_records import FlushResult, UpdateResult
from gateway.errors import APIError, public_message
from gateway.records import FinishReason, Role
from gateway.service.generation import GenerationRequest
from gateway.service.state import GatewayState
from tandem.sampling import SamplingSpec

logger = logging.getLogger(__name__)

_INFO_TIMEOUT_S = 5.0
_UPDATE_TIMEOUT_S = 600.0

# Never in a response: the keys, and the internal plane's token and TLS file paths.
_SECRET_CONFIG_FIELDS = frozenset({"api_key", "admin_api_key", "internal"})


async def server_info(state: GatewayState) -> dict:
    """The gateway's arguments plus, per worker, its role, address, pool size and use, and version; and
    every prefill/decode pair that is never paired, with what differs (the compatibility handshake)."""
    gateway = {k: v for k, v in dataclasses.asdict(state.config).items() if k not in _SECRET_CONFIG_FIELDS}
    workers = await asyncio.gather(*(_worker_info(w) for w in state.pool.all_workers()))
    incompatible = [
        {"prefill": p.address, "decode": d.address, "mismatches": [dataclasses.asdict(m) for m in found]}
        for p, d, found in state.pool.incompatible_pairs()
    ]
    return {**gateway, "version": tandem.version(), "workers": list(workers), "incompatible_pairs": incompatible}


async def is_healthy(state: GatewayState) -> bool:
    """Whether one token makes it through prefill -> KV transfer -> decode (an embedding server: one
    tiny embedding through a prefill worker). A refusal on the way (no worker, no pages) raises its
    `APIError`."""
    if state.config.is_embedding:
        worker = state.pool.pick(Role.PREFILL)
        await worker.client.embed("health", [[0]], None, timeout_s=_INFO_TIMEOUT_S)
        return True
    limits = state.pool.limits()
    prompt = [limits.eos_token_ids[0] if limits.eos_token_ids else 0]
    sampling = SamplingSpec(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    result = await state.generation.generate(GenerationRequest(prompt, sampling))
    return bool(result.output_ids) and result.finish is not None and result.finish.reason is not FinishReason.ABORT


async def flush_caches(state: GatewayState) -> FlushResult:
    """Flush every worker's prefix cache; a failure (a worker with requests in flight refuses) names
    the reasons, with no address in them."""

    async def flush(worker: Worker) -> FlushResult:
        try:  # an embedding worker keeps no cache: its answer is a success, "no cache"
            return await worker.client.flush_cache(timeout_s=_INFO_TIMEOUT_S)
        except APIError as exc:
            return FlushResult(success=False, message=exc.message)

    replies = await asyncio.gather(*(flush(w) for w in state.pool.all_workers()))
    if any(r.success for r in replies):
        state.pool.router.forget_all()  # the router's view of the prefix caches: some are empty now
    if all(r.success for r in replies):
        return FlushResult(success=True, message="")
    return FlushResult(success=False, message=public_message("; ".join(r.message for r in replies if not r.success)))


async def update_weights(state: GatewayState, model_path: str) -> UpdateResult:
    """Every worker reloads its weights from `model_path` in place; requests in flight are aborted
    (they fail cleanly, never mixing weights). A failure's message keeps the caller's own path only."""

    async def update(worker: Worker) -> UpdateResult:
        try:
            return await worker.client.update_weights(model_path, timeout_s=_UPDATE_TIMEOUT_S)
        except APIError as exc:
            return UpdateResult(success=False, message=exc.message)

    replies = await asyncio.gather(*(update(w) for w in state.pool.all_workers()))
    state.pool.router.forget_all()  # an update flushes a worker's prefix cache
    failed = [r for r in replies if not r.success]
    if failed:
        logger.warning("update_weights_from_disk failed: %s", "; ".join(r.message for r in failed))
        return UpdateResult(success=False, message=public_message(failed[0].message, keep=(model_path,)))
    return UpdateResult(success=True, message="Succeeded to update model weights.")


async def _worker_info(worker: Worker) -> dict:
    entry = {
        "role": worker.role,
        "address": worker.address,
        "ready": worker.is_ready,
        "routable": worker.is_routable,
        "num_in_flight": worker.num_in_flight,  # this gateway's requests there now
    }
    info = worker.info
    if info is not None:
        entry.update(
            version=info.version,
            model_path=info.model_path,
            implementation=info.implementation,
            context_len=info.context_len,
            page_size=info.kv_layout.page_size,
            max_total_num_tokens=info.num_pages * info.kv_layout.page_size,
            kv_pool_bytes=info.num_pages * info.kv_layout.page_bytes,
            kv_dtype=info.kv_layout.dtype,
            kv_order=info.kv_layout.order,
            num_layers=info.kv_layout.num_layers,
            num_attention_heads=info.num_attention_heads,
            num_kv_heads=info.kv_layout.num_kv_heads,
            head_dim=info.kv_layout.head_dim,
            weights_id=info.weights_id,
            lora_adapters={a.name: a.rank for a in info.lora_adapters},
            max_loras=info.max_loras,
        )
    try:
        load = await worker.client.load(timeout_s=_INFO_TIMEOUT_S)
    except WorkerError as exc:
        entry["error"] = exc.detail  # an admin view: the worker's own words
        return entry
    num_unused = load.num_free_pages + load.num_cached_pages
    entry.update(
        num_running_reqs=load.num_running,
        num_waiting_reqs=load.num_waiting,
        num_free_pages=load.num_free_pages,
        num_cached_pages=load.num_cached_pages,
        num_total_pages=load.num_total_pages,
        kv_pool_usage=round(1 - num_unused / max(1, load.num_total_pages), 4),
    )
    return entry
