"""Milliseconds per decode step of the engine alone (no servers), and where they go.

    python benchmarks/engine_step.py                        # bundled model, batch 16 and 1, ~300-token contexts
    python benchmarks/engine_step.py --quantization none --dtype bfloat16 --profile

Requests are prefilled with random prompts of --context tokens, then every step decodes the whole
batch; the figure is the median over --steps steps. --profile prints torch's operator table for the
batch-16 steps. Compare figures from one run on one machine, not across machines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402
from launcher.defaults import default_model_path  # noqa: E402


def decode_ms(engine: Engine, batch: int, context: int, steps: int, profile: bool) -> float:
    generator = torch.Generator().manual_seed(batch)
    sampling = SamplingParams(temperature=0, max_new_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(10, 40000, (context,), generator=generator).tolist()
        engine.add_request(Request(f"b{batch}-{i}", ids, sampling))
    while engine.scheduler.waiting:          # prefill everything first
        engine.step()
    engine.step()                            # one decode step to warm up
    times = []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    if profiler:
        profiler.__enter__()
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - started) * 1000)
    if profiler:
        profiler.__exit__(None, None, None)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    while engine.has_work:
        engine.step()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default="gguf", choices=["none", "gguf", "q8_0", "q4_0", "q4_1"])
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"])
    parser.add_argument("--int8-activations", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batches", default="16,1")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    config = EngineConfig(dtype=args.dtype, quantization=args.quantization, attention_backend=args.attention_backend,
                          int8_activations=args.int8_activations,
                          max_total_tokens=32768)
    engine = Engine(open_checkpoint(args.model_path or default_model_path()), config, progress=False)
    print(f"dtype {args.dtype}, quantization {args.quantization}, attention {args.attention_backend}, "
          f"{args.threads} thread(s), {args.context}-token contexts")
    for batch in (int(b) for b in args.batches.split(",")):
        ms = decode_ms(engine, batch, args.context, args.steps, args.profile and batch > 1)
        print(f"batch {batch:3d}: {ms:7.1f} ms per decode step ({batch / ms * 1000:6.1f} tokens/s)", flush=True)


if __name__ == "__main__":
    main()
