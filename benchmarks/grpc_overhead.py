"""The gRPC API's overhead against HTTP for the same streaming chat request, in one run.

    python benchmarks/grpc_overhead.py --launch                      # a `tandem serve` of its own
    python benchmarks/grpc_overhead.py --url http://127.0.0.1:30000 --grpc 127.0.0.1:30051

Sends the same greedy chat request (--max-tokens tokens, ignore_eos) --rounds times over each front,
alternating HTTP (/v1/chat/completions, server-sent events) and gRPC (ChatCompleteStream), one at a
time, after a warm-up of each. Prints, per front, the median time to the first content token and to
the end of the stream, and gRPC / HTTP for both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "protos"))

from tandem.api.v1 import inference_service_pb2_grpc  # noqa: E402
from tests.e2e.grpc_client import MODEL, chat_request  # noqa: E402

QUESTION = "Write a short story about the sea."


def over_http(url: str, max_tokens: int) -> tuple[float, float]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if (
                first is None
                and line.startswith("data: {")
                and json.loads(line[6:])["choices"][0]["delta"].get("content")
            ):
                first = time.perf_counter() - started
    return first or 0.0, time.perf_counter() - started


def over_grpc(api: inference_service_pb2_grpc.InferenceServiceStub, max_tokens: int) -> tuple[float, float]:
    request = chat_request(QUESTION, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    first = None
    for chunk in api.ChatCompleteStream(request, timeout=600):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    return first or 0.0, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running gateway's HTTP address")
    parser.add_argument("--grpc", default=None, help="its gRPC API, host:port")
    parser.add_argument("--launch", action="store_true", help="start `tandem serve` for the run and stop it after")
    parser.add_argument("--serve-args", default="", help="extra flags for `tandem serve` with --launch")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if not args.launch and not (args.url and args.grpc):
        parser.error("give --url and --grpc of a running gateway, or --launch")
    stack = None
    if args.launch:
        from tests.e2e.stack import start_stack

        stack = start_stack(Path(tempfile.mkdtemp()), *args.serve_args.split())
        args.url, args.grpc = stack.url, f"127.0.0.1:{stack.grpc_port}"
    try:
        with grpc.insecure_channel(args.grpc) as channel:
            api = inference_service_pb2_grpc.InferenceServiceStub(channel)
            over_http(args.url, args.max_tokens), over_grpc(api, args.max_tokens)  # warm-up
            http, rpc = [], []
            for _ in range(args.rounds):
                http.append(over_http(args.url, args.max_tokens))
                rpc.append(over_grpc(api, args.max_tokens))
    finally:
        if stack is not None:
            stack.stop()
    report = {"rounds": args.rounds, "max_tokens": args.max_tokens}
    for name, runs in (("http", http), ("grpc", rpc)):
        report[f"{name}_ttft_ms"] = round(statistics.median(r[0] for r in runs) * 1000, 1)
        report[f"{name}_total_ms"] = round(statistics.median(r[1] for r in runs) * 1000, 1)
    report["grpc_over_http_ttft"] = round(report["grpc_ttft_ms"] / report["http_ttft_ms"], 3)
    report["grpc_over_http_total"] = round(report["grpc_total_ms"] / report["http_total_ms"], 3)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
