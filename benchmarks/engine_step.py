"""Milliseconds per decode step of the engine alone (no servers), the prefill of one prompt, and where they go.

    python benchmarks/engine_step.py                        # bundled model, batch 16 and 1, ~300-token contexts
    python benchmarks/engine_step.py --profile              # + time per C++ kernel call (per step)
    python benchmarks/engine_step.py --quantization none --dtype bfloat16 --profile
    python benchmarks/engine_step.py --temperature 1.0 [--top-p 0.9] [--top-k 40]   # sampled, not greedy, steps

Requests are prefilled with random prompts of --context tokens, then every step decodes the whole
batch; the figures are medians over --steps steps of the process's CPU time (with one thread, the
step's compute without the time other processes held the core: the steadier figure on a shared
machine) and of the wall-clock time (what a client sees; with N threads, the one to compare).
--prefill N (default 256) times the prefill step of one N-token prompt (median of --prefill-runs).
--profile wraps each C++ kernel (and the matmul of each projection) in a timer and prints the
CPU milliseconds per step of each and of everything outside them (with --unfused, so that the
kernels a fused layer calls are timed one by one). Compare figures from one run on one machine,
not across machines.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402
from kernels import native  # noqa: E402
from launcher.defaults import default_model_path  # noqa: E402

_TIMES: collections.Counter[str] = collections.Counter()


def _timed(name: Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _TIMES[name(*args)] += time.process_time() - started

    return wrapper


def _matmul_name(*args: Any) -> str:
    """qmatmul's calls named by shape: [M, K] -> N says which projection it is."""
    x, n = args[0], args[2]
    return f"qmatmul {x.shape[0]}x{x.shape[1]} -> {n}"


def install_timers() -> None:
    """Wrap every function of the compiled kernel module in a timer (the module is shared, so every
    caller sees the wrappers)."""
    module = native.load()
    for attr in [a for a in dir(module) if not a.startswith("_")]:
        fn = getattr(module, attr)
        if callable(fn):
            name = _matmul_name if attr.startswith("qmatmul") else (lambda *a, _n=attr: _n)
            setattr(module, attr, _timed(name, fn))


@contextmanager
def kernel_profile(steps: int, enabled: bool) -> Iterator[None]:
    _TIMES.clear()
    started = time.process_time()
    yield
    if not enabled:
        return
    total = (time.process_time() - started) * 1000 / steps
    print(f"  per step: {total:.2f} ms of CPU time, of which in C++ kernels:")
    groups: collections.Counter[str] = collections.Counter()
    for name, seconds in _TIMES.items():
        groups[name.split(" ")[0] if not name.startswith("qmatmul") else name] += seconds
    for name, seconds in groups.most_common():
        ms = seconds * 1000 / steps
        print(f"    {name:40s} {ms:7.2f} ms  {100 * ms / total:5.1f} %")
    rest = total - sum(groups.values()) * 1000 / steps
    print(f"    {'(outside the kernels)':40s} {rest:7.2f} ms  {100 * rest / total:5.1f} %")


class StepTimer:
    """Medians of the wall-clock and CPU milliseconds of the blocks it times."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __enter__(self) -> None:
        self._started = (time.perf_counter(), time.process_time())

    def __exit__(self, *exc: object) -> None:
        self.wall.append((time.perf_counter() - self._started[0]) * 1000)
        self.cpu.append((time.process_time() - self._started[1]) * 1000)

    def describe(self, tokens: int) -> str:
        wall, cpu = statistics.median(self.wall), statistics.median(self.cpu)
        return f"{cpu:7.1f} ms CPU, {wall:7.1f} ms wall ({tokens / wall * 1000:6.1f} tokens/s)"


def decode_ms(
    engine: Engine, batch: int, context: int, steps: int, profile: bool, sampled: SamplingParams | None = None
) -> StepTimer:
    """`sampled`: the requests' sampling (None: greedy); its token limit and ignore_eos are set here."""
    generator = torch.Generator().manual_seed(batch)
    sampling = replace(sampled or SamplingParams(temperature=0), max_new_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(10, 40000, (context,), generator=generator).tolist()
        engine.add_request(Request(f"b{batch}-{i}", ids, sampling))
    while engine.scheduler.waiting:  # prefill everything first
        engine.step()
    engine.step()  # one decode step to warm up
    timer = StepTimer()
    with kernel_profile(steps, profile):
        for _ in range(steps):
            with timer:
                engine.step()
    while engine.has_work:
        engine.step()
    return timer


def prefill_ms(engine: Engine, length: int, runs: int, profile: bool) -> StepTimer:
    generator = torch.Generator().manual_seed(length)
    sampling = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    timer = StepTimer()
    with kernel_profile(runs, profile):
        for run in range(runs):
            ids = torch.randint(10, 40000, (length,), generator=generator).tolist()
            engine.add_request(Request(f"p{length}-{run}", ids, sampling))
            with timer:
                engine.step()
            while engine.has_work:
                engine.step()
    return timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default="gguf", choices=["none", "gguf", "q8_0", "q4_0", "q4_1"])
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"])
    parser.add_argument("--int8-activations", action="store_true")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["float32", "bfloat16"], help="default: --dtype")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batches", default="16,1")
    parser.add_argument("--prefill", type=int, default=256, help="prompt length to time a prefill of (0: none)")
    parser.add_argument("--prefill-runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0, help="the decode steps' requests sample (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument(
        "--unfused", action="store_true", help="run each layer's modules, not the fused C++ layer (to see its kernels)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    config = EngineConfig(
        dtype=args.dtype,
        quantization=args.quantization,
        attention_backend=args.attention_backend,
        int8_activations=args.int8_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        max_total_tokens=32768,
        chunked_prefill_size=max(512, args.prefill),
        max_decode_slowdown=None,  # the decode pace would let the prompts in a few at a time: no full batch
    )
    if args.profile:
        install_timers()  # before the model is built: layers keep the kernel functions they find
    engine = Engine(open_checkpoint(args.model_path or default_model_path()), config, progress=False)
    if args.unfused:
        for layer in engine.runner.model.model.layers:
            layer.fused = None
    print(
        f"dtype {args.dtype}, KV {args.kv_cache_dtype or args.dtype}, quantization {args.quantization}"
        f"{' (int8 activations)' if args.int8_activations else ''}, attention {args.attention_backend}, "
        f"{args.threads} thread(s), {args.context}-token contexts"
    )
    sampled = None
    if args.temperature:
        sampled = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        print(f"sampled decode steps: temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}")
    if args.prefill:
        timer = prefill_ms(engine, args.prefill, args.prefill_runs, args.profile)
        print(f"prefill of {args.prefill} tokens: {timer.describe(args.prefill)}", flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        timer = decode_ms(engine, batch, args.context, args.steps, args.profile, sampled)
        print(f"batch {batch:3d}: {timer.describe(batch)} per decode step", flush=True)


if __name__ == "__main__":
    main()
