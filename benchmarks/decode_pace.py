"""Do running decode streams keep their pace while the same decode worker prefills a long prompt?

    python benchmarks/decode_pace.py --launch              # `tandem serve` on the bundled SmolLM2
    python benchmarks/decode_pace.py --url http://127.0.0.1:30000

`--streams` streamed `/generate` requests of `--output-len` tokens each (short prompts, greedy,
ignore_eos) run twice: alone (quiet), and while a `--long-prompt-len`-token prompt arrives once the
streams are under way. With `--launch` the stack is started with `--local-prefill-threshold` above the
long prompt, so the decode worker prefills it itself (the case issue 26 names); against `--url` the
server's own routing decides. Reported per phase: the streams' median and p90 TPOT (each stream's
mean inter-token time) and the p90 of every inter-token gap, and the long prompt's TTFT, with the
loaded / quiet ratios. Prints one JSON object.
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


def stream_gaps(url: str, input_ids: list[int], max_new_tokens: int, started: threading.Event | None) -> list[float]:
    """Stream one greedy generation; the seconds between its consecutive tokens (an event carrying
    several tokens counts as that many gaps of equal share). `started` is set at the first token."""
    body = {
        "input_ids": input_ids,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    gaps: list[float] = []
    last_time, last_count = None, 0
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            count = json.loads(line[6:])["meta_info"]["completion_tokens"]
            now = time.perf_counter()
            if last_time is not None and count > last_count:
                gaps.extend([(now - last_time) / (count - last_count)] * (count - last_count))
            elif last_time is None and started is not None:
                started.set()
            last_time, last_count = now, count
    if last_count != max_new_tokens:
        raise RuntimeError(f"a stream returned {last_count} tokens, not {max_new_tokens}")
    return gaps


def ttft_s(url: str, input_ids: list[int]) -> float:
    started = time.perf_counter()
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}}
    reply = httpx.post(f"{url}/generate", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - started


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def phase(url: str, args: argparse.Namespace, with_long_prompt: bool) -> dict:
    prompts = [[100 + 7 * i + j for j in range(24)] for i in range(args.streams)]
    long_prompt = [(31 * j) % 40000 + 50 for j in range(args.long_prompt_len)]
    first_tokens = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(args.streams + 1) as pool:
        streams = [pool.submit(stream_gaps, url, p, args.output_len, e) for p, e in zip(prompts, first_tokens)]
        long_ttft = None
        if with_long_prompt:
            for event in first_tokens:
                event.wait(600)
            time.sleep(args.delay)  # well into their decoding
            long_ttft = ttft_s(url, long_prompt)
        per_stream = [future.result() for future in streams]
    tpots = [statistics.mean(gaps) * 1000 for gaps in per_stream]
    every_gap = [gap * 1000 for gaps in per_stream for gap in gaps]
    result = {
        "median_tpot_ms": round(statistics.median(tpots), 1),
        "p90_tpot_ms": round(p90(tpots), 1),
        "p90_itl_ms": round(p90(every_gap), 1),
        "max_itl_ms": round(max(every_gap), 1),
    }
    if long_ttft is not None:
        result["long_prompt_ttft_ms"] = round(long_ttft * 1000)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running gateway (default: --launch one)")
    parser.add_argument("--launch", action="store_true", help="start `tandem serve` for the run and stop it after")
    parser.add_argument("--serve-args", default="", help="extra flags for `tandem serve` with --launch")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--long-prompt-len", type=int, default=2000)
    parser.add_argument("--delay", type=float, default=0.3, help="seconds after the streams' first tokens")
    args = parser.parse_args()
    if not args.url and not args.launch:
        parser.error("give --url of a running gateway or --launch")
    stack = None
    if args.launch:
        from tests.e2e.stack import start_stack

        flags = (
            "--local-prefill-threshold",
            str(args.long_prompt_len + 1),
            "--context-length",
            "4096",
            *args.serve_args.split(),
        )
        stack = start_stack(Path(tempfile.mkdtemp()), *flags)
    url = args.url or stack.url
    try:
        phase(url, args, with_long_prompt=False)  # warm-up
        quiet = phase(url, args, with_long_prompt=False)
        loaded = phase(url, args, with_long_prompt=True)
    finally:
        if stack is not None:
            stack.stop()
    ratios = {
        f"{key}_ratio": round(loaded[key] / quiet[key], 2) for key in ("median_tpot_ms", "p90_tpot_ms", "p90_itl_ms")
    }
    print(json.dumps({"quiet": quiet, "long_prompt": loaded, **ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
