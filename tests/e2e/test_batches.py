"""/v1/files and /v1/batches through the real three processes, with the official OpenAI SDK."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.stack import Stack, start_services, start_stack

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# A line cancelled while its prefill runs gets its decode pages back as soon as the prefill worker
# confirms the write is over; only a prefill worker that cannot answer leaves them resting for
# --kv-write-grace seconds: 7 s (with a 7 s transfer timeout, so Mooncake's own 5.6 s stays below it)
# keeps the page checks short even then.
FLAGS = ("--dtype", "bfloat16", "--max-total-tokens", "8192", "--torch-threads", "1", "--transfer-timeout", "7",
         "--kv-write-grace", "7")


@pytest.fixture(scope="module")
def batch_stack(tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("batches")
    stack = start_stack(tmp, *FLAGS, "--data-dir", str(tmp / "data"))
    yield stack
    assert stack.stop() == []


@pytest.fixture(scope="module")
def client(batch_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{batch_stack.url}/v1", api_key="None")


def upload(client: openai.OpenAI, path: Path, lines: list) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch").id


def chat_line(custom_id: str, content: str, max_tokens: int, url: str = "/chat/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     **body}}


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).read().decode().splitlines() if line]


def wait_for(client: openai.OpenAI, batch_id: str, done, timeout_s: float = 120, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(poll_s)


def test_seed_batch_code_runs_unchanged(client: openai.OpenAI, tmp_path: Path, monkeypatch, capsys) -> None:
    """Seed 000's batch example as written (print_highlight -> print, the model name changed)."""
    monkeypatch.chdir(tmp_path)
    print_highlight = print

    requests = [
        {
            "custom_id": "request-1",
            "method": "POST",
            "url": "/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": "Tell me a joke about programming"}
                ],
                "max_tokens": 50,
            },
        },
        {
            "custom_id": "request-2",
            "method": "POST",
            "url": "/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": "What is Python?"}],
                "max_tokens": 50,
            },
        },
    ]
    input_file_path = "batch_requests.jsonl"
    with open(input_file_path, "w") as f:
        for req in requests:
            f.write(json.dumps(req) + "\n")
    with open(input_file_path, "rb") as f:
        file_response = client.files.create(file=f, purpose="batch")
    batch_response = client.batches.create(
        input_file_id=file_response.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    print_highlight(f"Batch job created with ID: {batch_response.id}")

    while batch_response.status not in ["completed", "failed", "cancelled"]:
        time.sleep(3)
        print(f"Batch job status: {batch_response.status}...trying again in 3 seconds...")
        batch_response = client.batches.retrieve(batch_response.id)
    if batch_response.status == "completed":
        print("Batch job completed successfully!")
        print(f"Request counts: {batch_response.request_counts}")
        result_file_id = batch_response.output_file_id
        file_response = client.files.content(result_file_id)
        result_content = file_response.read().decode("utf-8")
        results = [
            json.loads(line) for line in result_content.split("\n") if line.strip() != ""
        ]
        for result in results:
            print_highlight(f"Request {result['custom_id']}:")
            print_highlight(f"Response: {result['response']}")
        print_highlight("Cleaning up files...")
        # Only delete the result file ID since file_response is just content
        client.files.delete(result_file_id)
    else:
        print_highlight(f"Batch job failed with status: {batch_response.status}")
        if hasattr(batch_response, "errors"):
            print_highlight(f"Errors: {batch_response.errors}")

    assert batch_response.status == "completed"
    counts = batch_response.request_counts
    assert (counts.total, counts.completed, counts.failed) == (2, 2, 0)
    assert batch_response.error_file_id is None
    assert [r["custom_id"] for r in results] == ["request-1", "request-2"]
    for result in results:
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = result["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] <= 50
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(result_file_id)        # deleted
    assert "Batch job completed successfully!" in capsys.readouterr().out


def test_cancel_mid_way_keeps_partial_results(batch_stack: Stack, client: openai.OpenAI, tmp_path: Path) -> None:
    lines = [chat_line(f"request-{i}", f"{i}: Write a detailed story about the sea. Make it very long.", 48,
                       ignore_eos=True) for i in range(40)]
    input_id = upload(client, tmp_path / "in.jsonl", lines)
    batch = client.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 2, poll_s=0.1)
    # an interactive request is answered while the batch runs
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert answer.choices[0].message.content
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at
    cancelled = wait_for(client, batch.id, lambda b: b.status not in ("cancelling",), timeout_s=60)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at and cancelled.completed_at is None
    counts = cancelled.request_counts
    assert counts.total == 40 and 2 <= counts.completed < 40
    output, errors = read_lines(client, cancelled.output_file_id), read_lines(client, cancelled.error_file_id)
    assert (len(output), len(errors)) == (counts.completed, counts.failed) == (counts.completed, 0)
    assert len({o["custom_id"] for o in output}) == len(output)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 48 for o in output)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    assert client.files.delete(input_id).deleted       # the seed's clean-up
    batch_stack.assert_no_pages_held(within_s=15)      # the cancelled lines were aborted on the workers


