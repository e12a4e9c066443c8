"""CUDA-graph decode on a GPU (engine/cuda_graph.py): a replayed graph equals its body run eagerly on the
same inputs, bit for bit; and an engine that replays graphs (padded batches, a batch too large for every
graph) generates the greedy tokens of one that decodes eagerly. The CPU side (padding, buffers, fallback)
is tests/unit/engine/test_cuda_graph.py.

Needs CUDA and FlashInfer (graphs are captured with the flashinfer attention backend); skipped without.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer", reason="pip install -e '.[gpu]' installs FlashInfer")

from engine.config import EngineConfig  # noqa: E402
from engine.cuda_graph import padded_decode_batch  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
PROMPTS = [list(range(100, 100 + n)) for n in (5, 16, 17, 40, 3)]   # page boundaries: 16 tokens a page


def _engine(model: Path, graph_sizes: tuple[int, ...]) -> Engine:
    config = EngineConfig(dtype="bfloat16", device="cuda", max_total_tokens=4096, attention_backend="flashinfer",
                          sampling_backend="torch", cuda_graph_batch_sizes=graph_sizes)
    return Engine(open_checkpoint(str(model)), config, progress=False)


def _generate(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(prompt), GREEDY))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
    return tokens


def test_graphs_are_captured_at_start_up_and_logged(smollm2_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engine.cuda_graph")
    engine = _engine(smollm2_path, (1, 2, 4, 8))
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.batch_sizes == (1, 2, 4, 8)
    assert "captured 4 CUDA graphs for decode batch sizes 1,2,4,8" in caplog.text
    assert engine.runner.kv_pool.scratch_page_ids == (engine.runner.kv_pool.num_pages,)
    assert _engine(smollm2_path, ()).runner.decode_graphs is None


@torch.inference_mode()
def test_a_replay_equals_the_graph_body_run_eagerly_on_the_same_inputs(smollm2_path: Path) -> None:
    engine = _engine(smollm2_path, (1, 2, 4, 8))
    requests = [Request(f"r{i}", list(p), GREEDY) for i, p in enumerate(PROMPTS)]
    for req in requests:
        engine.add_request(req)
    engine.step()   # prefill: every request has its first token and its KV
    decoding = [engine._requests[f"r{i}"] for i in range(len(PROMPTS))]
    assert engine.scheduler._grow_decode_pages(decoding) == []   # room for the token each writes next
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    replayed, batch = graphs.replay(decoding)   # 5 requests: the graph of 8, three dummy rows
    replayed = replayed.clone()
    assert replayed.shape[0] == 5 and batch.logit_rows.tolist() == [0, 1, 2, 3, 4]
    host = padded_decode_batch(decoding, 8, graphs._scratch_page, graphs._page_size, pin=True)
    graphs._load(host)   # the same inputs and plan; the K/V it writes again are the values already there
    eager = graphs._forward(graphs._view(8, host.meta))[:5]
    assert torch.equal(replayed, eager)


def test_greedy_tokens_with_graphs_equal_eager_decode(smollm2_path: Path) -> None:
    """Five requests (a graph of 8, padded), then as they finish fewer; and with graphs of 1 and 2 only,
    a batch of five runs eagerly. All three engines pick the same greedy tokens."""
    eager = _generate(_engine(smollm2_path, ()), PROMPTS)
    assert _generate(_engine(smollm2_path, (1, 2, 4, 8)), PROMPTS) == eager
    small = _engine(smollm2_path, (1, 2))
    assert small.runner.decode_graphs is not None and small.runner.decode_graphs.replay(
        [Request(str(i), [1], GREEDY) for i in range(5)]) is None   # larger than every graph: eager
    assert _generate(small, PROMPTS) == eager
