"""Two prefill and two decode workers under one gateway (`tandem serve --prefill-workers 2
--decode-workers 2`, real processes on loopback, the bundled SmolLM2 in fp32): prefix-aware routing
keeps one prefix on one prefill worker, a burst spreads over both decode workers, and short prompts
are prefilled by their decode worker with the same greedy text as through a prefill worker. After
every test no worker holds a KV page."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster_stack import (
    Cluster,
    assert_no_pages_held,
    difference,
    per_worker,
    route_counts,
    start_cluster,
    wait_workers_ready,
)
from tests.e2e.stack import _launch, free_port

pytestmark = pytest.mark.slow

LOCAL_PREFILL_THRESHOLD = 12  # tokens: "Hello there" and the like go to their decode worker
FLAGS = (
    "--dtype",
    "float32",
    "--quantization",
    "none",
    "--torch-threads",
    "1",
    "--max-total-tokens",
    "4096",
    "--context-length",
    "1024",
    "--router-policy",
    "prefix_aware",
    "--local-prefill-threshold",
    str(LOCAL_PREFILL_THRESHOLD),
)
# Over four pages (16 tokens each) of shared instructions, then a different question each time.
SYSTEM = (
    "You are a careful assistant for a travel agency. You answer questions about rivers, mountains, "
    "cities and the weather in one short sentence, and you never invent facts you are not sure of. "
    "When a question is unclear, you ask for the missing detail first. You write plain text without "
    "lists, and you keep a friendly tone with every traveller. "
)
# Each question over 16 tokens: what its decode worker lacks (it keeps the instructions from the last one)
# stays above --local-prefill-threshold, so every one goes through a prefill worker.
QUESTIONS = (
    "Where exactly is the city of Lima, and which country is it the capital of, if any at all?",
    "How long is the river Nile from its source to the sea, and which countries does it cross?",
    "Is the city of Oslo usually cold in the month of May, or is it already warm enough for walks?",
    "What is the mountain called K2, how high is it, and where does it stand on the map exactly?",
    "Can you name one large lake in the south of Chile that travellers like to visit in summer?",
    "Which of the seas between Europe and Asia is the saltiest, and why is its water so salty?",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("cluster"), 2, 2, *FLAGS)
    try:
        yield cluster
    finally:
        cluster.stop()
    assert cluster.proc.returncode == 0


@pytest.fixture(autouse=True)
def no_page_held(cluster: Cluster) -> Iterator[None]:
    yield
    assert_no_pages_held(cluster.worker_ports)


def _generate(url: str, text: str, max_new_tokens: int = 4) -> dict:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    reply = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_one_prefix_stays_on_one_prefill_worker_and_hits_its_cache(cluster: Cluster) -> None:
    before = route_counts(cluster.url)
    metas = [_generate(cluster.url, SYSTEM + question)["meta_info"] for question in QUESTIONS]  # one at a time
    prefills = difference(per_worker(route_counts(cluster.url), "prefill"), per_worker(before, "prefill"))
    print(f"prefill decisions: {prefills}; cached tokens: {[m['cached_tokens'] for m in metas]}")
    assert list(prefills.values()) == [len(QUESTIONS)]  # all on one worker: the load never left the guard
    assert all(m["tandem_timings"]["prefill_path"] == "disaggregated" for m in metas)
    assert metas[0]["cached_tokens"] == 0
    assert all(m["cached_tokens"] >= 64 for m in metas[1:]), [m["cached_tokens"] for m in metas]  # 4+ pages
    reasons = difference(
        {r: v for (role, _, r), v in route_counts(cluster.url).items() if role == "prefill"},
        {r: v for (role, _, r), v in before.items() if role == "prefill"},
    )
    assert reasons.get("prefix_match") == len(QUESTIONS) - 1, reasons


def test_a_burst_of_16_spreads_over_both_decode_workers(cluster: Cluster) -> None:
    before = per_worker(route_counts(cluster.url), "decode")
    prompts = [f"Request {i}: write one sentence about the number {i} and why it is interesting." for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda p: _generate(cluster.url, p, 8), prompts))
    decodes = difference(per_worker(route_counts(cluster.url), "decode"), before)
    print(f"decode decisions for the burst: {decodes}")
    assert len(replies) == 16 and sum(decodes.values()) == 16
    assert len(decodes) == 2 and min(decodes.values()) >= 6, decodes  # counted in flight at each decision


def test_short_prompts_skip_the_prefill_workers_and_give_the_same_greedy_text(cluster: Cluster, tmp_path: Path) -> None:
    short = ["Hello there", "The capital of France is", "1, 2, 3,"]
    before = per_worker(route_counts(cluster.url), "prefill")
    local = [_generate(cluster.url, text, 12) for text in short]
    assert per_worker(route_counts(cluster.url), "prefill") == before  # no prefill worker was asked
    for reply in local:
        timings = reply["meta_info"]["tandem_timings"]
        assert reply["meta_info"]["prompt_tokens"] < LOCAL_PREFILL_THRESHOLD
        assert (timings["prefill_path"], timings["kv_bytes"], timings["reserve_ms"]) == ("local", 0, 0)

    # The same prompts through a second gateway over the same workers that always disaggregates.
    port = free_port()
    addresses = [a for p in cluster.prefill_ports for a in ("--prefill", f"127.0.0.1:{p}")]
    addresses += [a for p in cluster.decode_ports for a in ("--decode", f"127.0.0.1:{p}")]
    gateway = _launch(
        [
            "gateway",
            "--port",
            str(port),
            "--grpc-port",
            "0",
            "--data-dir",
            str(tmp_path / "data"),
            "--local-prefill-threshold",
            "0",
            *addresses,
        ],
        tmp_path / "gateway.log",
    )
    try:
        wait_workers_ready(f"http://127.0.0.1:{port}", cluster.worker_ports, 120)
        remote = [_generate(f"http://127.0.0.1:{port}", text, 12) for text in short]
    finally:
        gateway.terminate()
        try:
            gateway.wait(30)
        except subprocess.TimeoutExpired:
            gateway.kill()
    assert all(r["meta_info"]["tandem_timings"]["prefill_path"] == "disaggregated" for r in remote)
    assert [r["output_ids"] for r in local] == [r["output_ids"] for r in remote]
    assert [r["text"] for r in local] == [r["text"] for r in remote]


def test_server_info_lists_every_worker_and_no_incompatible_pair(cluster: Cluster) -> None:
    info = httpx.get(f"{cluster.url}/get_server_info", timeout=10).json()
    assert sorted(w["address"] for w in info["workers"]) == sorted(f"127.0.0.1:{p}" for p in cluster.worker_ports)
    assert all(w["ready"] and w["num_in_flight"] == 0 for w in info["workers"])
    assert info["incompatible_pairs"] == [] and info["routing"]["policy"] == "prefix_aware"
    loads = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    for role, ports in (("prefill", cluster.prefill_ports), ("decode", cluster.decode_ports)):
        for port in ports:  # each worker's load, as the router sees it
            line = (
                rf'^tandem_gateway_worker_load\{{measure="in_flight",role="{role}",'
                rf'worker="127\.0\.0\.1:{port}"\}} [0-9.e+-]+$'
            )
            assert re.search(line, loads, re.MULTILINE), (role, port)
