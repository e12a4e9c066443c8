"""Request priorities and tenant fairness under contention, on the bundled SmolLM2.

    python benchmarks/priority.py --launch                  # a stack with a 512-token KV pool per worker
    python benchmarks/priority.py --url http://127.0.0.1:30000

Priority: the median time to first token of `--probes` streamed completions at priority 0, sent one at
a time, first on a quiet server, then while `--flood` clients keep low-priority (10) completions of
`--flood-tokens` tokens in flight, and, for comparison, under the same flood with the probes at the
flood's own priority. Fairness: tenant A keeps `--clients-a` completions in flight and tenant B
`--clients-b` (`x-tandem-tenant`), both at one priority, for `--seconds`; each tenant's share of the
completions finished, with the tenant headers and without them (every caller one tenant: first come,
first served). The small pool makes the admission queue, not the CPU alone, the contention.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "SmolLM2-135M-Instruct"
LOW = 10  # the flood's priority; lower is served first
_CONTEXT = "The tide came in over the grey stones of the harbour while the gulls circled the boats. "


def _body(prompt: str, max_tokens: int, priority: int, stream: bool) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "priority": priority,
        "stream": stream,
    }


def ttft_s(client: httpx.Client, url: str, prompt: str, priority: int) -> float:
    """Seconds from sending a streamed completion to its first text chunk."""
    started = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=_body(prompt, 4, priority, True)) as reply:
        reply.raise_for_status()
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - started
                for _ in lines:  # read the stream to its end
                    pass
                return first
    raise RuntimeError("the stream ended without text")


class Load:
    """`num_clients` threads, each keeping one completion in flight until `stop()`; counts what finished."""

    def __init__(
        self,
        url: str,
        num_clients: int,
        max_tokens: int,
        priority: int,
        tenant: str | None,
        name: str,
        context: str = "",
    ) -> None:
        self.url, self.max_tokens, self.priority, self.name, self.context = url, max_tokens, priority, name, context
        self.headers = {"x-tandem-tenant": tenant} if tenant else {}
        self.num_done = self.num_failed = 0
        self._is_counting = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(num_clients)]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def count_from_now(self) -> None:
        with self._lock:
            self.num_done = self.num_failed = 0
            self._is_counting = True

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=900, headers=self.headers) as client:
            n = 0
            while not self._stop.is_set():
                prompt = f"{self.name} {i}.{n}: {self.context}Write a short story about the sea."
                reply = client.post(
                    f"{self.url}/v1/completions", json=_body(prompt, self.max_tokens, self.priority, False)
                )
                n += 1
                with self._lock:
                    if self._is_counting and not self._stop.is_set():
                        if reply.status_code == 200:
                            self.num_done += 1
                        else:
                            self.num_failed += 1


def probe_ttfts(url: str, num_probes: int, priority: int) -> list[float]:
    with httpx.Client(timeout=900) as client:
        ttft_s(client, url, "warm-up: say hi.", priority)
        ttfts = []
        for i in range(num_probes):
            ttfts.append(ttft_s(client, url, f"Probe {i}: name a colour.", priority))
            time.sleep(0.2)
        return ttfts


def priority_phase(url: str, args: argparse.Namespace) -> dict:
    quiet = probe_ttfts(url, args.probes, 0)
    report = {"quiet_median_ttft_ms": round(statistics.median(quiet) * 1000, 1)}
    for name, priority in (("flood_high", 0), ("flood_same", LOW)):
        flood = Load(url, args.flood, args.flood_tokens, LOW, None, "flood").start()
        time.sleep(args.warmup)
        flood.count_from_now()
        ttfts = probe_ttfts(url, args.probes, priority)
        flood.stop()
        report[f"{name}_median_ttft_ms"] = round(statistics.median(ttfts) * 1000, 1)
        report[f"{name}_ratio"] = round(statistics.median(ttfts) / statistics.median(quiet), 2)
        report[f"{name}_flood_done"] = flood.num_done
    return report


def fairness_phase(url: str, args: argparse.Namespace, with_tenants: bool) -> dict:
    """Long prompts and short answers: the prompts' reservations, which wait in the admission queue, fill
    the pool, more than the answers' growth (which preempts, tenant-blind, on the decode worker)."""
    context = _CONTEXT * args.context_repeats
    tokens = args.fair_tokens
    a = Load(url, args.clients_a, tokens, 0, "A" if with_tenants else None, "A", context).start()
    b = Load(url, args.clients_b, tokens, 0, "B" if with_tenants else None, "B", context).start()
    time.sleep(args.warmup)
    a.count_from_now()
    b.count_from_now()
    time.sleep(args.seconds)
    done_a, done_b = a.num_done, b.num_done
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(Load.stop, (a, b)))
    total = max(1, done_a + done_b)
    return {
        "done_a": done_a,
        "done_b": done_b,
        "share_b": round(done_b / total, 3),
        "failed": a.num_failed + b.num_failed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running gateway (default: --launch one)")
    parser.add_argument("--launch", action="store_true", help="start `tandem serve` for the run and stop it after")
    parser.add_argument("--serve-args", default="", help="extra flags for `tandem serve` with --launch")
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--flood", type=int, default=16, help="low-priority clients")
    parser.add_argument("--flood-tokens", type=int, default=48)
    parser.add_argument("--clients-a", type=int, default=12)
    parser.add_argument("--clients-b", type=int, default=6)
    parser.add_argument("--fair-tokens", type=int, default=16, help="max_tokens of the fairness phases")
    parser.add_argument("--context-repeats", type=int, default=6, help="sentences before each fairness prompt")
    parser.add_argument("--seconds", type=float, default=40.0, help="each fairness phase's counted time")
    parser.add_argument("--warmup", type=float, default=5.0)
    args = parser.parse_args()
    if not args.url and not args.launch:
        parser.error("give --url of a running gateway or --launch")
    stack = None
    if args.launch:
        from tests.e2e.stack import start_stack

        flags = ("--max-total-tokens", "512", "--torch-threads", "1", *args.serve_args.split())
        stack = start_stack(Path(tempfile.mkdtemp()), *flags)
    url = args.url or stack.url
    try:
        report = {"priority": priority_phase(url, args)}
        # first come, first served gives B about its share of the clients; fair turns give it half
        report["clients_share_b"] = round(args.clients_b / (args.clients_a + args.clients_b), 3)
        report["with_tenants"] = fairness_phase(url, args, with_tenants=True)
        report["without_tenants"] = fairness_phase(url, args, with_tenants=False)
    finally:
        if stack is not None:
            stack.stop()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
