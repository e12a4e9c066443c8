"""CUDA-graph decode on the CPU (engine/cuda_graph.py): everything but the capture and replay, which need
a GPU (tests/gpu/test_cuda_graph.py). Padded decode batches; the graph's body run eagerly through its fixed
buffers, equal to the unpadded step for the real rows and writing nothing outside their pages but the
scratch page; the fallback to eager for a step larger than every graph; when decode stays eager."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.cuda_graph import (
    DUMMY_TOKEN_ID,
    DecodeGraphs,
    capture_decode_graphs,
    configured_batch_sizes,
    padded_decode_batch,
    why_decode_runs_eagerly,
)
from engine.forward_batch import build_forward_batch
from engine.kv_pool import KVPool
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner
from engine.weights import open_checkpoint
from kernels.attention import AttentionMetadata, TorchAttention
from tests.tiny_models import save_tiny_llama, save_tiny_qwen2_moe

PAGE_SIZE = 4
NUM_PAGES = 16
SCRATCH = NUM_PAGES   # the pool's one scratch page follows its pages


class CapturableTorchAttention(TorchAttention):
    """The torch oracle, declared capturable so that `DecodeGraphs` runs on the CPU: its attention reads
    the page table from the metadata it is given, which here are the graphs' fixed buffers. Records
    the batch sizes prepared and each graph plan (FlashInfer's part, which needs a GPU)."""

    supports_cuda_graphs = True

    def __init__(self, *args, **kwargs) -> None:   # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.prepared: tuple[tuple[int, ...], int] | None = None
        self.graph_plans: list[AttentionMetadata] = []

    def prepare_cuda_graphs(self, batch_sizes: Sequence[int], max_num_pages: int) -> None:
        self.prepared = (tuple(batch_sizes), max_num_pages)

    def plan_cuda_graph(self, meta_host: AttentionMetadata) -> None:
        self.graph_plans.append(meta_host)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny"))
    config = EngineConfig(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=NUM_PAGES * PAGE_SIZE,
                          attention_backend="torch", sampling_backend="torch")
    return ModelRunner(open_checkpoint(str(model)), config, context_len=64, progress=False)


def _decoding_requests() -> list[Request]:
    """Two requests mid-decode: 6 + 1 tokens on pages [3, 1], 9 + 2 tokens on pages [7, 2, 5]."""
    first = Request("a", [5, 6, 7, 8, 9, 10], SamplingParams(), page_ids=[3, 1], output_ids=[11])
    second = Request("b", list(range(20, 29)), SamplingParams(), page_ids=[7, 2, 5], output_ids=[30, 31])
    for req in (first, second):
        req.num_computed = req.seq_len - 1
    return [first, second]


def test_padding_keeps_the_real_rows_and_sends_the_dummies_to_the_scratch_page() -> None:
    requests = _decoding_requests()
    plain = build_forward_batch(requests, [1] * len(requests), page_size=PAGE_SIZE)
    padded = padded_decode_batch(requests, 5, SCRATCH, PAGE_SIZE)
    meta, plain_meta = padded.meta, plain.meta
    assert padded.input_ids.tolist() == plain.input_ids.tolist() + [DUMMY_TOKEN_ID] * 3
    assert padded.positions.tolist() == plain.positions.tolist() + [0, 0, 0] == [6, 10, 0, 0, 0]
    assert padded.logit_rows.tolist() == [0, 1, 2, 3, 4]
    assert meta.query_lens == (1,) * 5 and meta.seq_lens == (7, 11, 1, 1, 1)
    # FlashInfer's CSR table: int32, pages of the real rows unchanged, one scratch page per dummy
    assert {t.dtype for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)} == {torch.int32}
    assert meta.qo_indptr.tolist() == [0, 1, 2, 3, 4, 5]
    assert meta.kv_indptr.tolist() == plain_meta.kv_indptr.tolist() + [6, 7, 8] == [0, 2, 5, 6, 7, 8]
    assert meta.kv_indices.tolist() == [3, 1, 7, 2, 5, SCRATCH, SCRATCH, SCRATCH]
    assert meta.kv_last_page_len.tolist() == [3, 3, 1, 1, 1]
    assert meta.write_pages.tolist() == [1, 5, SCRATCH, SCRATCH, SCRATCH]
    assert meta.write_offsets.tolist() == [2, 2, 0, 0, 0]
    assert padded_decode_batch(requests, 2, SCRATCH, PAGE_SIZE).input_ids.tolist() == plain.input_ids.tolist()
    with pytest.raises(ValueError, match="2 requests do not fit a batch of 1"):
        padded_decode_batch(requests, 1, SCRATCH, PAGE_SIZE)


def _prefilled_pool(runner: ModelRunner, requests: list[Request]) -> KVPool:
    """A pool with a scratch page holding every request's KV up to its newest token."""
    pool = KVPool(runner.layout, NUM_PAGES, "cpu", num_scratch_pages=1)
    for req in requests:
        host = build_forward_batch([Request(req.request_id, req.prompt_ids + req.output_ids[:-1], SamplingParams(),
                                          page_ids=req.page_ids)], [req.seq_len - 1], page_size=PAGE_SIZE)
        runner.attention.plan(host.meta)
        runner.model(host, runner.rotary, runner.attention, pool.tensor)
    return pool


