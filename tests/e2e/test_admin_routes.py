"""SGLang's admin routes on the three-process stack: model info, server info, health_generate, flush;
and the public edge on a stack started with --api-key and --admin-api-key."""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

import httpx
import openai
import pytest

from launcher.defaults import default_model_path
from tests.e2e.conftest import CONTEXT_LEN, MODEL
from tests.e2e.error_bodies import internal_details
from tests.e2e.stack import Stack, child_pids, start_stack

pytestmark = pytest.mark.slow


def test_get_model_info_has_exactly_sglangs_keys(stack: Stack) -> None:
    info = httpx.get(f"{stack.url}/get_model_info").json()
    assert info.keys() == {"model_path", "is_generation", "tokenizer_path"}
    assert info["is_generation"] is True and info["model_path"].endswith(".gguf")


def test_get_server_info_lists_the_gateway_args_and_every_worker(stack: Stack) -> None:
    info = httpx.get(f"{stack.url}/get_server_info").json()
    assert info["served_model_name"] == "SmolLM2-135M-Instruct" and "api_key" not in info
    roles = sorted(w["role"] for w in info["workers"])
    assert roles == ["decode", "prefill"]
    for worker in info["workers"]:
        assert worker["context_len"] == CONTEXT_LEN and worker["max_total_num_tokens"] == 8192
        assert 0 <= worker["kv_pool_usage"] <= 1 and worker["version"] == info["version"]


def test_health_generate_runs_one_token_through_the_whole_path(stack: Stack) -> None:
    assert httpx.get(f"{stack.url}/health_generate", timeout=60).json() == {"status": "ok"}


