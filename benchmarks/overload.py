"""N generations at once against a small decode pool: how many are served or refused, and their latency.

    python benchmarks/overload.py --launch                       # 200 at once, a 128-page decode pool
    python benchmarks/overload.py --url http://127.0.0.1:30000 --concurrency 500

Each request is a greedy completion of --max-tokens tokens (ignore_eos), half of them streamed. With
--launch the stack runs with `--max-total-tokens 2048` (128 pages of 16 tokens) and the flags of
--serve-args. Prints served / refused (by status and code) and the p50 / p99 / max latency of the
served ones, end to end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster_runs import percentile  # noqa: E402


def one(url: str, i: int, max_tokens: int) -> tuple[int, str, float]:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": f"Request {i}: write a short story about the sea.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": i % 2 == 1,
    }
    started = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
    seconds = time.perf_counter() - started
    if reply.status_code != 200:
        return reply.status_code, reply.json()["error"].get("code") or "", seconds
    if body["stream"] and '"error"' in reply.text:
        return 200, "error event", seconds
    return 200, "", seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running gateway (default: --launch one)")
    parser.add_argument("--launch", action="store_true", help="start `tandem serve` for the run and stop it after")
    parser.add_argument("--serve-args", default="", help="extra flags for `tandem serve` with --launch")
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if not args.url and not args.launch:
        parser.error("give --url of a running gateway or --launch")
    stack = None
    if args.launch:
        from tests.e2e.stack import start_stack

        stack = start_stack(Path(tempfile.mkdtemp()), "--max-total-tokens", "2048", *args.serve_args.split())
    url = args.url or stack.url
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda i: one(url, i, args.max_tokens), range(args.concurrency)))
        wall = time.perf_counter() - started
    finally:
        if stack is not None:
            stack.stop()
    served = [s for status, code, s in results if status == 200 and not code]
    refused = Counter(f"{status} {code}".strip() for status, code, _ in results if status != 200 or code)
    report = {
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "served": len(served),
        "refused": dict(refused),
        "wall_s": round(wall, 1),
    }
    if served:
        report.update(
            p50_s=round(statistics.median(served), 2),
            p99_s=round(percentile(served, 0.99), 2),
            max_s=round(max(served), 2),
        )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
