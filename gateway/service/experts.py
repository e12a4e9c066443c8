"""SGLang's expert distribution operations: start, stop and dump the per-expert token counts of an MoE
model.

Each operation calls the same RPC on every worker (prefill and decode). While recording, a worker counts,
per MoE layer and expert, the tokens its forward passes route to that expert, once per token and
chosen expert: prompt tokens computed on the prefill workers (prefix-cache hits are not computed, so
not counted) plus one token per decode step on the decode workers. The dump sums the workers' counts
and writes `expert_distribution_<timestamp>.csv` (header `layer_id,expert_id,count`, one row per MoE
layer and expert, zeros included) into `GatewayConfig.expert_distribution_dir` (`--expert-distribution-dir`,
default the gateway's working directory); each worker's counts are cleared by the dump.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path

from gateway.cluster.worker_records import ExpertCounts, ExpertRecordOp
from gateway.errors import bad_request
from gateway.service.state import GatewayState

logger = logging.getLogger(__name__)

_TIMEOUT_S = 10.0
CSV_HEADER = "layer_id,expert_id,count"


async def record_experts(state: GatewayState, op: ExpertRecordOp) -> None:
    """Start (clearing every worker's counts first) or stop counting."""
    await _on_every_worker(state, op)


async def dump_experts(state: GatewayState) -> Path:
    """Sum every worker's counts into a new CSV file (the workers' counts are cleared); its path."""
    replies = await _on_every_worker(state, ExpertRecordOp.DUMP)
    counts = summed_counts([r for r in replies if r is not None])
    path = await asyncio.to_thread(write_csv, Path(state.config.expert_distribution_dir), counts)
    logger.info("expert distribution written to %s", path)
    return path


def summed_counts(replies: list[ExpertCounts]) -> dict[tuple[int, int], int]:
    """(layer id, expert id) -> tokens routed there, summed over the workers' replies, sorted by key."""
    totals: Counter[tuple[int, int]] = Counter()
    for reply in replies:
        for i, layer_id in enumerate(reply.layer_ids):
            for expert_id in range(reply.num_experts):
                totals[layer_id, expert_id] += reply.counts[i * reply.num_experts + expert_id]
    return dict(sorted(totals.items()))


def write_csv(directory: Path, counts: dict[tuple[int, int], int]) -> Path:
    """Write `counts` to a new `expert_distribution_<unix time>.csv` in `directory`; never overwrites."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"{layer_id},{expert_id},{count}\n" for (layer_id, expert_id), count in counts.items())
    while True:
        path = directory / f"expert_distribution_{time.time():.6f}.csv"
        try:
            with path.open("x", encoding="utf-8") as f:
                f.write(f"{CSV_HEADER}\n{rows}")
            return path
        except FileExistsError:
            continue


async def _on_every_worker(state: GatewayState, op: ExpertRecordOp) -> list[ExpertCounts | None]:
    """`op` on every worker at once (the dump's counts; None for start and stop); the first failure
    becomes the HTTP error."""
    if state.config.is_embedding:
        raise bad_request(
            "the expert distribution needs a mixture-of-experts generation model; this server runs an embedding model"
        )
    return list(
        await asyncio.gather(*(w.client.expert_record(op, timeout_s=_TIMEOUT_S) for w in state.pool.all_workers()))
    )
