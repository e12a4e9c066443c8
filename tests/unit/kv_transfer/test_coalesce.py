"""Page-run coalescing and byte-level write plans (kv_transfer/pages.py)."""

import pytest

from kv_transfer import KVTransferError, PageRun, RemotePages, coalesce_page_runs, plan_page_writes


def test_empty_input_gives_no_runs() -> None:
    assert coalesce_page_runs([], []) == ()


def test_fully_consecutive_pairs_become_one_run() -> None:
    assert coalesce_page_runs([4, 5, 6, 7], [10, 11, 12, 13]) == (PageRun(4, 10, 4),)


def test_run_breaks_when_only_one_side_is_consecutive() -> None:
    runs = coalesce_page_runs([0, 1, 2, 3], [0, 1, 5, 6])
    assert runs == (PageRun(0, 0, 2), PageRun(2, 5, 2))
    runs = coalesce_page_runs([0, 2, 3], [7, 8, 9])
    assert runs == (PageRun(0, 7, 1), PageRun(2, 8, 2))


def test_mixed_runs_and_singletons() -> None:
    runs = coalesce_page_runs([0, 1, 2, 7, 9, 10], [5, 6, 7, 20, 1, 2])
    assert runs == (PageRun(0, 5, 3), PageRun(7, 20, 1), PageRun(9, 1, 2))


def test_input_order_does_not_limit_coalescing() -> None:
    assert coalesce_page_runs([3, 1, 2], [13, 11, 12]) == (PageRun(1, 11, 3),)


def test_runs_cover_exactly_the_input_pairs() -> None:
    src = [8, 3, 4, 0, 9, 1, 5]
    dst = [2, 30, 31, 10, 3, 11, 40]
    expanded = {(r.src_page_id + i, r.dst_page_id + i) for r in coalesce_page_runs(src, dst)
                for i in range(r.num_pages)}
    assert expanded == set(zip(src, dst))


def test_length_mismatch_raises() -> None:
    with pytest.raises(KVTransferError, match="3 source pages but 2 destination"):
        coalesce_page_runs([0, 1, 2], [0, 1])


def test_negative_and_duplicate_destination_ids_raise() -> None:
    with pytest.raises(KVTransferError, match="non-negative"):
        coalesce_page_runs([-1], [0])
    with pytest.raises(KVTransferError, match="distinct"):
        coalesce_page_runs([0, 1], [4, 4])


def test_one_source_page_may_feed_several_destinations() -> None:
    assert coalesce_page_runs([2, 2], [0, 5]) == (PageRun(2, 0, 1), PageRun(2, 5, 1))


def test_plan_converts_runs_to_addresses() -> None:
    dst = RemotePages(session_id="peer", base_addr=1_000_000, page_bytes=256, page_ids=(5, 6, 9))
    plan = plan_page_writes(4096, [0, 1, 3], dst)
    assert plan.src_addrs == (4096, 4096 + 3 * 256)
    assert plan.dst_addrs == (1_000_000 + 5 * 256, 1_000_000 + 9 * 256)
    assert plan.lengths == (512, 256)
    assert plan.num_writes == 2
    assert plan.num_bytes == 3 * 256


def test_plan_rejects_bad_source_base_and_mismatch() -> None:
    dst = RemotePages(session_id="peer", base_addr=4096, page_bytes=64, page_ids=(0, 1))
    with pytest.raises(KVTransferError, match="src_base_addr"):
        plan_page_writes(0, [0, 1], dst)
    with pytest.raises(KVTransferError, match="destination pages"):
        plan_page_writes(4096, [0], dst)
