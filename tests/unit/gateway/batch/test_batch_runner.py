"""BatchRunner with a real store, its lines answered by a small echo in place of the gateway's operations
(the real ones, `gateway/service/batch_line.py`, are covered end to end in tests/e2e/test_batches.py)."""

from __future__ import annotations

import asyncio
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from gateway.batch.records import BatchRecord, BatchStatus
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore
from gateway.batch.traffic import InteractiveTraffic

ENDPOINT = "/v1/chat/completions"


@dataclass
class Echo:
    """Answers a line {"echo": content}, or 400 for content "bad"; contents in `blocked` wait for `release`."""

    blocked: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)
    num_running: int = 0
    max_running: int = 0
    num_cancelled: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def answer(self, endpoint: str, body: str) -> tuple[int, dict]:
        assert endpoint == ENDPOINT
        content = json.loads(body)["messages"][0]["content"]
        self.calls.append(content)
        self.num_running += 1
        self.max_running = max(self.max_running, self.num_running)
        try:
            await asyncio.sleep(0.01)
            if content in self.blocked:
                await self.release.wait()
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        finally:
            self.num_running -= 1
        if content == "bad":
            return 400, {"error": {"message": "bad content", "type": "invalid_request_error", "param": "messages",
                                   "code": None}}
        return 200, {"echo": content}


def input_lines(contents: list[str]) -> bytes:
    return b"".join(json.dumps({"custom_id": f"id-{c}", "method": "POST", "url": ENDPOINT,
                                "body": {"messages": [{"role": "user", "content": c}]}}).encode() + b"\n"
                    for c in contents)


async def create(store: BatchStore, contents: list[str]) -> BatchRecord:
    file = await store.run(store.add_file, io.BytesIO(input_lines(contents)), "in.jsonl", "batch")
    return await store.run(store.create_batch, ENDPOINT, file.id, "24h")


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def finished(store: BatchStore, batch_id: str) -> BatchRecord:
    async def is_finished() -> bool:
        return (await store.run(store.get_batch, batch_id)).status.is_finished
    await until(is_finished)
    return await store.run(store.get_batch, batch_id)


def lines_of(store: BatchStore, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in store.file_path(file_id).read_text().splitlines()]


def test_every_line_runs_once_with_at_most_n_at_a_time(tmp_path: Path) -> None:
    async def main() -> None:
        store, echo = BatchStore(tmp_path), Echo()
        runner = BatchRunner(store, echo.answer, InteractiveTraffic(1), 3, lambda: True)
        contents = [str(i) for i in range(20)] + ["bad"]
        batch = await create(store, contents)
        runner.submit(batch.id)
        batch = await finished(store, batch.id)
        await runner.stop()
        assert batch.status is BatchStatus.COMPLETED
        assert (batch.num_total, batch.num_completed, batch.num_failed) == (21, 20, 1)
        assert sorted(echo.calls) == sorted(contents) and echo.max_running == 3
        output = lines_of(store, batch.output_file_id)
        assert [o["custom_id"] for o in output] == [f"id-{i}" for i in range(20)]
        assert [o["response"]["body"]["echo"] for o in output] == contents[:20]
        [error] = lines_of(store, batch.error_file_id)
        assert error["custom_id"] == "id-bad" and error["response"]["status_code"] == 400
        assert error["error"] == {"code": "invalid_request_error", "message": "bad content"}
        store.close()

    asyncio.run(main())


def test_new_lines_wait_while_interactive_requests_are_in_flight(tmp_path: Path) -> None:
    async def main() -> None:
        store, echo, traffic = BatchStore(tmp_path), Echo(), InteractiveTraffic(1)
        runner = BatchRunner(store, echo.answer, traffic, 4, lambda: True)
        traffic.enter()                       # an interactive request is running
        batch = await create(store, ["a", "b"])
        runner.submit(batch.id)
        await asyncio.sleep(0.3)
        assert echo.calls == []
        assert (await store.run(store.get_batch, batch.id)).status is BatchStatus.IN_PROGRESS
        traffic.leave()
        assert (await finished(store, batch.id)).num_completed == 2
        await runner.stop()
        store.close()

    asyncio.run(main())


def test_lines_wait_for_ready_workers(tmp_path: Path) -> None:
    async def main() -> None:
        store, echo, is_ready = BatchStore(tmp_path), Echo(), [False]
        runner = BatchRunner(store, echo.answer, InteractiveTraffic(1), 4, lambda: is_ready[0])
        batch = await create(store, ["a"])
        runner.submit(batch.id)
        await asyncio.sleep(0.7)
        assert echo.calls == []
        is_ready[0] = True
        assert (await finished(store, batch.id)).num_completed == 1
        await runner.stop()
        store.close()

    asyncio.run(main())


def test_cancel_stops_running_lines_and_keeps_the_answers(tmp_path: Path) -> None:
    async def main() -> None:
        store, echo = BatchStore(tmp_path), Echo(blocked={"2"})
        runner = BatchRunner(store, echo.answer, InteractiveTraffic(1), 1, lambda: True)
        batch = await create(store, [str(i) for i in range(5)])
        runner.submit(batch.id)
        await until(lambda: _is_running(echo, "2"))
        await store.run(store.request_cancel, batch.id)
        runner.cancel(batch.id)
        batch = await finished(store, batch.id)
        await runner.stop()
        assert batch.status is BatchStatus.CANCELLED
        assert (batch.num_total, batch.num_completed, batch.num_failed) == (5, 2, 0)
        assert [o["custom_id"] for o in lines_of(store, batch.output_file_id)] == ["id-0", "id-1"]
        assert batch.error_file_id is None and echo.num_cancelled == 1 and echo.calls == ["0", "1", "2"]
        store.close()

    asyncio.run(main())


def test_a_restarted_runner_resumes_only_unanswered_lines(tmp_path: Path) -> None:
    async def first_run() -> str:
        store, echo = BatchStore(tmp_path), Echo(blocked={"3", "4"})
        runner = BatchRunner(store, echo.answer, InteractiveTraffic(1), 2, lambda: True)
        batch = await create(store, [str(i) for i in range(6)])
        runner.submit(batch.id)
        await until(lambda: _is_running(echo, "3", "4"))
        await runner.stop()                 # the gateway stops: lines 3 and 4 are cut off unanswered
        assert echo.num_cancelled == 2
        assert (await store.run(store.get_batch, batch.id)).num_completed == 3
        store.close()
        return batch.id

    async def second_run(batch_id: str) -> None:
        store, echo = BatchStore(tmp_path), Echo()
        runner = BatchRunner(store, echo.answer, InteractiveTraffic(1), 2, lambda: True)
        await runner.start()
        batch = await finished(store, batch_id)
        await runner.stop()
        assert sorted(echo.calls) == ["3", "4", "5"]
        assert batch.status is BatchStatus.COMPLETED and batch.num_completed == 6
        assert [o["custom_id"] for o in lines_of(store, batch.output_file_id)] == [f"id-{i}" for i in range(6)]
        store.close()

    asyncio.run(second_run(asyncio.run(first_run())))


async def _is_running(echo: Echo, *contents: str) -> bool:
    return all(c in echo.calls for c in contents) and echo.num_running == len(contents)