def test_bad_lines_go_to_the_error_file_and_the_batch_completes(client: openai.OpenAI, tmp_path: Path) -> None:
    lines = [
        chat_line("good-1", "Say hi.", 4),
        "{this is not json",
        chat_line("wrong-url", "Say hi.", 4, url="/v1/completions"),
        {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"},
        {"method": "POST", "url": "/v1/chat/completions", "body": {"model": MODEL}},
        chat_line("bad-temperature", "Say hi.", 4, temperature=-1),
        chat_line("unknown-model", "Say hi.", 4, model="no-such-model"),
        chat_line("good-2", "Say bye.", 4, url="/v1/chat/completions"),
    ]
    input_id = upload(client, tmp_path / "in.jsonl", lines)
    batch = client.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"purpose": "test"})
    assert batch.metadata == {"purpose": "test"}
    batch = wait_for(client, batch.id, lambda b: b.status == "completed")
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (8, 2, 6)
    assert [o["custom_id"] for o in read_lines(client, batch.output_file_id)] == ["good-1", "good-2"]
    errors = read_lines(client, batch.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [   # in file order
        (None, "invalid_json_line"), ("wrong-url", "invalid_url"), ("no-body", "missing_body"),
        (None, "missing_custom_id"), ("bad-temperature", "invalid_request_error"),
        ("unknown-model", "model_not_found")]
    assert all(e["response"] is None for e in errors[:4])
    bad_temperature, unknown_model = errors[4]["response"], errors[5]["response"]
    assert bad_temperature["status_code"] == 400 and bad_temperature["body"]["error"]["param"] == "temperature"
    assert unknown_model["status_code"] == 404 and unknown_model["body"]["error"]["param"] == "model"


def test_completions_batch(client: openai.OpenAI, tmp_path: Path) -> None:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}}
             for i in range(2)]
    input_id = upload(client, tmp_path / "in.jsonl", lines)
    batch = client.batches.create(input_file_id=input_id, endpoint="/v1/completions", completion_window="24h")
    batch = wait_for(client, batch.id, lambda b: b.status == "completed")
    direct = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    output = read_lines(client, batch.output_file_id)
    assert [o["response"]["body"]["choices"][0]["text"] for o in output] == [direct.choices[0].text] * 2
    assert all(o["response"]["body"]["object"] == "text_completion" for o in output)


def test_files_and_batches_errors(batch_stack: Stack, client: openai.OpenAI, tmp_path: Path) -> None:
    input_id = upload(client, tmp_path / "in.jsonl", [chat_line("a", "hi", 2)])
    assert client.files.retrieve(input_id).bytes == (tmp_path / "in.jsonl").stat().st_size
    assert input_id in [f.id for f in client.files.list(purpose="batch")]
    for call in (lambda: client.files.retrieve("file-nope"), lambda: client.files.content("file-nope"),
                 lambda: client.files.delete("file-nope"), lambda: client.batches.retrieve("batch_nope"),
                 lambda: client.batches.cancel("batch_nope"),
                 lambda: client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as error:
            call()
        assert set(error.value.body) >= {"message", "type", "param", "code"}
    for kwargs, param in (({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "1h"},
                                                                          "completion_window")):
        create = {"input_file_id": input_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kwargs}
        with pytest.raises(openai.BadRequestError) as error:
            client.batches.create(**create)
        assert error.value.body["param"] == param
    with open(tmp_path / "in.jsonl", "rb") as f:
        with pytest.raises(openai.BadRequestError) as error:
            client.files.create(file=f, purpose="fine-tune")
    assert error.value.body["param"] == "purpose"
    response = httpx.post(f"{batch_stack.url}/v1/files", json={"purpose": "batch"})   # not multipart
    assert response.status_code == 400 and "error" in response.json()
    duplicate_id = upload(client, tmp_path / "dup.jsonl", [chat_line("a", "hi", 2), chat_line("a", "hi", 2)])
    failed = client.batches.create(input_file_id=duplicate_id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
    failed = wait_for(client, failed.id, lambda b: b.status == "failed")
    assert [e.code for e in failed.errors.data] == ["duplicate_custom_id"] and failed.errors.data[0].line == 2
    assert failed.id in [b.id for b in client.batches.list(limit=100)]


_NUM_LINES = 40


def test_batch_survives_killing_the_gateway(tmp_path: Path) -> None:
    """The seed's batch lines (max_tokens 8), 40 of them: kill -9 the gateway mid-way, start a new one on
    the same data directory; the batch completes and every custom_id is in the output file exactly once.
    The gateway has an API key, which its batch lines must carry too."""
    services = start_services(tmp_path, *FLAGS)
    gateway_flags = ("--data-dir", str(tmp_path / "data"), "--batch-concurrency", "4", "--api-key", "sekret")
    try:
        services.start_gateway(*gateway_flags, timeout_s=300)
        client = openai.OpenAI(base_url=f"{services.url}/v1", api_key="sekret")
        requests = [{"custom_id": f"request-{i}", "method": "POST", "url": "/chat/completions",
                     "body": {"model": MODEL, "max_tokens": 8,
                              "messages": [{"role": "system", "content": f"{i}: You are a helpful AI assistant"},
                                           {"role": "user",
                                            "content": "Write a detailed story about topic. Make it very long."}]}}
                    for i in range(_NUM_LINES)]
        input_id = upload(client, tmp_path / "batch_requests.jsonl", requests)
        batch = client.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        before = wait_for(client, batch.id, lambda b: b.request_counts.completed >= 8, poll_s=0.05)
        services.kill_gateway()
        assert before.status == "in_progress" and before.request_counts.completed < _NUM_LINES
        services.start_gateway(*gateway_flags)
        batch = wait_for(client, batch.id, lambda b: b.status == "completed", timeout_s=300)
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (_NUM_LINES, _NUM_LINES, 0)
        output = read_lines(client, batch.output_file_id)
        assert sorted(o["custom_id"] for o in output) == sorted(f"request-{i}" for i in range(_NUM_LINES))
        assert all(o["response"]["status_code"] == 200 for o in output)
        assert batch.error_file_id is None
    finally:
        services.stop()
