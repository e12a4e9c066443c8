"""The prefix cache's tiers with the KV pool on a GPU: host copies in pinned memory and disk files come
back into GPU pages byte for byte, and an engine on CUDA whose small pool evicted a prompt's pages, then
restarted over its disk tier, serves them from host memory and from disk with the same greedy tokens as
an engine that computes everything. The CPU side: tests/unit/engine/test_kv_host_tier.py and
test_kv_disk_tier.py.

Needs CUDA; skipped without.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.kv_disk_tier import DiskTier  # noqa: E402
from engine.kv_host_tier import HostTier, TierChain  # noqa: E402
from engine.kv_pool import KVLayout, KVPool  # noqa: E402
from engine.prefix_cache import page_digest  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402
from tests.engine_runs import run_alone  # noqa: E402
from tests.tiny_models import save_tiny_llama  # noqa: E402

PROMPTS = [[3, 17, 42, 99, 5, 61, 7, 200, 31, 8, 44, 12, 90], [11, 250, 9, 128, 77, 6, 5, 4, 3, 2, 1, 60, 61]]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=3)


def test_pinned_host_copies_and_disk_files_come_back_into_gpu_pages(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    pool = KVPool(layout, num_pages=8, device="cuda")
    pool.tensor.normal_()
    chain = TierChain(HostTier(2**20, pool), DiskTier(tmp_path, 2**20, pool, "w"), None, "w")
    digest = page_digest(chain.root(""), [1, 2, 3, 4])
    chain.save(digest, 2)
    chain.disk.flush()
    assert chain.host.contains(digest) and chain.disk.contains(digest)
    assert chain.host.load(digest, 5) and chain.disk.load(digest, 6)
    torch.cuda.synchronize()
    assert torch.equal(pool.tensor[5], pool.tensor[2]) and torch.equal(pool.tensor[6], pool.tensor[2])


def _engine(model_dir: Path, **tiers) -> Engine:
    config = EngineConfig(dtype="float32", device="cuda", page_size=4, max_total_tokens=16, enable_prefix_cache=True,
                          attention_backend="torch", sampling_backend="torch", cuda_graph_batch_sizes=(), **tiers)
    return Engine(open_checkpoint(str(model_dir)), config, progress=False)


def test_an_engine_on_cuda_serves_evicted_pages_from_host_memory_and_from_disk_after_a_restart(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "llama")
    reference = _engine(model_dir)
    expected = [run_alone(reference, f"r{i}", p, GREEDY)[0] for i, p in enumerate(PROMPTS)]
    tiers = dict(kv_host_cache_gib=0.01, kv_disk_cache_dir=str(tmp_path / "kv"))
    tiered = _engine(model_dir, **tiers)
    assert run_alone(tiered, "a", PROMPTS[0], GREEDY) == (expected[0], 0)
    assert run_alone(tiered, "b", PROMPTS[1], GREEDY) == (expected[1], 0)   # a 4-page pool: the first prompt's pages go
    assert run_alone(tiered, "a2", PROMPTS[0], GREEDY) == (expected[0], 12)
    assert tiered.kv_tiers.host.num_loaded == 3
    tiered.kv_tiers.disk.flush()
    restarted = _engine(model_dir, **tiers)
    assert run_alone(restarted, "a3", PROMPTS[0], GREEDY) == (expected[0], 12)
    assert restarted.kv_tiers.disk.num_loaded == 3


def test_the_cluster_store_takes_and_gives_back_gpu_pages(tmp_path: Path) -> None:
    """The store tier copies a GPU page to the host to put it, and back into a GPU page after the tag checks."""
    pytest.importorskip("mooncake.store", reason="Mooncake Store is not installed")
    from engine.kv_store_tier import StoreTier
    from kv_transfer.mooncake_store import StoreClient
    from tests.integration.test_kv_store import _connected, start_store

    store = start_store(tmp_path / "store.log")
    try:
        layout = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
        pool = KVPool(layout, num_pages=8, device="cuda")
        pool.tensor.normal_()
        tier = StoreTier(_connected(StoreClient(store.address, "127.0.0.1")), pool, b"k" * 32)
        digest = page_digest(b"root", [1, 2, 3, 4])
        tier.save(digest, 2)
        tier.store.flush()
        assert tier.contains(digest) and tier.load(digest, 7)
        assert torch.equal(pool.tensor[7], pool.tensor[2]) and tier.num_dropped == 0
    finally:
        store.process.terminate()
        store.process.wait(20)
