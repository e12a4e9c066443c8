"""Greedy agreement of each dtype / quantization path with the fp32 reference (bundled model).

    python benchmarks/greedy_match.py [--tokens 64]

The reference is Tandem's fp32 path with dequantized weights, which tests/integration checks equals
HF transformers token for token. For each path: how many of the prompts' greedy continuations are
identical, the mean length of the prefix that agrees before the first different token, and the
first words of its answer to the first prompt (the seed's France question).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402
from gateway.text.tokenizer import load_tokenizer  # noqa: E402
from launcher.defaults import default_model_path  # noqa: E402

PROMPTS = ["What is the capital of France?", "List 3 countries and their capitals.", "Write a haiku about the sea.",
           "Explain what a prime number is.", "Say this is a test", "Give me a recipe for pancakes.",
           "Who wrote Romeo and Juliet?", "Describe a cat in two sentences.", "What is 12 times 7?",
           "Translate 'good morning' into French.", "Name the planets of the solar system.",
           "Why is the sky blue?", "Write a limerick about a programmer.", "What does a CPU do?",
           "Suggest a name for a bakery.", "Summarize the plot of Cinderella."]
# (dtype, KV pool dtype, quantization, int8 activations): packed weights compute with activations
# rounded to int16 blocks, or int8 blocks (llama.cpp's rounding) with the flag
PATHS = [("float32", "float32", "none", False), ("bfloat16", "bfloat16", "none", False),
         ("float32", "float32", "gguf", False), ("float32", "bfloat16", "gguf", False),
         ("bfloat16", "bfloat16", "gguf", False), ("float32", "float32", "gguf", True),
         ("float32", "float32", "q8_0", False), ("float32", "float32", "q4_0", False)]


def greedy(path: str, dtype: str, quantization: str, prompts: list[list[int]], tokens: int,
           int8_activations: bool = False, kv_cache_dtype: str | None = None) -> list[list[int]]:
    config = EngineConfig(dtype=dtype, quantization=quantization, int8_activations=int8_activations,
                          kv_cache_dtype=kv_cache_dtype, max_total_tokens=8192)
    engine = Engine(open_checkpoint(path), config, progress=False)
    sampling = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(ids), sampling))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for step in engine.step():
            if step.token_id is not None:
                out[step.request_id].append(step.token_id)
    return [out[f"r{i}"] for i in range(len(prompts))]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    same = sum(a == b for a, b in zip(reference, other))
    prefixes = []
    for a, b in zip(reference, other):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefixes.append(n)
    return same, sum(prefixes) / len(prefixes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    path = default_model_path()
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    reference = greedy(path, "float32", "none", prompts, args.tokens)
    print(f"| dtype | KV pool | quantization | identical continuations (of {len(PROMPTS)}) | mean agreeing "
          f"prefix (of {args.tokens} tokens) | answer to \"{PROMPTS[0]}\" |\n|---|---|---|---|---|---|")
    for dtype, kv_dtype, quantization, int8_activations in PATHS:
        out = greedy(path, dtype, quantization, prompts, args.tokens, int8_activations, kv_dtype)
        same, prefix = agreement(reference, out)
        label = f"{quantization}, int8 activations" if int8_activations else quantization
        answer = tokenizer.decode(out[0][:8]).split("\n")[0]
        print(f"| {dtype} | {kv_dtype} | {label} | {same} | {prefix:.1f} | {answer} |", flush=True)


if __name__ == "__main__":
    main()
