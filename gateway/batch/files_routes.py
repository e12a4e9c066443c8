"""OpenAI's /v1/files: upload (multipart, purpose `batch`), list, retrieve, content, delete.

Bodies match the OpenAI SDK's `FileObject` and `FileDeleted`; a list is `{"object": "list", "data",
"first_id", "last_id", "has_more"}`, as its cursor pages expect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fastapi import APIRouter, Depends, File, Form, UploadFile
from fastapi.responses import FileResponse

from gateway.api.json_route import JSONRoute
from gateway.batch.records import ConflictError, FileRecord, NotFoundError
from gateway.batch.runner import BatchService, batch_service
from gateway.errors import APIError, bad_request

router = APIRouter(route_class=JSONRoute)

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
MAX_LIST_LIMIT = 10_000
MAX_UPLOAD_BODY_BYTES = MAX_FILE_BYTES + 1024 * 1024  # the file, the form's other fields and boundaries


@router.post("/v1/files")
async def create_file(
    file: UploadFile = File(...), purpose: str = Form(...), service: BatchService = Depends(batch_service)
) -> dict:
    if purpose != "batch":
        raise bad_request(f"purpose must be 'batch' (the only purpose this server stores), got {purpose!r}", "purpose")
    if file.size is not None and file.size > MAX_FILE_BYTES:
        raise bad_request(f"the file has {file.size} bytes; at most {MAX_FILE_BYTES} are allowed", "file")
    store = service.store
    record = await store.run(store.add_file, file.file, file.filename or "upload.jsonl", purpose)
    return file_object(record)


@router.get("/v1/files")
async def list_files(
    purpose: str | None = None,
    after: str | None = None,
    limit: int = MAX_LIST_LIMIT,
    order: str = "desc",
    service: BatchService = Depends(batch_service),
) -> dict:
    check_limit(limit, MAX_LIST_LIMIT)
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
    store = service.store
    with store_errors():
        records, has_more = await store.run(store.list_files, purpose, after, limit, order)
    return list_object([file_object(r) for r in records], has_more)


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, service: BatchService = Depends(batch_service)) -> dict:
    with store_errors():
        return file_object(await service.store.run(service.store.get_file, file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, service: BatchService = Depends(batch_service)) -> FileResponse:
    with store_errors():
        record = await service.store.run(service.store.get_file, file_id)
    return FileResponse(service.store.file_path(record.id), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, service: BatchService = Depends(batch_service)) -> dict:
    with store_errors():
        await service.store.run(service.store.delete_file, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def file_object(record: FileRecord) -> dict:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.num_bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def list_object(data: list[dict], has_more: bool) -> dict:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def check_limit(limit: int, maximum: int) -> None:
    if not 1 <= limit <= maximum:
        raise bad_request(f"limit must be between 1 and {maximum}, got {limit}", "limit")


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    """Store errors as HTTP errors: unknown id -> 404, wrong status -> 409."""
    try:
        yield
    except NotFoundError as exc:
        raise APIError(404, str(exc), "not_found_error", code="not_found") from None
    except ConflictError as exc:
        raise APIError(409, str(exc), "invalid_request_error", code="conflict") from None
