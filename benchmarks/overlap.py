"""Decode through the engine loop (its engine thread and compute thread, no servers) with and without
overlapped steps (engine/overlap.py), run alternately: the time between one step's forward pass and
the next one's, and the decode throughput.

    python benchmarks/overlap.py                          # bundled model, 16 streams then 1, 3 rounds
    python benchmarks/overlap.py --streams 16 --rounds 5 --model-path <gguf>

Each run prefills `--streams` random `--context`-token prompts, then decodes `--output-len` greedy tokens
for each; the figures cover the steps after every prompt's first token: the median gap between two
forward passes (the compute thread idle: the engine thread updating, delivering and scheduling), the
median forward pass, and output tokens per second over those steps. The workers' flags (`--serve-args`)
resolve the engine settings as `tandem serve` does (packed GGUF blocks, bfloat16 KV on a CPU); by
default without the decode pace, which would let the prompts in one by one. The tokens of the two modes are compared: they must be equal. Prints one line per run and a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.engine import Engine  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402
from launcher.configs import engine_config  # noqa: E402
from launcher.defaults import default_model_path  # noqa: E402
from launcher.worker_flags import add_model_args, add_worker_args  # noqa: E402
from server_runtime.engine_loop import EngineLoop  # noqa: E402


class TimedEngine(Engine):
    """The real engine, recording when each non-empty forward pass (on the compute thread) starts and ends."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.passes: list[tuple[float, float, int]] = []  # (start, end, decode rows)

    def execute(self, scheduled):
        started = time.perf_counter()
        output = super().execute(scheduled)
        if not scheduled.is_empty:
            self.passes.append((started, time.perf_counter(), scheduled.num_decode_tokens))
        return output


async def decode(engine: TimedEngine, streams: int, context: int, output_len: int) -> dict[str, list[int]]:
    loop = EngineLoop(engine, asyncio.get_running_loop())
    loop.start()
    try:
        generator = torch.Generator().manual_seed(streams)
        sampling = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
        sinks = {}
        for i in range(streams):
            ids = torch.randint(10, 20000, (context,), generator=generator).tolist()
            sinks[f"s{i}"] = await loop.submit(Request(f"s{i}", ids, sampling))

        async def drain(sink: asyncio.Queue) -> list[int]:
            tokens: list[int] = []
            while True:
                output = await sink.get()
                if output.token_id is not None:
                    tokens.append(output.token_id)
                if output.finish_reason is not None:
                    return tokens

        results = await asyncio.gather(*(drain(sink) for sink in sinks.values()))
        return dict(zip(sinks, results))
    finally:
        loop.stop()


def run_once(checkpoint, config, overlap: bool, streams: int, context: int, output_len: int) -> tuple[dict, dict]:
    engine = TimedEngine(checkpoint, replace(config, overlap_schedule=overlap), progress=False)
    tokens = asyncio.run(decode(engine, streams, context, output_len))
    steady = [p for p in engine.passes if p[2] == streams]  # every stream decoding, no prompt in the step
    gaps = [b[0] - a[1] for a, b in zip(steady, steady[1:])]
    seconds = steady[-1][1] - steady[0][0]
    figures = {
        "gap_ms": 1000 * statistics.median(gaps),
        "forward_ms": 1000 * statistics.median(p[1] - p[0] for p in steady),
        "tok_s": streams * len(steady) / seconds,
    }
    return tokens, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--streams", default="16,1", help="comma-separated stream counts, each run on its own")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two modes")
    parser.add_argument("--serve-args", default="--max-decode-slowdown 0",
                        help="worker flags, as `tandem serve` takes them (default: no decode pace, so every "
                        "prompt is prefilled at full speed and the streams then decode together)")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    flags = argparse.ArgumentParser()
    add_model_args(flags)
    add_worker_args(flags)
    model_path = args.model_path or default_model_path()
    worker_args = flags.parse_args(["--model-path", model_path, *shlex.split(args.serve_args)])
    worker_args.command = "benchmark"
    config = engine_config(worker_args, "decode", is_embedding=False)
    checkpoint = open_checkpoint(model_path)
    print(f"{Path(model_path).name}: quantization {config.quantization}, KV {config.kv_cache_dtype}, "
          f"{torch.get_num_threads()} torch threads, {args.context}-token prompts, {args.output_len} tokens each")
    for streams in (int(s) for s in args.streams.split(",")):
        summary: dict[bool, list[dict]] = {True: [], False: []}
        reference: dict | None = None
        for _ in range(args.rounds):
            for overlap in (False, True):
                tokens, figures = run_once(checkpoint, config, overlap, streams, args.context, args.output_len)
                if reference is None:
                    reference = tokens
                assert tokens == reference, "the tokens differ between runs"
                summary[overlap].append(figures)
                print(f"  {streams:2d} streams, overlap {'on ' if overlap else 'off'}: gap {figures['gap_ms']:.3f} ms, "
                      f"forward {figures['forward_ms']:.2f} ms, {figures['tok_s']:.1f} tok/s", flush=True)
        for overlap in (False, True):
            runs = summary[overlap]
            print(f"{streams:2d} streams, overlap {'on ' if overlap else 'off'} (medians of {len(runs)}): "
                  + ", ".join(f"{k} {statistics.median(r[k] for r in runs):.3f}" for k in runs[0]))
    print("tokens equal in every run")


if __name__ == "__main__":
    main()
