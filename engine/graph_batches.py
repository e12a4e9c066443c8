"""Which decode batch sizes get a CUDA graph, and which graph a step of n requests replays. Torch-free,
so the launcher reads the defaults for its flags without loading the engine.

A decode step of n requests replays the graph of the smallest captured batch size >= n, its rows past
n padded with dummy requests (engine/cuda_graph.py); a step larger than every captured size runs
eagerly. The defaults follow nano-vllm's ladder: 1, 2, 4, 8, then every 16 up to the largest.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

DEFAULT_MAX_GRAPH_BATCH_SIZE = 256  # SGLang's and nano-vllm's bound; each size costs a capture at start-up
_SMALL_SIZES = (1, 2, 4, 8)
_STEP = 16


def default_graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 32, ... up to `max_batch_size` (at most DEFAULT_MAX_GRAPH_BATCH_SIZE), which
    is itself always among them, so a full batch replays a graph of its own size. ValueError when
    `max_batch_size` < 1."""
    if max_batch_size < 1:
        raise ValueError(f"the largest CUDA-graph batch size must be >= 1, got {max_batch_size}")
    largest = min(max_batch_size, DEFAULT_MAX_GRAPH_BATCH_SIZE)
    sizes = [n for n in _SMALL_SIZES if n < largest] + list(range(_STEP, largest, _STEP))
    return tuple(sorted({*sizes, largest}))


def check_graph_batch_sizes(sizes: Sequence[int], max_running_requests: int) -> None:
    """Raise ValueError unless `sizes` are positive, strictly increasing and none above
    `max_running_requests` (a graph no step can use would only cost start-up time and memory)."""
    if any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"CUDA-graph batch sizes must be positive integers, got {tuple(sizes)}")
    if any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"CUDA-graph batch sizes must be strictly increasing, got {tuple(sizes)}")
    if sizes and sizes[-1] > max_running_requests:
        raise ValueError(
            f"CUDA-graph batch size {sizes[-1]} exceeds max_running_requests ({max_running_requests}): "
            "no decode step is that large"
        )


def graph_batch_size(sizes: Sequence[int], num_requests: int) -> int | None:
    """The captured batch size a decode step of `num_requests` replays (`sizes` increasing): the
    smallest >= num_requests, or None when the step is larger than all (it runs eagerly)."""
    index = bisect_left(sizes, num_requests)
    return sizes[index] if index < len(sizes) and num_requests > 0 else None
