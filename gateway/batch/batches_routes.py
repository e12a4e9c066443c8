"""OpenAI's /v1/batches: create, retrieve, list, cancel, for /v1/chat/completions and /v1/completions.

Bodies match the OpenAI SDK's `Batch`. The work itself is done by `gateway/batch/runner.py`.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from gateway.api.json_route import JSONRoute
from gateway.batch.files_routes import check_limit, list_object, store_errors
from gateway.batch.lines import BATCH_ENDPOINTS
from gateway.batch.records import BatchRecord
from gateway.batch.runner import BatchService, batch_service
from gateway.batch.store import COMPLETION_WINDOW_S
from gateway.errors import APIError, bad_request

router = APIRouter(route_class=JSONRoute)

MAX_LIST_LIMIT = 100
_MAX_METADATA_KEYS, _MAX_METADATA_KEY_LEN, _MAX_METADATA_VALUE_LEN = 16, 64, 512


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict | None = None  # accepted; output files do not expire here


@router.post("/v1/batches")
async def create_batch(body: CreateBatchRequest, service: BatchService = Depends(batch_service)) -> dict:
    if body.endpoint not in BATCH_ENDPOINTS:
        raise bad_request(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {body.endpoint!r}", "endpoint")
    if body.completion_window not in COMPLETION_WINDOW_S:
        raise bad_request(
            f"completion_window must be one of {', '.join(COMPLETION_WINDOW_S)}, got {body.completion_window!r}",
            "completion_window",
        )
    _check_metadata(body.metadata)
    store = service.store
    with store_errors():
        input_file = await store.run(store.get_file, body.input_file_id)
    if input_file.purpose != "batch":
        raise bad_request(
            f"file {input_file.id} has purpose {input_file.purpose!r}; a batch needs a file uploaded "
            "with purpose 'batch'",
            "input_file_id",
        )
    batch = await store.run(store.create_batch, body.endpoint, input_file.id, body.completion_window, body.metadata)
    service.runner.submit(batch.id)
    return batch_object(batch)


@router.get("/v1/batches")
async def list_batches(
    after: str | None = None, limit: int = 20, service: BatchService = Depends(batch_service)
) -> dict:
    check_limit(limit, MAX_LIST_LIMIT)
    with store_errors():
        batches, has_more = await service.store.run(service.store.list_batches, after, limit)
    return list_object([batch_object(b) for b in batches], has_more)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, service: BatchService = Depends(batch_service)) -> dict:
    with store_errors():
        return batch_object(await service.store.run(service.store.get_batch, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, service: BatchService = Depends(batch_service)):
    """validating/in_progress -> cancelling (answered at once); the runner then stops the batch's lines and
    finalizes it as cancelled. 409 for a batch that has already finished or is finalizing."""
    try:
        with store_errors():
            batch = await service.store.run(service.store.request_cancel, batch_id)
    except APIError as exc:
        if exc.status != 409:
            raise
        # the OpenAI SDK retries a 409 (a lock timeout to it) unless told not to
        return JSONResponse(exc.body(), status_code=exc.status, headers={"x-should-retry": "false"})
    service.runner.cancel(batch_id)
    return batch_object(batch)


def batch_object(batch: BatchRecord) -> dict:
    errors = {"object": "list", "data": [e.to_dict() for e in batch.errors]} if batch.errors else None
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status.value,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": batch.created_at,
        "in_progress_at": batch.in_progress_at,
        "expires_at": batch.expires_at,
        "finalizing_at": batch.finalizing_at,
        "completed_at": batch.completed_at,
        "failed_at": batch.failed_at,
        "expired_at": None,
        "cancelling_at": batch.cancelling_at,
        "cancelled_at": batch.cancelled_at,
        "request_counts": {"total": batch.num_total, "completed": batch.num_completed, "failed": batch.num_failed},
        "metadata": batch.metadata,
        "model": None,
        "usage": None,
    }


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > _MAX_METADATA_KEYS:
        raise bad_request(f"metadata has {len(metadata)} keys; at most {_MAX_METADATA_KEYS} are allowed", "metadata")
    for key, value in metadata.items():
        if len(key) > _MAX_METADATA_KEY_LEN or len(value) > _MAX_METADATA_VALUE_LEN:
            raise bad_request(
                f"metadata keys are at most {_MAX_METADATA_KEY_LEN} characters and values at most "
                f"{_MAX_METADATA_VALUE_LEN}",
                f"metadata.{key[:64]}",
            )
