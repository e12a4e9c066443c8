"""ResponseStore on a real SQLite database in a temporary directory; BackgroundResponses' tasks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.service.responses_store import BackgroundResponses, ResponseNotFound, ResponseStore, StoredResponse


def _row(response_id: str, status: str, text: str = "{}") -> StoredResponse:
    return StoredResponse(response_id, 1, status, text, "[]")


def test_rows_are_kept_across_reopening_and_deleted_once(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    store.put(_row("resp_a", "completed", '{"x": 1}'))
    store.close()
    store = ResponseStore(tmp_path)
    assert store.get("resp_a") == _row("resp_a", "completed", '{"x": 1}')
    store.delete("resp_a")
    with pytest.raises(ResponseNotFound):
        store.get("resp_a")
    with pytest.raises(ResponseNotFound):
        store.delete("resp_a")
    store.close()


def test_only_unfinished_rows_are_updated_and_listed(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    store.put(_row("resp_q", "queued"))
    store.put(_row("resp_done", "completed"))
    assert [r.id for r in store.unfinished()] == ["resp_q"]
    assert store.update_unfinished("resp_q", "cancelled", '{"c": 1}')
    assert not store.update_unfinished("resp_q", "completed", "{}")  # the cancel came first and stays
    assert not store.update_unfinished("resp_done", "failed", "{}")
    assert not store.update_unfinished("resp_gone", "failed", "{}")
    assert store.get("resp_q") == StoredResponse("resp_q", 1, "cancelled", '{"c": 1}', "[]")
    assert store.get("resp_done").status == "completed"
    assert store.unfinished() == []
    store.close()


def test_run_calls_the_store_on_its_own_thread(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)

    async def main() -> StoredResponse:
        await store.run(store.put, _row("resp_t", "completed"))
        return await store.run(store.get, "resp_t")

    assert asyncio.run(main()).id == "resp_t"
    store.close()


def test_background_tasks_are_cancelled_once_and_all_on_close() -> None:
    async def main() -> None:
        background = BackgroundResponses()
        started = asyncio.Event()

        async def forever() -> None:
            started.set()
            await asyncio.sleep(3600)

        async def quick() -> None:
            return None

        background.start("resp_long", forever())
        background.start("resp_quick", quick())
        background.start("resp_other", forever())
        await started.wait()
        await asyncio.sleep(0)
        assert not await background.cancel("resp_quick")  # already finished
        assert await background.cancel("resp_long")
        assert not await background.cancel("resp_long")
        await background.close()
        assert not await background.cancel("resp_other")

    asyncio.run(main())
