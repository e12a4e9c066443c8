"""A handoff its caller gives up on, against the real worker processes and Mooncake TCP between them: a
prefill cancelled while its KV write into a frozen decode worker (SIGSTOP) is still in flight. The
gateway asks CancelPrefill whether the decode pages may be freed at once; the answer must wait until
the write is over, or a page freed and handed to another request could still be written into."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2_grpc
from tests.e2e.stack import WORKER_METADATA, Services, running_services, wait_until_stopped

pytestmark = pytest.mark.slow

PROMPT = list(range(100, 140))  # 40 tokens: three pages of 16


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    with running_services(tmp_path, "--dtype", "bfloat16", "--max-total-tokens", "2048", "--torch-threads", "1",
                          "--transfer-timeout", "60") as services:
        try:
            yield services
        finally:
            if services.decode.poll() is None:
                os.kill(services.decode.pid, signal.SIGCONT)  # a stopped process would ignore SIGTERM


def _wait_for_the_write_in_flight(control: worker_pb2_grpc.WorkerServiceStub, within_s: float = 60.0) -> None:
    """Until the prefill worker has computed the prompt and holds its pages for the write alone."""
    deadline = time.monotonic() + within_s
    while True:
        load = control.GetLoad(common_pb2.GetLoadRequest(), timeout=30, metadata=WORKER_METADATA)
        held = load.num_total_pages - load.num_free_pages - load.num_cached_pages
        if held and load.num_running == load.num_waiting == 0:
            return
        assert time.monotonic() < deadline, load
        time.sleep(0.05)


def test_cancel_prefill_answers_only_once_the_cancelled_prefills_write_is_over(services: Services) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{services.prefill_port}") as p_channel, \
            grpc.insecure_channel(f"127.0.0.1:{services.decode_port}") as d_channel:
        prefill = prefill_pb2_grpc.PrefillServiceStub(p_channel)
        decode = decode_pb2_grpc.DecodeServiceStub(d_channel)
        target = decode.Reserve(decode_pb2.ReserveRequest(request_id="frozen", prompt_len=len(PROMPT)), timeout=30,
                                metadata=WORKER_METADATA).kv_target
        os.kill(services.decode.pid, signal.SIGSTOP)
        wait_until_stopped(services.decode.pid)
        call = prefill.Prefill.future(prefill_pb2.PrefillRequest(
            request_id="frozen", token_ids=PROMPT, kv_target=target,
            sampling_params=common_pb2.SamplingParams(max_new_tokens=1)), timeout=120, metadata=WORKER_METADATA)
        _wait_for_the_write_in_flight(worker_pb2_grpc.WorkerServiceStub(p_channel))
        call.cancel()  # the caller goes away; the write into the frozen worker goes on
        answer = prefill.CancelPrefill.future(prefill_pb2.CancelPrefillRequest(request_id="frozen", kv_target=target),
                                              timeout=120, metadata=WORKER_METADATA)
        time.sleep(1.0)
        assert not answer.done(), "CancelPrefill answered while the cancelled prefill's write was in flight"
        os.kill(services.decode.pid, signal.SIGCONT)
        assert answer.result(timeout=60).was_running
        control = worker_pb2_grpc.WorkerServiceStub(d_channel)
        assert control.Abort(common_pb2.AbortRequest(request_id="frozen", kv_write_settled=True), timeout=30,
                             metadata=WORKER_METADATA).found
    services.assert_no_pages_held()
