"""Output tok/s of streams spread over several LoRA adapters against the same streams on the base model,
one stack, same run (issue 29's target: at least 0.7x).

    python benchmarks/lora_serving.py                       # `tandem serve` on the bundled SmolLM2
    python benchmarks/lora_serving.py --adapters 4 --rank 16 --streams 16

Makes `--adapters` random PEFT adapters of `--rank` on every projection (q, k, v, o, gate, up, down)
of the served model, starts `tandem serve --lora-paths ...`, and runs `--streams` concurrent clients,
each sending `--requests` greedy `/generate` calls (`--prompt-len` random-id prompts, each its own, so
no phase reuses another's cached prefix; `--output-len` tokens, ignore_eos): first on the base model
(warm-up, then measured), then with client i on adapter i mod `--adapters` (SGLang's `lora_path`).
Prints one JSON object: tok/s of each phase and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.lora import Projection  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402
from launcher.defaults import default_model_path  # noqa: E402


def save_random_adapter(directory: Path, model_path: str, rank: int, seed: int) -> Path:
    """A PEFT adapter (adapter_config.json + adapter_model.safetensors) of `rank` on every projection of
    the model at `model_path`, with small random A and B so the output stays text-like but changes."""
    config = open_checkpoint(model_path).config
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for projection in Projection:
            out_features, in_features = projection.shape(config)
            prefix = f"base_model.model.model.layers.{layer}.{projection.block}.{projection.value}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [p.value for p in Projection],
        "bias": "none",
        "base_model_name_or_path": model_path,
    }
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory


def run_phase(url: str, args: argparse.Namespace, lora_paths: list[str | None], seed: int) -> dict:
    """`--streams` clients at once, client i on `lora_paths[i % len]`; output tokens per second. Every
    request has a prompt of its own (drawn from `seed`), so no phase gains from another's prefix cache."""
    rng = random.Random(seed)
    prompts = [
        [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        for _ in range(args.streams)
    ]

    def client(i: int) -> int:
        body: dict = {"sampling_params": {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}}
        if (lora_path := lora_paths[i % len(lora_paths)]) is not None:
            body["lora_path"] = lora_path
        tokens = 0
        for prompt in prompts[i]:
            reply = httpx.post(f"{url}/generate", json={**body, "input_ids": prompt}, timeout=600)
            reply.raise_for_status()
            tokens += reply.json()["meta_info"]["completion_tokens"]
        return tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(args.streams) as pool:
        tokens = sum(pool.map(client, range(args.streams)))
    seconds = time.perf_counter() - started
    return {"output_tokens": tokens, "seconds": round(seconds, 1), "tok_per_s": round(tokens / seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2, help="per client and phase")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--serve-args", default="", help="extra flags for `tandem serve`")
    args = parser.parse_args()
    from tests.e2e.stack import start_stack

    model_path = args.model_path or default_model_path()
    tmp = Path(tempfile.mkdtemp())
    names = [f"adapter{i}" for i in range(args.adapters)]
    dirs = [save_random_adapter(tmp / name, model_path, args.rank, seed=i) for i, name in enumerate(names)]
    flags = ["--model-path", model_path, "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank)]
    flags += ["--lora-paths", *(f"{name}={d}" for name, d in zip(names, dirs)), *args.serve_args.split()]
    stack = start_stack(tmp, *flags)
    try:
        run_phase(stack.url, argparse.Namespace(**{**vars(args), "requests": 1}), [None], seed=0)  # warm-up
        base = run_phase(stack.url, args, [None], seed=1)
        lora = run_phase(stack.url, args, list(names), seed=2)
    finally:
        stack.stop()
    print(
        json.dumps(
            {
                "cpu": platform.processor() or platform.machine(),
                "streams": args.streams,
                "adapters": args.adapters,
                "rank": args.rank,
                "base": base,
                "lora": lora,
                "lora_over_base": round(lora["tok_per_s"] / base["tok_per_s"], 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
