"""Output tokens/s through the three processes, for 1 and 16 concurrent streams, against a peer.

    python benchmarks/bench_serving.py --launch            # starts `tandem serve`, measures, stops it
    python benchmarks/bench_serving.py --url http://127.0.0.1:30000 --no-peer

Every request streams a chat completion with ignore_eos, so each produces exactly --max-tokens
tokens. The peer is HF transformers `generate()` on the same model and machine, run after the stack
has stopped (the machines are shared and noisy: compare ratios from one run, not absolute figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPICS = ["the sea", "a cat", "mountains", "coffee", "the moon", "trains", "rain", "a library", "bread",
          "winter", "a garden", "the desert", "music", "a bridge", "stars", "autumn"]


def prompt_for(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}."


def one_stream(url: str, model: str, i: int, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt_for(i)}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event["choices"] and event["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"ttft_s": first, "tokens": tokens, "seconds": time.perf_counter() - start}


def measure_tandem(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int) -> dict:
    one_stream(url, model, 0, 4)   # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: one_stream(url, model, i, max_tokens), range(num_requests)))
    wall = time.perf_counter() - start
    total = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": num_requests, "output_tokens": total,
            "output_tokens_per_s": total / wall, "median_ttft_s": statistics.median(r["ttft_s"] for r in results)}


def measure_hf_peer(model_path: Path, batch: int, max_tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from tests.hf_oracle import load_hf_smollm2
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    tokenizer.padding_side = "left"
    model = load_hf_smollm2(model_path, torch.bfloat16)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt_for(i)}], tokenize=False,
                                           add_generation_prompt=True) for i in range(batch)]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=4, do_sample=False)   # warm-up
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        wall = time.perf_counter() - start
    total = (out.shape[1] - inputs["input_ids"].shape[1]) * batch
    return {"batch": batch, "output_tokens": total, "output_tokens_per_s": total / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running gateway (default: --launch one)")
    parser.add_argument("--launch", action="store_true", help="start `tandem serve` for the run and stop it after")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-peer", action="store_true", help="skip the HF transformers peer")
    parser.add_argument("--serve-args", default="", help="extra flags for `tandem serve` with --launch")
    parser.add_argument("--peer-threads", type=int, default=2, help="torch threads for the HF peer")
    args = parser.parse_args()
    if not args.url and not args.launch:
        parser.error("give --url of a running gateway or --launch")

    stack = None
    if args.launch:
        import tempfile

        from tests.e2e.stack import start_stack
        stack = start_stack(Path(tempfile.mkdtemp()), *args.serve_args.split())
    url = args.url or stack.url
    try:
        report = {"tandem": [measure_tandem(url, args.model, 1, 4, args.max_tokens),
                             measure_tandem(url, args.model, 16, 16, args.max_tokens)]}
    finally:
        if stack is not None:
            stack.stop()
    if not args.no_peer:
        from launcher.defaults import default_model_path
        model_path = Path(default_model_path())
        report["hf_transformers_peer"] = [measure_hf_peer(model_path, 1, args.max_tokens, args.peer_threads),
                                          measure_hf_peer(model_path, 16, args.max_tokens, args.peer_threads)]
        report["ratio_tandem_over_peer"] = {
            f"{t['concurrency']}_streams": round(t["output_tokens_per_s"] / p["output_tokens_per_s"], 3)
            for t, p in zip(report["tandem"], report["hf_transformers_peer"])}
    report["command"] = " ".join(["python", *sys.argv])
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
