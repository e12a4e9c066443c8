"""Non-finite logits in one request (reliability.md scenario 19, its numerical half): the engine's
guard fails that request alone, with a clear, sanitized error: a stream gets an error event
(code internal_error) and [DONE], a whole answer a 500; the other requests in the batch finish with
the text they give alone. The NaNs come from the test fault hook TANDEM_FAULT_NAN_LOGITS_SEED, set
to a different seed on each worker so that both the prefill (first token) and the decode path fail."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.chaos.checks import assert_nothing_leaked, assert_still_serving, canary
from tests.chaos.clients import Reply, completion
from tests.e2e.error_bodies import internal_details
from tests.e2e.stack import Services, running_services, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.chaos_extended]

HOOK = "TANDEM_FAULT_NAN_LOGITS_SEED"
PREFILL_NAN_SEED = 4242  # NaN logits at the prefill worker: the first token
DECODE_NAN_SEED = 1234  # NaN logits at the decode worker: the second token on
MAX_TOKENS = 32
VICTIMS = [f"Write a short poem about {topic}." for topic in ("the sea", "a cat", "mountains")]


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    with running_services(
        tmp_path,
        "--dtype",
        "bfloat16",
        "--max-total-tokens",
        "4096",
        "--torch-threads",
        "1",
        prefill_env={HOOK: str(PREFILL_NAN_SEED)},
        decode_env={HOOK: str(DECODE_NAN_SEED)},
    ) as services:
        yield services


def _text(reply: Reply) -> str:
    assert reply.status == 200 and reply.lines[-1] == "data: [DONE]", reply.lines[-3:]
    assert not any("error" in e for e in reply.events), reply.lines[-3:]
    finishes = [c["finish_reason"] for e in reply.events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"], finishes
    return "".join(c["text"] for e in reply.events for c in e["choices"])


def _assert_non_finite_error(error: dict) -> None:
    assert error["type"] == "internal_error" and error["code"] == "internal_error", error
    assert "non-finite logits" in error["message"] and not internal_details(error["message"]), error


def _assert_500(reply: Reply) -> None:
    assert reply.status == 500, (reply.status, reply.lines[:3])
    _assert_non_finite_error(json.loads("".join(reply.lines))["error"])


def test_non_finite_logits_fail_their_request_alone(services: Services) -> None:
    baseline = canary(services.url)
    alone = [_text(completion(services.url, prompt, MAX_TOKENS, True, Reply())) for prompt in VICTIMS]

    victims = [Reply() for _ in VICTIMS]
    nan_stream, nan_whole, nan_prefill_stream, nan_prefill_whole = Reply(), Reply(), Reply(), Reply()
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(completion, services.url, prompt, MAX_TOKENS, True, reply)
            for prompt, reply in zip(VICTIMS, victims)
        ]
        wait_for(lambda: all(len(v.events) >= 2 for v in victims), 120, "every victim decoding")
        for reply, stream, seed in (
            (nan_stream, True, DECODE_NAN_SEED),
            (nan_whole, False, DECODE_NAN_SEED),
            (nan_prefill_stream, True, PREFILL_NAN_SEED),
            (nan_prefill_whole, False, PREFILL_NAN_SEED),
        ):
            futures.append(
                pool.submit(completion, services.url, "Tell me a story.", MAX_TOKENS, stream, reply, seed=seed)
            )
        for future in futures:
            future.result()

    assert [_text(v) for v in victims] == alone  # the batch went on, token for token as alone
    # decode: the stream has its first token (from the prefill worker), then the error and [DONE]
    assert nan_stream.status == 200 and nan_stream.lines[-1] == "data: [DONE]", nan_stream.lines
    errors = [e["error"] for e in nan_stream.events if "error" in e]
    assert len(errors) == 1 and "error" in nan_stream.events[-1], nan_stream.lines
    _assert_non_finite_error(errors[0])
    assert not any(c.get("finish_reason") for e in nan_stream.events for c in e.get("choices", []))
    _assert_500(nan_whole)
    # prefill: no token at all, so the stream gets its status before any byte
    _assert_500(nan_prefill_stream)
    _assert_500(nan_prefill_whole)

    assert_nothing_leaked(services)
    assert_still_serving(services.url, baseline)