def test_flush_cache_flushes_when_idle_and_refuses_while_requests_run(stack: Stack) -> None:
    text = "Repeat after me: " + "a long shared prefix for the cache " * 20
    httpx.post(f"{stack.url}/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
    assert stack.load()["prefill"].num_cached_pages > 0
    flushed = httpx.post(f"{stack.url}/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    assert stack.load()["prefill"].num_cached_pages == 0
    busy = threading.Thread(target=httpx.post, args=(f"{stack.url}/generate",), kwargs={
        "json": {"text": "Count to one hundred:", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}},
        "timeout": 120})
    busy.start()
    try:
        for _ in range(100):
            if stack.load()["decode"].num_running:
                break
            threading.Event().wait(0.05)
        refused = httpx.post(f"{stack.url}/flush_cache")
        assert refused.status_code == 400 and refused.text.startswith("Cache not flushed")
    finally:
        busy.join()


def test_update_weights_from_disk_as_in_the_seed(stack: Stack) -> None:
    model_path = httpx.get(f"{stack.url}/get_model_info").json()["model_path"]
    before = httpx.post(f"{stack.url}/generate", json={"text": "The capital of France is",
                                                       "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    ok = httpx.post(f"{stack.url}/update_weights_from_disk", json={"model_path": model_path}, timeout=300)
    assert ok.json() == {"success": True, "message": "Succeeded to update model weights."}
    assert ok.json().keys() == {"success", "message"}
    after = httpx.post(f"{stack.url}/generate", json={"text": "The capital of France is",
                                                      "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert after.json()["text"] == before.json()["text"]   # same weights reloaded: same answer
    wrong = httpx.post(f"{stack.url}/update_weights_from_disk", json={"model_path": "meta-llama/Llama-3.2-1B-wrong"})
    assert wrong.json() == {"success": False, "message": "Failed to get weights iterator: "
                                                         "meta-llama/Llama-3.2-1B-wrong (repository not found)."}


def test_update_weights_with_other_shapes_fails_cleanly_and_old_weights_keep_serving(stack: Stack,
                                                                                      tmp_path) -> None:
    from tests.tiny_models import save_tiny_llama
    tiny = save_tiny_llama(tmp_path / "tiny")
    before = httpx.post(f"{stack.url}/generate", json={"text": "Hello", "sampling_params": {
        "temperature": 0, "max_new_tokens": 6}}).json()["text"]
    refused = httpx.post(f"{stack.url}/update_weights_from_disk", json={"model_path": str(tiny)}, timeout=120)
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert "do not match" in refused.json()["message"]
    assert httpx.post(f"{stack.url}/generate", json={"text": "Hello", "sampling_params": {
        "temperature": 0, "max_new_tokens": 6}}).json()["text"] == before


def test_update_weights_outside_the_weights_dirs_is_answered_as_not_found(stack: Stack, tmp_path) -> None:
    """/etc/passwd exists and /etc/no-such-file does not: the answers cannot tell them apart. Nor can a `..`
    tell a link from a directory: `/bin/..` leads elsewhere (/bin is a link on most systems) than
    `/nonexistent/..`, and both are answered as any path outside --weights-dir."""
    model = Path(default_model_path())
    for path in ("/etc/passwd", "/etc/no-such-file", f"{tmp_path}/../../../../../etc/passwd",
                 f"/bin/..{model}", f"/nonexistent/..{model}", f"{model.parent}/../{model.parent.name}/{model.name}"):
        reply = httpx.post(f"{stack.url}/update_weights_from_disk", json={"model_path": path}, timeout=60)
        assert reply.status_code == 400
        assert reply.json() == {"success": False,
                                "message": f"Failed to get weights iterator: {path} (repository not found)."}


USER_KEY, ADMIN_KEY = f"user-{secrets.token_hex(8)}", f"admin-{secrets.token_hex(8)}"
USER, ADMIN = {"Authorization": f"Bearer {USER_KEY}"}, {"Authorization": f"Bearer {ADMIN_KEY}"}
ADMIN_ROUTES = (("POST", "/flush_cache"), ("GET", "/get_server_info"), ("POST", "/update_weights_from_disk"),
                ("POST", "/start_expert_distribution_record"), ("POST", "/stop_expert_distribution_record"),
                ("POST", "/dump_expert_distribution_record"))


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory) -> Stack:
    stack = start_stack(tmp_path_factory.mktemp("keyed_stack"), "--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY,
                        "--context-length", str(CONTEXT_LEN), "--max-total-tokens", "4096", "--torch-threads", "1")
    yield stack
    assert stack.stop() == []


def test_admin_routes_refuse_the_user_key_and_take_the_admin_key(keyed_stack: Stack) -> None:
    for method, path in ADMIN_ROUTES:
        for headers in ({}, USER):
            refused = httpx.request(method, f"{keyed_stack.url}{path}", headers=headers, json={"model_path": "x"})
            assert refused.status_code == 401, (path, headers)
            assert refused.json()["error"] == {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                               "param": None, "code": "invalid_api_key"}
    flushed = httpx.post(f"{keyed_stack.url}/flush_cache", headers=ADMIN)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    info = httpx.get(f"{keyed_stack.url}/get_server_info", headers=ADMIN)
    assert info.status_code == 200 and sorted(w["role"] for w in info.json()["workers"]) == ["decode", "prefill"]
    assert USER_KEY not in info.text and ADMIN_KEY not in info.text
    # a dense model: the worker refuses (400), past the key
    experts = httpx.post(f"{keyed_stack.url}/start_expert_distribution_record", headers=ADMIN)
    assert experts.status_code == 400 and "mixture-of-experts" in experts.json()["error"]["message"]
    missing = httpx.post(f"{keyed_stack.url}/update_weights_from_disk", headers=ADMIN,
                         json={"model_path": "no-such-model"})
    assert missing.status_code == 400 and missing.json()["success"] is False


def test_user_routes_and_health_generate_need_the_user_key(keyed_stack: Stack) -> None:
    assert httpx.get(f"{keyed_stack.url}/health").status_code == 200
    assert httpx.get(f"{keyed_stack.url}/health_generate", timeout=60).status_code == 401
    assert httpx.get(f"{keyed_stack.url}/health_generate", headers=USER, timeout=60).json() == {"status": "ok"}
    assert httpx.get(f"{keyed_stack.url}/v1/models").status_code == 401
    client = openai.OpenAI(base_url=f"{keyed_stack.url}/v1", api_key=USER_KEY)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert answer.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_stack.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_duplicate_authorization_headers_are_refused(keyed_stack: Stack) -> None:
    for method, path, key in (("POST", "/flush_cache", ADMIN), ("GET", "/v1/models", USER), ("GET", "/health", USER)):
        twice = [("Authorization", key["Authorization"])] * 2
        response = httpx.request(method, f"{keyed_stack.url}{path}", headers=twice)
        assert response.status_code == 400, path
        assert response.json()["error"]["code"] == "duplicate_authorization_header"


def test_the_keys_reach_the_gateway_by_environment_never_on_a_command_line(keyed_stack: Stack) -> None:
    children = child_pids(keyed_stack.proc.pid)
    assert len(children) == 3
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert USER_KEY.encode() not in cmdline and ADMIN_KEY.encode() not in cmdline
    [gateway] = [pid for pid in children if b"\0gateway\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    environ = Path(f"/proc/{gateway}/environ").read_bytes().split(b"\0")
    assert f"TANDEM_ADMIN_API_KEY={ADMIN_KEY}".encode() in environ
    assert f"TANDEM_API_KEY={USER_KEY}".encode() in environ


def test_worker_errors_reach_the_client_without_internal_details(keyed_stack: Stack, tmp_path: Path) -> None:
    """Errors the workers raise (a bad grammar, a model without experts, weights that cannot be read)
    and ones the gateway raises: no body names an address, a port of a worker, a path or an exception."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    url = keyed_stack.url
    too_long = list(range(1, CONTEXT_LEN + 10))
    calls = [  # the grammar is compiled on the prefill worker: the first compile takes a while
        (USER, "/generate", {"text": "Hi", "sampling_params": {"regex": "(a|"}}),
        (USER, "/generate", {"input_ids": too_long}),
        (USER, "/v1/completions", {"model": MODEL, "prompt": "Hi", "regex": "(a|", "stream": True}),
        (USER, "/v1/embeddings", {"model": MODEL, "input": "Hi"}),
        (ADMIN, "/start_expert_distribution_record", None),
        (ADMIN, "/update_weights_from_disk", {"model_path": str(broken)}),
    ]
    provoked = [httpx.post(f"{url}{path}", headers=key, json=body, timeout=300) for key, path, body in calls]
    ports = [str(p) for p in (keyed_stack.prefill_port, keyed_stack.decode_port)]
    for response in provoked:
        failed = response.status_code >= 400 or '"error"' in response.text
        assert failed, response.text
        sent = response.request.content.decode()
        assert internal_details(response.text, sent) == [], response.text
        assert not any(port in response.text for port in ports), response.text


def test_the_error_body_check_catches_internal_details() -> None:
    """The suite-wide check (tests/e2e/conftest.py) can fail."""
    for leaky in ("decode worker 127.0.0.1:31002: boom", "ipv4:10.1.2.3:5 refused", "decode-0:31002 reset",
                  "cannot read /tmp/x/config.json", "at /work/main/engine/engine.py", "Unexpected <class 'KeyError'>",
                  "ValueError('bad')", "Traceback (most recent call last):",
                  "invalid regex: [19:08:57] /project/cpp/regex_converter.cc:83: Regex parsing error"):
        assert internal_details(leaky), leaky
    assert internal_details("Failed to open /tmp/m: bad", sent='{"model_path": "/tmp/m"}') == []   # the client's own
    assert internal_details("Failed to open /tmp/m/config.json", sent='{"model_path": "/tmp/n"}')
    for fine in ("This model's maximum context length is 1024 tokens.", "invalid regex: [19:08:57] <path>: Regex",
                 "use /v1/embeddings or /encode", '{"error":{"message":"x","code":400}}'):
        assert internal_details(fine) == [], fine
