"""Which decode batch sizes get a CUDA graph and which one a step replays (engine/graph_batches.py), and
the config field that names them."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig
from engine.graph_batches import (
    DEFAULT_MAX_GRAPH_BATCH_SIZE,
    check_graph_batch_sizes,
    default_graph_batch_sizes,
    graph_batch_size,
)


@pytest.mark.parametrize(("largest", "expected"), [
    (1, (1,)),
    (3, (1, 2, 3)),
    (8, (1, 2, 4, 8)),
    (16, (1, 2, 4, 8, 16)),
    (64, (1, 2, 4, 8, 16, 32, 48, 64)),
    (100, (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100)),   # a full batch always has a graph of its own size
])
def test_the_default_ladder_ends_at_the_largest_batch(largest: int, expected: tuple[int, ...]) -> None:
    assert default_graph_batch_sizes(largest) == expected


def test_the_default_ladder_stops_at_its_bound() -> None:
    sizes = default_graph_batch_sizes(4096)
    assert sizes[-1] == DEFAULT_MAX_GRAPH_BATCH_SIZE == 256 and len(sizes) == 4 + 16
    with pytest.raises(ValueError, match=">= 1"):
        default_graph_batch_sizes(0)


@pytest.mark.parametrize(("num_requests", "expected"), [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (16, 16),
                                                        (17, 32), (64, 64), (65, None), (1000, None), (0, None)])
def test_a_step_replays_the_smallest_graph_it_fits_or_runs_eagerly(num_requests: int, expected: int | None) -> None:
    assert graph_batch_size((1, 2, 4, 8, 16, 32, 48, 64), num_requests) == expected
    assert graph_batch_size((), num_requests) is None   # graphs off: every step eager


def test_explicit_sizes_are_checked() -> None:
    check_graph_batch_sizes((1, 3, 7), max_running_requests=7)
    check_graph_batch_sizes((), max_running_requests=7)
    for sizes, message in [((0, 4), "positive"), ((4, 2), "increasing"), ((2, 2), "increasing"),
                           ((1, 128), "exceeds max_running_requests")]:
        with pytest.raises(ValueError, match=message):
            check_graph_batch_sizes(sizes, max_running_requests=64)


def test_the_engine_config_holds_none_a_list_or_nothing() -> None:
    assert EngineConfig().cuda_graph_batch_sizes is None   # the engine's default ladder
    assert EngineConfig(cuda_graph_batch_sizes=()).cuda_graph_batch_sizes == ()
    assert EngineConfig(cuda_graph_batch_sizes=(1, 8, 64)).cuda_graph_batch_sizes == (1, 8, 64)
    with pytest.raises(ConfigError, match="exceeds max_running_requests"):
        EngineConfig(max_running_requests=32, cuda_graph_batch_sizes=(1, 64))
    with pytest.raises(ConfigError, match="strictly increasing"):
        EngineConfig(cuda_graph_batch_sizes=(8, 1))
