"""The prefix cache's disk tier (engine/kv_disk_tier.py): pages written and read back byte for byte,
found again by a new tier over the same directory (a restart), damaged files dropped and never served,
the capacity kept; and an engine restarted over its disk tier serves a prompt's prefix from it with the
same greedy tokens as an engine that computes everything."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_disk_tier import DiskTier
from engine.kv_pool import KVLayout, KVPool
from engine.page_allocator import PageAllocator
from engine.prefix_cache import PrefixCache, page_digest
from engine.request import FinishReason, Request, RequestStatus, SamplingParams
from engine.weights import open_checkpoint
from tests.engine_runs import run_alone
from tests.tiny_models import save_tiny_llama

LAYOUT = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def _pool() -> KVPool:
    pool = KVPool(LAYOUT, num_pages=8)
    pool.tensor.normal_()
    return pool


def _saved(tmp_path: Path, pool: KVPool, page_id: int, tokens: list[int]) -> tuple[DiskTier, bytes]:
    tier = DiskTier(tmp_path, 2**20, pool, "weights-a")
    digest = page_digest(tier.root(""), tokens)
    tier.save(digest, page_id)
    tier.flush()
    return tier, digest


def test_a_page_comes_back_byte_for_byte_in_a_new_tier_over_the_same_directory(tmp_path: Path) -> None:
    pool = _pool()
    tier, digest = _saved(tmp_path, pool, 3, [1, 2, 3, 4])
    assert tier.num_saved == 1 and tier.num_pages == 1
    restarted = DiskTier(tmp_path, 2**20, pool, "weights-a")
    assert restarted.contains(digest) and restarted.root("") == tier.root("")
    assert restarted.load(digest, 5) and restarted.num_loaded == 1
    assert torch.equal(pool.tensor[5], pool.tensor[3])
    assert not DiskTier(tmp_path, 2**20, pool, "weights-b").contains(digest)   # other weights: other names
    assert tier.root("adapter#1") != tier.root("")


@pytest.mark.parametrize("damage", ["truncate", "flip", "misname"])
def test_a_damaged_file_is_dropped_and_never_copied_into_the_pool(tmp_path: Path, damage: str) -> None:
    pool = _pool()
    tier, digest = _saved(tmp_path, pool, 3, [1, 2, 3, 4])
    [path] = tier.directory.glob("*/*.kv")
    data = bytearray(path.read_bytes())
    other = page_digest(tier.root(""), [9, 9, 9, 9])
    if damage == "truncate":
        path.write_bytes(data[:-100])
    elif damage == "flip":
        data[-7] ^= 0x40
        path.write_bytes(bytes(data))
    else:   # a whole, valid file under another page's name
        renamed = tier.directory / other.hex()[:2] / f"{other.hex()}.kv"
        renamed.parent.mkdir(exist_ok=True)
        path.rename(renamed)
        digest = other
    restarted = DiskTier(tmp_path, 2**20, pool, "weights-a")
    before = pool.tensor[5].clone()
    assert restarted.contains(digest)
    assert not restarted.load(digest, 5)
    assert torch.equal(pool.tensor[5], before) and restarted.num_dropped == 1
    assert not restarted.contains(digest) and not list(tier.directory.glob("*/*.kv"))


def test_the_capacity_deletes_the_least_recently_used_pages(tmp_path: Path) -> None:
    pool = _pool()
    file_bytes = LAYOUT.page_bytes + 64
    writer = concurrent.futures.ThreadPoolExecutor(1)   # as a worker runs it: writes off the calling thread
    tier = DiskTier(tmp_path, 2 * file_bytes, pool, "weights-a", background=writer.submit)
    digests = [page_digest(tier.root(""), [i] * 4) for i in range(3)]
    tier.save(digests[0], 0)
    tier.save(digests[1], 1)
    tier.flush()
    tier.save(digests[0], 0)   # touched again: digests[1] is now the oldest
    tier.save(digests[2], 2)
    tier.flush()
    assert [tier.contains(d) for d in digests] == [True, False, True]
    assert len(list(tier.directory.glob("*/*.kv"))) == 2
    writer.shutdown()


PROMPT = [3, 17, 42, 99, 5, 61, 7, 200, 31, 8, 44, 12, 90, 1]   # 14 tokens: three full pages of 4
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=6)


def _engine(model_dir: Path, disk: Path | None, background: Callable | None = None) -> Engine:
    config = EngineConfig(dtype="float32", page_size=4, max_total_tokens=128, enable_prefix_cache=True,
                          kv_disk_cache_dir=None if disk is None else str(disk))
    return Engine(open_checkpoint(str(model_dir)), config, progress=False, background=background)


def _run(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    return run_alone(engine, "r", prompt, GREEDY)


def test_a_restarted_engine_serves_the_prefix_from_disk_with_the_same_tokens(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "llama")
    expected, _ = _run(_engine(model_dir, None), PROMPT)
    first = _engine(model_dir, tmp_path / "kv")
    assert _run(first, PROMPT) == (expected, 0)
    first.kv_tiers.disk.flush()
    # 14 + 6 - 1 tokens had KV: four full pages on disk (the prompt's three and one of its output)
    assert first.kv_tiers.disk.num_pages == 4

    restarted = _engine(model_dir, tmp_path / "kv")
    assert _run(restarted, PROMPT) == (expected, 12)   # three pages read back; the last 2 tokens computed
    assert restarted.stats().tiers[0].num_loaded == 3
    restarted.pages.check_integrity()

    for path in restarted.kv_tiers.disk.directory.glob("*/*.kv"):   # every file damaged: all recomputed
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    damaged = _engine(model_dir, tmp_path / "kv")
    assert _run(damaged, PROMPT) == (expected, 0)
    assert damaged.kv_tiers.disk.num_dropped == 1   # the first page's: the walk stops there


def test_a_prompt_waits_as_loading_while_its_pages_are_read_and_the_others_run_meanwhile(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "llama")
    other = [9, 8, 7, 6, 5]
    expected, _ = _run(_engine(model_dir, None), PROMPT)
    other_expected, _ = run_alone(_engine(model_dir, None), "o", other, GREEDY)
    first = _engine(model_dir, tmp_path / "kv")
    _run(first, PROMPT)
    first.kv_tiers.disk.flush()

    jobs: list[Callable[[], None]] = []  # the background: each job runs when the test says
    restarted = _engine(model_dir, tmp_path / "kv", background=jobs.append)
    woken: list[bool] = []
    restarted.wake = lambda: woken.append(True)
    restarted.add_request(Request("r", list(PROMPT), GREEDY))
    restarted.add_request(Request("o", list(other), GREEDY))  # nothing of it on disk: queued at once
    assert list(restarted.scheduler.loading) == ["r"]
    assert (restarted.stats().num_waiting, restarted.stats().num_loading) == (2, 1)
    assert len(jobs) == 1  # the read of r's three pages, not yet run
    tokens: dict[str, list[int]] = {"r": [], "o": []}
    while restarted.has_work:  # r is not scheduled: o runs alone, to its end
        for out in restarted.step():
            tokens[out.request_id] += [out.token_id] if out.token_id is not None else []
    assert tokens == {"r": [], "o": other_expected} and restarted.holds("r") and not woken
    assert restarted.scheduler.loading["r"].status is RequestStatus.LOADING

    jobs.pop(0)()  # the read, as the background thread would run it
    assert woken == [True] and not restarted.has_work
    restarted.poll_kv()  # r queues, its three pages already in the pool as cached pages
    assert restarted.has_work and not restarted.scheduler.loading
    cached = -1
    while restarted.has_work:
        for out in restarted.step():
            tokens[out.request_id] += [out.token_id] if out.token_id is not None else []
            cached = out.cached_tokens if cached < 0 else cached
    assert tokens["r"] == expected and cached == 12 and restarted.stats().tiers[0].num_loaded == 3
    restarted.pages.check_integrity()
    while jobs:  # the disk writes of both prompts' pages
        jobs.pop(0)()


def test_a_loading_prompt_can_be_aborted_and_its_read_is_still_taken_in(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "llama")
    first = _engine(model_dir, tmp_path / "kv")
    _run(first, PROMPT)
    first.kv_tiers.disk.flush()
    jobs: list[Callable[[], None]] = []
    restarted = _engine(model_dir, tmp_path / "kv", background=jobs.append)
    restarted.add_request(Request("r", list(PROMPT), GREEDY))
    out = restarted.abort("r")
    assert out is not None and out.finish_reason is FinishReason.ABORT and not restarted.holds("r")
    jobs.pop(0)()
    assert restarted.poll_kv() == [] and not restarted.has_work and restarted.is_idle
    assert restarted.allocator.num_free == restarted.allocator.num_pages  # nothing kept for a request that is gone
    restarted.pages.check_integrity()


def test_a_page_another_process_writes_later_is_found_by_its_file(tmp_path: Path) -> None:
    pool = _pool()
    reader = DiskTier(tmp_path, 2**20, pool, "weights-a")   # started first: its index holds nothing
    writer, digest = _saved(tmp_path, pool, 3, [1, 2, 3, 4])   # another worker sharing the directory
    assert reader.contains(digest) and reader.load(digest, 6)
    assert torch.equal(pool.tensor[6], pool.tensor[3])
    assert not reader.contains(page_digest(reader.root(""), [5, 5, 5, 5]))


def test_only_the_base_models_pages_go_beyond_the_pool(tmp_path: Path) -> None:
    """An adapter's cache id names one load in one process: the same id after a restart may be other weights."""
    pool = _pool()
    tier = DiskTier(tmp_path, 2**20, pool, "weights-a")
    cache = PrefixCache(PageAllocator(pool.num_pages), LAYOUT.page_size, tier)
    tokens = list(range(9))   # two full pages
    for namespace in ("sql#1", ""):
        pages = cache.allocate(3)
        cache.insert(tokens, pages, 0, namespace)
        cache.release(pages)
    tier.flush()
    assert tier.num_pages == 2
    cache.flush()
    assert cache.match(tokens, "sql#1") == [] and len(cache.match(tokens, "")) == 2   # the base model's, from disk
    assert tier.num_loaded == 2
