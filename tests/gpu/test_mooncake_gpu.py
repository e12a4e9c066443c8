"""KV over Mooncake from GPU memory: pages written from one GPU pool into another (over TCP, or RDMA
where TANDEM_TEST_RDMA_DEVICES names the NICs, e.g. `mlx5_0`), and a prefill engine's KV handed to a
decode engine on the GPU, which continues exactly as one engine would. The pools sit on cuda:0 and
cuda:1 when there are two GPUs, else both on cuda:0.

Needs CUDA and Mooncake's CUDA build (`make test-gpu` swaps the CPU wheel for it); skipped without.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kv_transfer import MooncakeTransport, RemotePages, TransportConfig, create_transport  # noqa: E402
from kv_transfer.mooncake_backend import installed_build_moves_gpu_memory  # noqa: E402

if not installed_build_moves_gpu_memory():
    pytest.skip("Mooncake's CUDA build is not installed (make test-gpu installs it)", allow_module_level=True)

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402
from server_runtime.kv_send import KVSend, KVSendConnector  # noqa: E402
from tests.local_handoff import confirm, take_kv_in  # noqa: E402

SRC = torch.device("cuda:0")
DST = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
RDMA_DEVICES = os.environ.get("TANDEM_TEST_RDMA_DEVICES", "")
PROTOCOLS = ["tcp", *(["rdma"] if RDMA_DEVICES else [])]
NUM_PAGES, PAGE_SHAPE = 32, (4, 2, 16, 2, 64)   # per page: layers, K/V, tokens, KV heads, head_dim


def _transport(protocol: str) -> MooncakeTransport:
    device_name = RDMA_DEVICES if protocol == "rdma" else ""
    transport = create_transport(TransportConfig(backend="mooncake", protocol=protocol, device_name=device_name))
    assert isinstance(transport, MooncakeTransport)
    return transport


@pytest.fixture(params=PROTOCOLS)
def gpu_pair(request: pytest.FixtureRequest) -> Iterator[tuple[torch.Tensor, MooncakeTransport, torch.Tensor,
                                                                MooncakeTransport]]:
    src = torch.randn(NUM_PAGES, *PAGE_SHAPE, device=SRC).to(torch.bfloat16)
    dst = torch.zeros(NUM_PAGES, *PAGE_SHAPE, dtype=torch.bfloat16, device=DST)
    sender, receiver = _transport(request.param), _transport(request.param)
    sender.register(src.data_ptr(), src.numel() * src.element_size(), str(src.device))
    receiver.register(dst.data_ptr(), dst.numel() * dst.element_size(), str(dst.device))
    yield src, sender, dst, receiver
    sender.close()
    receiver.close()


def test_pages_move_from_one_gpu_pool_into_another(gpu_pair) -> None:
    src, sender, dst, receiver = gpu_pair
    page_bytes = src[0].numel() * src.element_size()
    src_pages, dst_pages = [3, 4, 5, 9, 0], [10, 11, 12, 2, 31]   # two coalesced runs and two single pages
    torch.cuda.synchronize(SRC)   # the pool's values are written before Mooncake reads them
    stats = sender.write_pages(src.data_ptr(), src_pages,
                               RemotePages(receiver.session_id, dst.data_ptr(), page_bytes, tuple(dst_pages))
                               ).result(timeout=30)
    assert (stats.num_bytes, stats.num_writes) == (5 * page_bytes, 3)
    torch.testing.assert_close(dst[dst_pages].cpu(), src[src_pages].cpu(), rtol=0, atol=0)
    untouched = [p for p in range(NUM_PAGES) if p not in dst_pages]
    assert not dst[untouched].any()


PROMPT = list(range(100, 137))   # 37 tokens: three pages of 16, the last one partly filled
GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


def _run_to_end(engine: Engine) -> list[int]:
    tokens = []
    while engine.has_work:
        tokens += [out.token_id for out in engine.step() if out.token_id is not None]
    return tokens


def test_a_decode_engine_on_a_gpu_continues_from_kv_written_into_its_pool(smollm2_path: Path) -> None:
    """Prefill on SRC, KV over Mooncake into the decode engine's pool on DST, decode there: the same
    greedy tokens as one engine on DST that prefills and decodes alone."""
    checkpoint = open_checkpoint(str(smollm2_path))
    config = dict(dtype="bfloat16", max_total_tokens=1024)
    prefill = Engine(checkpoint, EngineConfig(device=str(SRC), **config), progress=False)
    decode = Engine(checkpoint, EngineConfig(device=str(DST), **config), progress=False)
    alone = Engine(checkpoint, EngineConfig(device=str(DST), **config), progress=False)
    sender, receiver = _transport("tcp"), _transport("tcp")
    try:
        for engine, transport in ((prefill, sender), (decode, receiver)):
            pool = engine.runner.kv_pool
            transport.register(pool.base_addr, pool.num_bytes, str(pool.device))
        take_kv_in(decode)  # as a decode worker's
        dst_pages = decode.reserve("h", len(PROMPT)).page_ids
        dst = RemotePages(receiver.session_id, decode.runner.kv_pool.base_addr, decode.runner.layout.page_bytes,
                          tuple(dst_pages))
        send = KVSend(dst, 0, int((time.time() + 30) * 1000), timeout_s=30)
        prefill.kv_connector = KVSendConnector(sender, prefill.runner.kv_pool.base_addr)  # as a prefill worker's
        prefill.add_request(Request("h", list(PROMPT), GREEDY, is_prefill_only=True, kv_params=send))
        [first] = prefill.step()   # reads the sampled token to the host: the step's KV writes are done
        send.written.result(timeout=30)
        assert prefill.poll_kv() == ["h"]
        confirm(decode, "h", list(PROMPT), first.token_id, first.logprob, GREEDY)
        handed_off = [first.token_id, *_run_to_end(decode)]
    finally:
        sender.close()
        receiver.close()
    alone.add_request(Request("a", list(PROMPT), GREEDY))
    assert handed_off == _run_to_end(alone)
