"""The batched LoRA kernels' cost next to the base layer they ride on: one SmolLM2-135M decoder
layer's four projections (merged q/k/v 576+192+192, o, merged gate/up 2 x 1536, down) in float32
with `torch.nn.functional.linear`, against LoRA on all of them (4 shrinks, one per projection with
the merged parts' A stacked, and 7 expands, one per part) for decode rows spread over adapters.

    python benchmarks/lora_kernel.py                      # 16 rows over 4 adapters of rank 16
    python benchmarks/lora_kernel.py --rows 1 --threads 2

Prints JSON: wall-clock milliseconds per layer (best of --repeats, each the mean of --iterations
calls) of the base matmuls, of the LoRA kernels (C++ where built) and of the torch path, and the
LoRA / base ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import lora, native  # noqa: E402

HIDDEN, Q, KV, INTERMEDIATE = 576, 576, 192, 1536
# each projection: (inputs, the outputs of its merged parts)
PROJECTIONS = ((HIDDEN, (Q, KV, KV)), (Q, (HIDDEN,)), (HIDDEN, (INTERMEDIATE, INTERMEDIATE)), (INTERMEDIATE, (HIDDEN,)))


def best_of(repeats: int, iterations: int, run: Callable[[], None]) -> float:
    """The fastest of `repeats` means over `iterations` runs, in wall-clock milliseconds (after a warm-up)."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(iterations):
            run()
        times.append((time.perf_counter() - started) / iterations * 1e3)
    return min(times)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16, help="decode rows (one token per sequence)")
    parser.add_argument("--adapters", type=int, default=4, help="adapter slots the rows take, in turn")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    gen = torch.Generator().manual_seed(0)

    weights = [torch.randn(sum(outs), ins, generator=gen) * 0.05 for ins, outs in PROJECTIONS]
    inputs = [torch.randn(args.rows, ins, generator=gen) for ins, _ in PROJECTIONS]
    outputs = [F.linear(x, w) for x, w in zip(inputs, weights, strict=True)]  # what LoRA adds into
    stacks = [
        (
            torch.randn(args.adapters, len(outs) * args.rank, ins, generator=gen) * 0.05,
            [torch.randn(args.adapters, out, args.rank, generator=gen) * 0.05 for out in outs],
        )
        for ins, outs in PROJECTIONS
    ]
    scaling = torch.full((args.adapters,), 2.0)
    segments = lora.segments_from_slots([row % args.adapters for row in range(args.rows)])

    def base() -> None:
        for x, w in zip(inputs, weights, strict=True):
            F.linear(x, w)

    def with_lora(shrink: Callable, expand: Callable) -> Callable[[], None]:
        def run() -> None:
            for x, (a, bs), y, (_, outs) in zip(inputs, stacks, outputs, PROJECTIONS, strict=True):
                t = shrink(x, a, *segments)
                for part, b in enumerate(bs):
                    expand(t, b, *segments, scaling, y, part * args.rank, sum(outs[:part]))

        return run

    base_ms = best_of(args.repeats, args.iterations, base)
    kernels_ms = best_of(args.repeats, args.iterations, with_lora(lora.lora_shrink, lora.lora_expand))
    torch_ms = best_of(args.repeats, args.iterations, with_lora(lora.reference_shrink, lora.reference_expand))
    print(
        json.dumps(
            {
                "cpu": cpu_model(),
                "isa": native.load().isa() if native.is_available() else None,
                "threads": args.threads,
                "rows": args.rows,
                "adapters": args.adapters,
                "rank": args.rank,
                "base_linear_ms": round(base_ms, 4),
                "lora_kernels_ms": round(kernels_ms, 4),
                "lora_torch_ms": round(torch_ms, 4),
                "kernels_over_base": round(kernels_ms / base_ms, 4),
                "torch_over_base": round(torch_ms / base_ms, 4),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
