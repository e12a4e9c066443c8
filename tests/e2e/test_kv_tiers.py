"""KV computed once, through `tandem serve` (three real processes, the bundled SmolLM2) with a disk tier:
a chat's second turn sends only the KV its decode worker lacks (the first turn's prompt and answer stay
cached there), and after every process is restarted over the same directory the same prompt's pages are
read back from disk, with the same greedy tokens, instead of being computed."""

from __future__ import annotations

import random
import re
from pathlib import Path

import httpx

from tests.e2e.stack import start_stack

PAGE = 16
NEW_TOKENS = 16


def _generate(url: str, ids: list[int]) -> dict:
    reply = httpx.post(f"{url}/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _tier_pages(metrics: str, tier: str, state: str) -> float:
    found = re.search(rf'tandem_worker_kv_tier_pages{{state="{state}",tier="{tier}"}} (\S+)', metrics)
    found = found or re.search(rf'tandem_worker_kv_tier_pages{{tier="{tier}",state="{state}"}} (\S+)', metrics)
    assert found, f"no {tier}/{state} tier gauge in:\n{metrics[:2000]}"
    return float(found.group(1))


def test_a_second_turn_sends_what_decode_lacks_and_a_restart_reads_pages_back_from_disk(tmp_path: Path) -> None:
    rng = random.Random(27)
    first_prompt = [rng.randrange(100, 40000) for _ in range(300)]
    flags = ("--kv-disk-cache-dir", str(tmp_path / "kv"))
    for run in ("first", "again"):
        (tmp_path / run).mkdir()
    stack = start_stack(tmp_path / "first", *flags)
    try:
        first = _generate(stack.url, first_prompt)
        second_prompt = first_prompt + first["output_ids"] + [rng.randrange(100, 40000) for _ in range(20)]
        second = _generate(stack.url, second_prompt)
        stack.assert_no_pages_held()
    finally:
        assert stack.stop() == []
    whole, part = first["meta_info"]["tandem_timings"], second["meta_info"]["tandem_timings"]
    page_bytes = whole["kv_bytes"] // -(-len(first_prompt) // PAGE)   # the first turn sent every page
    held = (len(first_prompt) + NEW_TOKENS - 1) // PAGE * PAGE          # its prompt and answer, but the last token
    assert (whole["decode_cached_tokens"], part["decode_cached_tokens"]) == (0, held)
    assert part["kv_bytes"] == (-(-len(second_prompt) // PAGE) - held // PAGE) * page_bytes
    assert part["kv_bytes"] < whole["kv_bytes"] / 4

    restarted = start_stack(tmp_path / "again", *flags)   # new processes over the same directory
    try:
        again = _generate(restarted.url, second_prompt)
        assert again["output_ids"] == second["output_ids"]
        # the prefill worker reads back every full page of the prompt but the one with its last token
        assert again["meta_info"]["cached_tokens"] == (len(second_prompt) - 1) // PAGE * PAGE
        assert _tier_pages(restarted.worker_metrics("prefill"), "disk", "loaded") >= len(second_prompt) // PAGE - 1
        assert _tier_pages(restarted.worker_metrics("prefill"), "disk", "dropped") == 0
        # so does the decode worker's reservation (read off its engine thread), which the prefill then skips
        cacheable = (len(second_prompt) - 1) // PAGE * PAGE
        assert again["meta_info"]["tandem_timings"]["decode_cached_tokens"] == cacheable
        assert _tier_pages(restarted.worker_metrics("decode"), "disk", "loaded") == cacheable // PAGE
        restarted.assert_no_pages_held()
    finally:
        assert restarted.stop() == []
