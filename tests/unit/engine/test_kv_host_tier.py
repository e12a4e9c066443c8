"""The prefix cache's host-memory tier and the tier chain (engine/kv_host_tier.py): copies come back byte
for byte, the capacity drops the least recently used, a page found only on disk is kept in host memory on
its way back; and an engine whose small pool evicted a prompt's pages serves them again from host memory
with the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_disk_tier import DiskTier
from engine.kv_host_tier import HostTier, TierChain
from engine.kv_pool import KVLayout, KVPool
from engine.prefix_cache import page_digest
from engine.request import SamplingParams
from engine.weights import open_checkpoint
from tests.engine_runs import run_alone
from tests.tiny_models import save_tiny_llama

LAYOUT = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def _pool() -> KVPool:
    pool = KVPool(LAYOUT, num_pages=8)
    pool.tensor.normal_()
    return pool


def test_host_copies_come_back_and_the_oldest_go_first(tmp_path: Path) -> None:
    pool = _pool()
    host = HostTier(2 * LAYOUT.page_bytes, pool)
    digests = [page_digest(b"root", [i] * 4) for i in range(3)]
    expected = pool.tensor[:3].clone()
    for page_id, digest in enumerate(digests):
        host.save(digest, page_id)
    pool.tensor.zero_()   # the pages are reused for something else
    assert [host.contains(d) for d in digests] == [False, True, True] and host.num_pages == 2
    assert host.load(digests[2], 7) and torch.equal(pool.tensor[7], expected[2])
    assert not host.load(digests[0], 6) and host.num_loaded == 1


def test_a_page_found_only_on_disk_is_kept_in_host_memory_on_its_way_back(tmp_path: Path) -> None:
    pool = _pool()
    disk = DiskTier(tmp_path, 2**20, pool, "weights-a")
    chain = TierChain(HostTier(2**20, pool), disk, None, "weights-a")
    assert chain.root("") == disk.root("")   # the same names in every tier
    digest = page_digest(chain.root(""), [1, 2, 3, 4])
    disk.save(digest, 3)
    assert chain.is_worth_fetching(digest) and not chain.contains(digest)  # a walk reads only what is at hand
    after, last = page_digest(digest, [5, 6, 7, 8]), page_digest(digest, [9, 9, 9, 9])
    reads = chain.fetch([digest, after, last])  # stops at the first page no tier has
    assert [(d, tier, read.payload is not None) for d, tier, read in reads] == [(digest, disk, True), (after, disk, False)]
    chain.adopt(reads)
    assert chain.contains(digest) and not chain.host.contains(digest)
    assert chain.load(digest, 5) and torch.equal(pool.tensor[5], pool.tensor[3])
    assert chain.host.contains(digest)
    assert [(s.tier, s.num_loaded) for s in chain.stats()] == [("host", 0), ("disk", 1)]


PROMPTS = [[3, 17, 42, 99, 5, 61, 7, 200, 31, 8, 44, 12, 90], [11, 250, 9, 128, 77, 6, 5, 4, 3, 2, 1, 60, 61]]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=3)


def test_pages_the_pool_evicted_come_back_from_host_memory(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "llama")

    def engine(host_gib: float) -> Engine:
        config = EngineConfig(dtype="float32", page_size=4, max_total_tokens=16, enable_prefix_cache=True,
                              kv_host_cache_gib=host_gib)
        return Engine(open_checkpoint(str(model_dir)), config, progress=False)

    reference = engine(0.0)
    expected = [run_alone(reference, f"r{i}", p, GREEDY)[0] for i, p in enumerate(PROMPTS)]
    tiered = engine(0.01)   # a 4-page pool: the second prompt evicts the first's pages
    assert run_alone(tiered, "a", PROMPTS[0], GREEDY) == (expected[0], 0)
    assert run_alone(tiered, "b", PROMPTS[1], GREEDY) == (expected[1], 0)
    assert run_alone(tiered, "a2", PROMPTS[0], GREEDY) == (expected[0], 12)   # three pages copied back
    [host] = tiered.stats().tiers
    assert host.tier == "host" and host.num_loaded == 3
    tiered.pages.check_integrity()
