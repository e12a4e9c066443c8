"""BatchStore on a real SQLite database and real files in a temporary data directory."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gateway.batch.lines import BatchError, parse_input
from gateway.batch.records import BatchStatus, ConflictError, DataDirInUseError, NotFoundError
from gateway.batch.store import BatchStore

ROOT = Path(__file__).resolve().parents[3]
ENDPOINT = "/v1/chat/completions"


def request_line(custom_id: str, url: str = "/chat/completions") -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": custom_id}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode() + b"\n"


@pytest.fixture
def store(tmp_path: Path):
    store = BatchStore(tmp_path / "data")
    yield store
    store.close()


def add_input(store: BatchStore, lines: list[bytes]):
    return store.add_file(io.BytesIO(b"".join(lines)), "in.jsonl", "batch")


def started_batch(store: BatchStore, lines: list[bytes]):
    file = add_input(store, lines)
    batch = store.create_batch(ENDPOINT, file.id, "24h")
    parsed = parse_input(store.file_path(file.id).read_bytes().splitlines(keepends=True), ENDPOINT)
    assert parsed.errors == ()
    return store.start_batch(batch.id, parsed.lines)


def answer(store: BatchStore, batch_id: str, line, is_error: bool = False) -> bool:
    return store.record_result(batch_id, line.line_index, json.dumps({"custom_id": line.custom_id}), is_error)


def test_files_round_trip_list_and_delete(store: BatchStore) -> None:
    first = store.add_file(io.BytesIO(b"a" * 10), "a.jsonl", "batch")
    second = store.add_file(io.BytesIO(b"b" * 3), "b.jsonl", "batch")
    assert (first.num_bytes, first.filename, first.purpose) == (10, "a.jsonl", "batch")
    assert store.get_file(first.id) == first
    assert store.file_path(second.id).read_bytes() == b"bbb"
    assert [f.id for f in store.list_files()[0]] == [second.id, first.id]          # newest first
    assert [f.id for f in store.list_files(order="asc")[0]] == [first.id, second.id]
    assert store.list_files(limit=1) == ([second], True)
    assert store.list_files(after=second.id) == ([first], False)
    assert store.list_files(purpose="batch_output") == ([], False)
    store.delete_file(first.id)
    assert not store.file_path(first.id).exists()
    for call in (lambda: store.get_file(first.id), lambda: store.delete_file(first.id),
                 lambda: store.list_files(after=first.id)):
        with pytest.raises(NotFoundError):
            call()


def test_batch_runs_validating_in_progress_completed_with_output_and_error_files(store: BatchStore) -> None:
    file = add_input(store, [request_line("a"), b"not json\n", b"\n", request_line("b")])
    batch = store.create_batch(ENDPOINT, file.id, "24h", {"team": "x"})
    assert batch.status is BatchStatus.VALIDATING and batch.metadata == {"team": "x"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    parsed = parse_input(store.file_path(file.id).read_bytes().splitlines(keepends=True), ENDPOINT)
    batch = store.start_batch(batch.id, parsed.lines)
    assert batch.status is BatchStatus.IN_PROGRESS
    assert (batch.num_total, batch.num_completed, batch.num_failed) == (3, 0, 1)   # the bad line is answered
    pending = store.pending_lines(batch.id)
    assert [(p.line_index, p.custom_id) for p in pending] == [(0, "a"), (3, "b")]
    assert store.pending_lines(batch.id, after_index=0) == pending[1:]
    # answered out of order; files are in input order
    assert answer(store, batch.id, pending[1])
    assert answer(store, batch.id, pending[0], is_error=True)
    assert store.pending_lines(batch.id) == []
    batch = store.finalize(batch.id)
    assert batch.status is BatchStatus.COMPLETED and batch.completed_at and batch.finalizing_at
    assert (batch.num_total, batch.num_completed, batch.num_failed) == (3, 1, 2)
    output = store.file_path(batch.output_file_id).read_text().splitlines()
    errors = [json.loads(line) for line in store.file_path(batch.error_file_id).read_text().splitlines()]
    assert [json.loads(line)["custom_id"] for line in output] == ["b"]
    assert [e["custom_id"] for e in errors] == ["a", None]
    assert errors[1]["error"]["code"] == "invalid_json_line" and errors[1]["response"] is None
    assert store.get_file(batch.output_file_id).purpose == "batch_output"
    assert store.finalize(batch.id) == batch     # finished: nothing changes


def test_a_line_is_answered_and_counted_once(store: BatchStore) -> None:
    batch = started_batch(store, [request_line("a"), request_line("b")])
    line = store.pending_lines(batch.id)[0]
    assert answer(store, batch.id, line)
    assert not answer(store, batch.id, line, is_error=True)   # a second answer is refused, uncounted
    batch = store.get_batch(batch.id)
    assert (batch.num_completed, batch.num_failed) == (1, 0)


def test_cancel_keeps_partial_results(store: BatchStore) -> None:
    batch = started_batch(store, [request_line(c) for c in "abc"])
    answer(store, batch.id, store.pending_lines(batch.id)[0])
    cancelling = store.request_cancel(batch.id)
    assert cancelling.status is BatchStatus.CANCELLING and cancelling.cancelling_at
    assert store.request_cancel(batch.id) == cancelling      # cancelling twice is fine
    batch = store.finalize(batch.id)
    assert batch.status is BatchStatus.CANCELLED and batch.cancelled_at and batch.completed_at is None
    assert (batch.num_total, batch.num_completed, batch.num_failed) == (3, 1, 0)
    assert len(store.file_path(batch.output_file_id).read_text().splitlines()) == 1
    assert batch.error_file_id is None
    with pytest.raises(ConflictError, match="cancelled"):
        store.request_cancel(batch.id)
    with pytest.raises(NotFoundError):
        store.request_cancel("batch_nope")


def test_cancel_while_validating_ends_cancelled(store: BatchStore) -> None:
    file = add_input(store, [request_line("a"), b"[1]\n"])
    batch = store.create_batch(ENDPOINT, file.id, "24h")
    store.request_cancel(batch.id)
    parsed = parse_input(store.file_path(file.id).read_bytes().splitlines(), ENDPOINT)
    batch = store.start_batch(batch.id, parsed.lines)
    assert batch.status is BatchStatus.CANCELLING and batch.num_total == 2
    batch = store.finalize(batch.id)
    assert batch.status is BatchStatus.CANCELLED
    assert (batch.num_completed, batch.num_failed, batch.output_file_id) == (0, 1, None)


def test_failed_validation_records_errors(store: BatchStore) -> None:
    file = add_input(store, [request_line("a"), request_line("a")])
    batch = store.create_batch(ENDPOINT, file.id, "24h")
    parsed = parse_input(store.file_path(file.id).read_bytes().splitlines(), ENDPOINT)
    batch = store.fail_batch(batch.id, parsed.errors)
    assert batch.status is BatchStatus.FAILED and batch.failed_at
    assert batch.errors == (BatchError("duplicate_custom_id", "custom_id 'a' is also on line 1", 2, "custom_id"),)
    assert store.unfinished_batch_ids() == []


def test_batches_list_newest_first_with_cursor(store: BatchStore) -> None:
    file = add_input(store, [request_line("a")])
    ids = [store.create_batch(ENDPOINT, file.id, "24h").id for _ in range(3)]
    page, has_more = store.list_batches(limit=2)
    assert [b.id for b in page] == ids[:0:-1] and has_more
    assert [b.id for b in store.list_batches(after=page[-1].id)[0]] == ids[:1]
    assert store.unfinished_batch_ids() == ids


def test_state_survives_reopening(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch = started_batch(store, [request_line(c) for c in "abc"])
    answer(store, batch.id, store.pending_lines(batch.id)[1])
    store.close()
    store = BatchStore(tmp_path)
    try:
        assert store.unfinished_batch_ids() == [batch.id]
        assert [p.custom_id for p in store.pending_lines(batch.id)] == ["a", "c"]
        assert store.get_batch(batch.id).num_completed == 1
    finally:
        store.close()


def test_one_store_per_data_dir(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    with pytest.raises(DataDirInUseError, match=str(os.getpid())):
        BatchStore(tmp_path)
    store.close()
    BatchStore(tmp_path).close()


def test_contents_without_a_row_are_removed_on_open(tmp_path: Path) -> None:
    """What a crash between writing contents and committing their row leaves behind."""
    store = BatchStore(tmp_path)
    kept = store.add_file(io.BytesIO(b"keep"), "k.jsonl", "batch")
    store.close()
    (tmp_path / "files" / "file-orphan").write_bytes(b"x")
    (tmp_path / "files" / "file-half.part").write_bytes(b"x")
    store = BatchStore(tmp_path)
    try:
        assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [kept.id]
    finally:
        store.close()


_ANSWER_FOREVER = textwrap.dedent("""
    import json, sys
    from gateway.batch.store import BatchStore
    store = BatchStore(sys.argv[1])
    batch_id = store.unfinished_batch_ids()[0]
    for line in store.pending_lines(batch_id, -1, 100000):
        store.record_result(batch_id, line.line_index, json.dumps({"custom_id": line.custom_id}), False)
        print(line.line_index, flush=True)
""")


def test_kill_9_while_answering_leaves_answers_and_counts_consistent(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    num_lines = 5000
    batch = started_batch(store, [request_line(f"r{i}") for i in range(num_lines)])
    store.close()
    proc = subprocess.Popen([sys.executable, "-c", _ANSWER_FOREVER, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    while int(proc.stdout.readline()) < 100:   # it has answered 100 lines and goes on answering
        pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = BatchStore(tmp_path)
    try:
        batch = store.get_batch(batch.id)
        num_pending = len(store.pending_lines(batch.id, -1, 100000))
        assert 100 < batch.num_completed < num_lines
        assert batch.num_completed + num_pending == num_lines
        for line in store.pending_lines(batch.id, -1, 100000):
            answer(store, batch.id, line)
        batch = store.finalize(batch.id)
        custom_ids = [json.loads(line)["custom_id"] for line in
                      store.file_path(batch.output_file_id).read_text().splitlines()]
        assert custom_ids == [f"r{i}" for i in range(num_lines)]
    finally:
        store.close()
