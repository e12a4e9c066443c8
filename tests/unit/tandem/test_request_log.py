"""Every log line names the request whose work wrote it, and concurrent requests never mix."""

from __future__ import annotations

import asyncio
import io
import logging

import pytest

from tandem.request_log import NO_REQUEST, RequestIdFilter, bind_request_id, configure_logging


@pytest.fixture
def captured() -> io.StringIO:
    """A handler like the entry point's: our filter and a format naming the request id."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("[%(request_id)s] %(message)s"))
    logger = logging.getLogger("tandem.test_request_log")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)


def test_concurrent_tasks_log_their_own_request_ids(captured: io.StringIO) -> None:
    logger = logging.getLogger("tandem.test_request_log")

    async def handle(request_id: str, gate: asyncio.Event, other_gate: asyncio.Event) -> None:
        bind_request_id(request_id)
        logger.info("start %s", request_id)
        other_gate.set()
        await gate.wait()             # interleave: the other task binds its id in between
        await asyncio.create_task(asyncio.sleep(0))
        logger.info("end %s", request_id)

    async def main() -> None:
        a, b = asyncio.Event(), asyncio.Event()
        await asyncio.gather(handle("req-a", a, b), handle("req-b", b, a))
        logger.info("outside")

    asyncio.run(main())
    lines = captured.getvalue().splitlines()
    assert sorted(lines[:-1]) == ["[req-a] end req-a", "[req-a] start req-a", "[req-b] end req-b",
                                  "[req-b] start req-b"]
    assert lines[-1] == f"[{NO_REQUEST}] outside"


def test_configure_logging_puts_the_process_and_request_in_every_line(capsys) -> None:
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []
    try:
        configure_logging("info", "decode")

        async def rpc() -> None:
            bind_request_id("rid-42")
            logging.getLogger("decode_server.servicer").warning("reservation expired")

        asyncio.run(rpc())
        logging.getLogger("engine.engine").warning("no request here")
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers = saved
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("WARNING [decode] [rid-42] decode_server.servicer: reservation expired")
    assert err[1].endswith("WARNING [decode] [-] engine.engine: no request here")
