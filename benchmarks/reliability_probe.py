"""Re-run past reliability failures against a live stack and print what happens now, one line per probe.

    python benchmarks/reliability_probe.py --launch
    python benchmarks/reliability_probe.py --url http://127.0.0.1:30000

With --launch the stack runs with `--max-total-tokens 2048` (128 pages of 16 tokens) and the flags of
--serve-args. The probes: a client gone 0.3 s into a long prefill (seconds until the decode worker's
pages are free), a /generate batch of 300 prompts, 20 MB and 50 MB bodies (with /health polled
meanwhile), a lone surrogate, chat_template_kwargs, a catastrophic regex, a 300-deep JSON schema, a
`false` schema and a 700,000-character prompt; then whether anything is still held. The decode
worker's pages are read over gRPC with --launch and from /get_server_info with --url.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.chaos.checks import gateway_metrics, worker_load  # noqa: E402
from tests.chaos.clients import MODEL  # noqa: E402

HANG_S = 60
TIMEOUT_S = 180
INTERNAL_ADDRESS = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b|ipv[46]:|localhost|/tmp/|/work/|\.py\b")

DecodeState = Callable[[], tuple[int, int, int]]


def grpc_decode_state(decode_port: int) -> DecodeState:
    def state() -> tuple[int, int, int]:
        load = worker_load(decode_port)
        return load.num_total_pages - load.num_free_pages - load.num_cached_pages, load.num_running, load.num_waiting
    return state


def http_decode_state(url: str) -> DecodeState:
    def state() -> tuple[int, int, int]:
        workers = httpx.get(f"{url}/get_server_info", timeout=30).json()["workers"]
        w = next(w for w in workers if w["role"] == "decode")
        return (w["num_total_pages"] - w["num_free_pages"] - w["num_cached_pages"], w["num_running_reqs"],
                w["num_waiting_reqs"])
    return state


def seconds_until_idle(decode_state: DecodeState, limit_s: float = 60) -> float | None:
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        if decode_state() == (0, 0, 0):
            return time.perf_counter() - started
        time.sleep(0.05)
    return None


def outcome(reply: httpx.Response, seconds: float) -> str:
    """`400 invalid_value param=messages.0.content in 0.01 s`; a code-less error shows its type and status."""
    text = f"{reply.status_code}"
    if reply.status_code != 200:
        error = error_of(reply)
        code = error.get("code")
        text += f" {code}" if isinstance(code, str) else f" {error.get('type', '-')} (code {code})"
        if error.get("param"):
            text += f" param={error['param']}"
    text += f" in {seconds:.2f} s"
    return text + warnings(reply, seconds)


def outcome_and_message(reply: httpx.Response, seconds: float) -> str:
    message = error_of(reply).get("message", "") if reply.status_code != 200 else ""
    return f"{outcome(reply, seconds)}{f' {message!r}' if message else ''}"


def error_of(reply: httpx.Response) -> dict:
    try:
        body = reply.json()
    except ValueError:
        return {"message": reply.text[:200]}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {"message": str(body)[:200]}


def warnings(reply: httpx.Response, seconds: float) -> str:
    notes = []
    if reply.status_code >= 500:
        notes.append("SERVER ERROR")
    if seconds > HANG_S:
        notes.append("HANG")
    if reply.status_code != 200 and INTERNAL_ADDRESS.search(error_of(reply).get("message", "")):
        notes.append(f"INTERNAL DETAIL IN MESSAGE: {error_of(reply)['message']!r}")
    return "".join(f" [{note}]" for note in notes)


def timed_post(url: str, path: str, **kwargs) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    reply = httpx.post(f"{url}{path}", timeout=TIMEOUT_S, **kwargs)
    return reply, time.perf_counter() - started


@contextmanager
def health_watch(url: str) -> Iterator[list[float]]:
    """Polls /health every 50 ms while the block runs; yields the list of latencies (an error counts as its time)."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            started = time.perf_counter()
            try:
                httpx.get(f"{url}/health", timeout=TIMEOUT_S)
            except httpx.HTTPError:
                pass
            latencies.append(time.perf_counter() - started)
            done.wait(0.05)
    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        done.set()
        thread.join()