@torch.inference_mode()
def test_the_graph_body_over_its_fixed_buffers_equals_the_unpadded_eager_step(runner: ModelRunner) -> None:
    requests = _decoding_requests()
    mc = runner.model_config
    attention = CapturableTorchAttention(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE_SIZE)
    eager_pool, graph_pool = _prefilled_pool(runner, requests), _prefilled_pool(runner, requests)
    assert torch.equal(eager_pool.tensor, graph_pool.tensor)

    plain = build_forward_batch(requests, [1] * len(requests), page_size=PAGE_SIZE)
    expected = runner.model(plain, runner.rotary, runner.attention, eager_pool.tensor)

    graphs = DecodeGraphs(runner.model, runner.rotary, attention, graph_pool, (1, 2, 4, 8), max_pages_per_sequence=16)
    assert attention.prepared == ((1, 2, 4, 8), 8 * 16)
    host = padded_decode_batch(requests, 4, SCRATCH, PAGE_SIZE)
    graphs._load(host)
    assert attention.graph_plans == [host.meta]   # planned once, from the host copy
    hidden = graphs._forward(graphs._view(4, host.meta))   # what the captured graph computes
    torch.testing.assert_close(hidden[:2], expected, rtol=1e-5, atol=1e-5)

    real_view = graphs._view(2, host.meta)   # what replay hands the runner: the real rows only
    assert real_view.logit_rows.tolist() == [0, 1] and real_view.input_ids.tolist() == plain.input_ids.tolist()
    assert real_view.meta.kv_indices.tolist() == plain.meta.kv_indices.tolist()
    assert (real_view.meta.query_lens, real_view.meta.seq_lens) == ((1, 1), (7, 11))

    # the real rows' pages got the same new K/V; the dummies wrote the scratch page and nothing else
    torch.testing.assert_close(graph_pool.tensor[:NUM_PAGES], eager_pool.tensor[:NUM_PAGES], rtol=1e-5, atol=1e-5)
    assert not eager_pool.tensor[SCRATCH].any() and graph_pool.tensor[SCRATCH, :, :, 0].any()


def test_a_step_larger_than_every_graph_runs_eagerly(runner: ModelRunner) -> None:
    mc = runner.model_config
    attention = CapturableTorchAttention(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE_SIZE)
    pool = KVPool(runner.layout, NUM_PAGES, "cpu", num_scratch_pages=1)
    graphs = DecodeGraphs(runner.model, runner.rotary, attention, pool, (1,), max_pages_per_sequence=16)
    assert graphs.replay(_decoding_requests()) is None   # 2 requests, the largest graph holds 1
    assert attention.graph_plans == []                   # nothing planned or copied for it
    with pytest.raises(ValueError, match="scratch page"):
        DecodeGraphs(runner.model, runner.rotary, attention, KVPool(runner.layout, NUM_PAGES, "cpu"), (1,), 16)


def test_decode_stays_eager_off_cuda_without_sizes_a_capturable_backend_or_for_moe(
        runner: ModelRunner, tmp_path: Path) -> None:
    mc = runner.model_config
    torch_attention = TorchAttention(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE_SIZE)
    capturable = CapturableTorchAttention(mc.num_heads, mc.num_kv_heads, mc.head_dim, PAGE_SIZE)
    cuda, sizes = torch.device("cuda"), (1, 2)
    assert why_decode_runs_eagerly(cuda, sizes, capturable, mc) is None
    assert "CUDA device, not cpu" in why_decode_runs_eagerly(torch.device("cpu"), sizes, capturable, mc)
    assert "--disable-cuda-graph" in why_decode_runs_eagerly(cuda, (), capturable, mc)
    assert "TorchAttention attention backend cannot be captured" in why_decode_runs_eagerly(
        cuda, sizes, torch_attention, mc)
    moe = open_checkpoint(str(save_tiny_qwen2_moe(tmp_path / "moe"))).config
    assert "MoE" in why_decode_runs_eagerly(cuda, sizes, capturable, moe)
    # the CPU runner: no graphs, no scratch page
    assert runner.decode_graphs is None and runner.kv_pool.scratch_page_ids == ()
    assert capture_decode_graphs(runner.model, runner.rotary, capturable, runner.kv_pool,
                                 EngineConfig(), mc, 64) is None


def test_the_configured_sizes_default_to_the_ladder_up_to_the_running_batch() -> None:
    assert configured_batch_sizes(EngineConfig(max_running_requests=20)) == (1, 2, 4, 8, 16, 20)
    assert configured_batch_sizes(EngineConfig(cuda_graph_batch_sizes=(3, 5))) == (3, 5)
    assert configured_batch_sizes(EngineConfig(cuda_graph_batch_sizes=())) == ()