def chat_body(content: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
            **fields}


def long_prompt(url: str, num_tokens: int) -> tuple[str, int]:
    """A prompt of about `num_tokens` tokens that starts with a fresh nonce (no prefix cache hit)."""
    words = " ".join(f"item{i} is blue," for i in range(num_tokens // 2))
    text = f"{uuid.uuid4().hex}: {words}"
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"][:num_tokens]
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    count = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60).json()["count"]
    return text, count


def cancel_during_prefill(url: str, decode_state: DecodeState, stream: bool) -> str:
    prompt, num_tokens = long_prompt(url, 1750)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": stream}
    timeout = httpx.Timeout(TIMEOUT_S, read=0.3)
    got_bytes = False
    started = time.perf_counter()
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
            for _ in response.iter_raw():
                got_bytes = True
    except httpx.ReadTimeout:
        pass
    gone_at = time.perf_counter() - started
    held_then = decode_state()[0]
    idle_s = seconds_until_idle(decode_state)
    idle = f"pages idle after {idle_s:.2f} s" if idle_s is not None else "pages NOT idle after 60 s [LEAK]"
    early = " (bytes had arrived before the disconnect)" if got_bytes else ""
    return (f"{num_tokens}-token prompt, client gone at {gone_at:.2f} s{early}, {held_then} decode pages held "
            f"then, {idle}")


def batch_of_300(url: str, decode_state: DecodeState) -> str:
    body = {"text": [f"Prompt {i}: say hi." for i in range(300)],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    reply, seconds = timed_post(url, "/generate", json=body)
    time.sleep(1)
    held, running, waiting = decode_state()
    return (f"{outcome_and_message(reply, seconds)}; 1 s later {held} decode pages held, {running} running, "
            f"{waiting} waiting")


def big_body(url: str, num_mb: int, chunked: bool) -> str:
    data = json.dumps(chat_body("x" * (num_mb * 1024 * 1024))).encode()
    content = (data[i:i + 65536] for i in range(0, len(data), 65536)) if chunked else data
    headers = {"content-type": "application/json"}
    with health_watch(url) as latencies:
        started = time.perf_counter()
        try:
            reply = httpx.post(f"{url}/v1/chat/completions", content=content, headers=headers, timeout=TIMEOUT_S)
            result = outcome(reply, time.perf_counter() - started)
        except httpx.HTTPError as exc:
            seconds = time.perf_counter() - started
            result = f"client error {type(exc).__name__}: {exc} after {seconds:.2f} s"
    health = f"/health max {max(latencies):.3f} s over {len(latencies)} polls" if latencies else "no /health poll"
    return f"{len(data) / 1e6:.1f} MB {'chunked' if chunked else 'with Content-Length'}: {result}; {health}"


def surrogate(url: str) -> str:
    raw = json.dumps(chat_body("a\ud800b")).encode()
    assert b"\\ud800" in raw
    reply, seconds = timed_post(url, "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    return outcome(reply, seconds)


def no_generation_prompt(url: str) -> str:
    body = chat_body("Hello", chat_template_kwargs={"add_generation_prompt": False})
    reply, seconds = timed_post(url, "/v1/chat/completions", json=body)
    return outcome_and_message(reply, seconds)


def grammar_request(url: str, regex: str, max_new_tokens: int = 8) -> tuple[httpx.Response, float]:
    body = {"text": "Answer:", "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "regex": regex}}
    return timed_post(url, "/generate", json=body)


def grammar_warm_up(url: str) -> str:
    reply, seconds = grammar_request(url, "(yes|no)")
    return f"regex (yes|no) {outcome(reply, seconds)} (loads xgrammar's vocabulary on each worker)"


def catastrophic_regex(url: str) -> str:
    with health_watch(url) as latencies:
        reply, seconds = grammar_request(url, "[a-z]{1,100000}")
    answer = f" text={reply.json()['text']!r}" if reply.status_code == 200 else ""
    health = f"/health max {max(latencies):.3f} s over {len(latencies)} polls" if latencies else "no /health poll"
    after, after_s = grammar_request(url, "[0-9]{1,3}")
    return (f"regex [a-z]{{1,100000}} {outcome_and_message(reply, seconds)}{answer} (server "
            f"--grammar-compile-timeout default 5 s); {health}; next regex [0-9]{{1,3}} {outcome(after, after_s)}")


def deep_schema(url: str, depth: int = 300) -> str:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    body = chat_body("Give JSON.", response_format=response_format)
    reply, seconds = timed_post(url, "/v1/chat/completions", json=body)
    return f"depth {depth} {outcome_and_message(reply, seconds)}"


def false_schema(url: str) -> str:
    response_format = {"type": "json_schema", "json_schema": {"name": "none", "schema": False}}
    body = chat_body("Give JSON.", response_format=response_format)
    reply, seconds = timed_post(url, "/v1/chat/completions", json=body)
    return outcome_and_message(reply, seconds)


def huge_prompt(url: str) -> str:
    prompt = ("The sea is wide. " * 50_000)[:700_000]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    reply, seconds = timed_post(url, "/v1/completions", json=body)
    return f"{len(prompt):,} chars {outcome(reply, seconds)}"


def nothing_leaked(url: str, decode_state: DecodeState) -> str:
    idle_s = seconds_until_idle(decode_state, limit_s=10)
    held, running, waiting = decode_state()
    metrics = gateway_metrics(url)
    in_flight = metrics.get("tandem_gateway_requests_in_flight", 0) - 1   # the scrape itself
    queued = metrics.get("tandem_gateway_queued_requests", 0)
    verdict = "yes" if idle_s is not None and in_flight <= 0 and not queued else "NO [LEAK]"
    return (f"{verdict}: decode {held} pages held, {running} running, {waiting} waiting; gateway "
            f"{in_flight:.0f} in flight besides the scrape, {queued:.0f} queued")


def probe(name: str, run: Callable[[], str]) -> None:
    try:
        line = run()
    except Exception as exc:  # noqa: BLE001
        line = f"probe failed: {type(exc).__name__}: {exc}"
    print(f"{name}: {line}", flush=True)


def run_probes(url: str, decode_state: DecodeState) -> None:
    probe("cancel during prefill (non-stream)", lambda: cancel_during_prefill(url, decode_state, stream=False))
    probe("cancel during prefill (stream)", lambda: cancel_during_prefill(url, decode_state, stream=True))
    probe("batch of 300", lambda: batch_of_300(url, decode_state))
    probe("20 MB body", lambda: big_body(url, 20, chunked=False))
    probe("20 MB body chunked", lambda: big_body(url, 20, chunked=True))
    probe("50 MB body", lambda: big_body(url, 50, chunked=False))
    probe("surrogate", lambda: surrogate(url))
    probe("add_generation_prompt false", lambda: no_generation_prompt(url))
    probe("grammar warm-up", lambda: grammar_warm_up(url))
    probe("catastrophic regex", lambda: catastrophic_regex(url))
    probe("300-deep schema", lambda: deep_schema(url))
    probe("schema false", lambda: false_schema(url))
    probe("700,000-char prompt", lambda: huge_prompt(url))
    probe("nothing leaked", lambda: nothing_leaked(url, decode_state))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running gateway (default: --launch one)")
    parser.add_argument("--launch", action="store_true", help="start `tandem serve` for the run and stop it after")
    parser.add_argument("--serve-args", default="", help="extra flags for `tandem serve` with --launch")
    args = parser.parse_args()
    if not args.url and not args.launch:
        parser.error("give --url of a running gateway or --launch")
    stack = None
    if args.launch:
        from tests.e2e.stack import start_stack
        started = time.perf_counter()
        stack = start_stack(Path(tempfile.mkdtemp()), "--max-total-tokens", "2048", *args.serve_args.split())
        print(f"stack: ready in {time.perf_counter() - started:.1f} s at {stack.url} (log {stack.log_path})",
              flush=True)
    url = args.url or stack.url
    decode_state = grpc_decode_state(stack.decode_port) if stack is not None else http_decode_state(url)
    try:
        run_probes(url, decode_state)
    finally:
        if stack is not None:
            left = stack.stop()
            print(f"stack: stopped{f', children still alive: {left}' if left else ''}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
