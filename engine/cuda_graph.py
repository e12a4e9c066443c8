"""CUDA-graph decode: the model's forward pass for a decode step captured once per batch size at
start-up and replayed with the step's inputs copied into fixed buffers.

A decode step of n requests replays the graph of the smallest captured size >= n
(`engine/graph_batches.py`); rows n.. of it are dummy requests of one token at position 0 whose
only page is the pool's scratch page (`KVPool.scratch_page_ids`), so their K/V writes land where
no request reads, and their outputs are dropped. A step larger than every size runs eagerly, as
does every prefill. What the graph holds: embedding, every layer (rotary, the K/V write, attention
through the backend's fixed-buffer plan), the final norm; the LM head, logits processors, grammar
masks and sampling run after it, eagerly, on the n real rows only.

The pattern is nano-vllm's and mini-sglang's: largest size first, one eager warm-up per size (which
also compiles FlashInfer's kernels outside the capture), one memory pool shared by all graphs (one
graph replays at a time), the attention plan made outside the graph before each capture and replay.
Capture needs an attention backend whose `attend` reads its page table from fixed device buffers
(`AttentionBackend.supports_cuda_graphs`: FlashInfer) and a model with no host work in its forward
pass (MoE routing reads expert counts to the host, so MoE models decode eagerly; so do sliding-window
models, whose layers choose their attention path on the host, and the transformers fallback).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from engine.config import EngineConfig, ModelConfig
from engine.forward_batch import ForwardBatch, decode_tokens, paged_forward_batch
from engine.graph_batches import default_graph_batch_sizes, graph_batch_size
from engine.kv_pool import KVPool
from engine.models.layers import CausalLM
from engine.models.registry import implementation_of
from engine.request import Request
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.layers import RotaryEmbedding

logger = logging.getLogger(__name__)

DUMMY_TOKEN_ID = 0  # what a padded row feeds; any id in the vocabulary does


def configured_batch_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The decode batch sizes `config` asks to capture (its own list, or the defaults up to
    `max_running_requests`); () when it asks for none."""
    if config.cuda_graph_batch_sizes is not None:
        return config.cuda_graph_batch_sizes
    return default_graph_batch_sizes(config.max_running_requests)


def why_decode_runs_eagerly(
    device: torch.device, batch_sizes: Sequence[int], attention: AttentionBackend, model_config: ModelConfig
) -> str | None:
    """Why no decode step of this engine can replay a CUDA graph, or None when they can."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device}"
    if not batch_sizes:
        return "CUDA graphs are off (--disable-cuda-graph)"
    if not attention.supports_cuda_graphs:
        return f"the {type(attention).__name__} attention backend cannot be captured (FlashInfer can)"
    if model_config.num_experts:
        return "MoE routing reads expert counts to the host every layer"
    if model_config.features.sliding_window is not None:
        return "sliding-window layers pick their attention path from the host's sequence lengths every step"
    if implementation_of(model_config.architecture) != "tandem":
        return "transformers' modeling code (the fallback) is not captured"
    return None


def padded_decode_batch(
    requests: Sequence[Request], batch_size: int, scratch_page: int, page_size: int, pin: bool = False
) -> ForwardBatch:
    """The host batch (pinned when `pin`) of a decode step of `requests` padded to `batch_size` rows:
    the requests' rows as `build_forward_batch` makes them, then dummy rows of one token at position
    0 on page `scratch_page` (which they write). ValueError when `requests` do not fit."""
    if len(requests) > batch_size:
        raise ValueError(f"{len(requests)} requests do not fit a batch of {batch_size}")
    new_token_ids, starts = decode_tokens(requests)
    num_dummies = batch_size - len(requests)
    return paged_forward_batch(
        new_token_ids + [[DUMMY_TOKEN_ID]] * num_dummies,
        starts + [0] * num_dummies,
        [r.page_ids for r in requests] + [[scratch_page]] * num_dummies,
        page_size,
        pin,
    )


class DecodeGraphs:
    """The captured decode graphs of one model runner, their fixed input buffers and outputs.

    Single-threaded, as the engine is; the model, rotary tables, attention backend and pool are the
    runner's own (the pool must have a scratch page)."""

    def __init__(
        self,
        model: CausalLM,
        rotary: RotaryEmbedding,
        attention: AttentionBackend,
        kv_pool: KVPool,
        batch_sizes: Sequence[int],
        max_pages_per_sequence: int,
    ) -> None:
        if not kv_pool.scratch_page_ids:
            raise ValueError("CUDA-graph decode needs a KV pool with a scratch page")
        self.batch_sizes = tuple(sorted(batch_sizes))
        self._model, self._rotary, self._attention, self._pool = model, rotary, attention, kv_pool
        self._scratch_page = kv_pool.scratch_page_ids[0]
        self._page_size = kv_pool.layout.page_size
        self.device = kv_pool.device
        largest = self.batch_sizes[-1]
        max_num_pages = largest * max_pages_per_sequence
        attention.prepare_cuda_graphs(self.batch_sizes, max_num_pages)
        self._static = _static_batch(largest, max_num_pages, self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # each graph's output, [batch size, hidden]

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture one graph per batch size, largest first; returns the seconds it took."""
        start = time.perf_counter()
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            pool = None
            for size in reversed(self.batch_sizes):
                host = padded_decode_batch([], size, self._scratch_page, self._page_size, pin=True)
                self._load(host)
                batch = self._view(size, host.meta)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up: lazy initialisation and kernel compiles, uncaptured
                    self._forward(batch)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._hidden[size] = self._forward(batch)
                pool = graph.pool()
                self._graphs[size] = graph
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def replay(self, requests: Sequence[Request]) -> tuple[torch.Tensor, ForwardBatch] | None:
        """The final hidden states [n, hidden] of a decode step of the n `requests` (their KV written)
        and its batch on the device, from the graph of the smallest captured size >= n; None when
        none is that large (the caller runs the step eagerly). Valid until the next replay."""
        size = graph_batch_size(self.batch_sizes, len(requests))
        if size is None:
            return None
        host = padded_decode_batch(requests, size, self._scratch_page, self._page_size, pin=True)
        self._load(host)
        with torch.cuda.device(self.device):
            self._graphs[size].replay()
        return self._hidden[size][: len(requests)], self._view(len(requests), host.meta)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self._model(batch, self._rotary, self._attention, self._pool.tensor)

    def _load(self, host: ForwardBatch) -> None:
        """Copy a padded step's host batch into the fixed buffers (without blocking: they are pinned)
        and plan its attention into the backend's fixed buffers."""
        meta, static = host.meta, self._static
        size, num_pages = meta.num_sequences, meta.kv_indices.numel()
        pairs = (
            (static.input_ids[:size], host.input_ids),
            (static.positions[:size], host.positions),
            (static.meta.kv_indptr[: size + 1], meta.kv_indptr),
            (static.meta.kv_indices[:num_pages], meta.kv_indices),
            (static.meta.kv_last_page_len[:size], meta.kv_last_page_len),
            (static.meta.write_pages[:size], meta.write_pages),
            (static.meta.write_offsets[:size], meta.write_offsets),
        )
        for buffer, values in pairs:
            buffer.copy_(values, non_blocking=True)
        self._attention.plan_cuda_graph(meta)

    def _view(self, size: int, meta: AttentionMetadata) -> ForwardBatch:
        """The fixed buffers' first `size` rows as a decode step's device batch (`meta`: its host copy);
        it counts no experts (MoE models decode eagerly)."""
        static = self._static
        num_pages = int(meta.kv_indptr[size])
        return ForwardBatch(
            static.input_ids[:size],
            static.positions[:size],
            static.logit_rows[:size],
            AttentionMetadata(
                qo_indptr=static.meta.qo_indptr[: size + 1],
                kv_indptr=static.meta.kv_indptr[: size + 1],
                kv_indices=static.meta.kv_indices[:num_pages],
                kv_last_page_len=static.meta.kv_last_page_len[:size],
                write_pages=static.meta.write_pages[:size],
                write_offsets=static.meta.write_offsets[:size],
                query_lens=meta.query_lens[:size],
                seq_lens=meta.seq_lens[:size],
            ),
        )


def _static_batch(batch_size: int, max_num_pages: int, device: torch.device) -> ForwardBatch:
    """Fixed device buffers for decode steps of up to `batch_size` rows and `max_num_pages` page ids.
    A decode row is one token: its logit row and query offsets are the row numbers, written once."""
    int32, int64 = torch.int32, torch.int64
    rows = torch.arange(batch_size + 1, device=device)
    return ForwardBatch(
        input_ids=torch.zeros(batch_size, dtype=int64, device=device),
        positions=torch.zeros(batch_size, dtype=int64, device=device),
        logit_rows=rows[:batch_size].clone(),
        meta=AttentionMetadata(
            qo_indptr=rows.to(int32),
            kv_indptr=torch.zeros(batch_size + 1, dtype=int32, device=device),
            kv_indices=torch.zeros(max_num_pages, dtype=int32, device=device),
            kv_last_page_len=torch.ones(batch_size, dtype=int32, device=device),
            write_pages=torch.zeros(batch_size, dtype=int64, device=device),
            write_offsets=torch.zeros(batch_size, dtype=int64, device=device),
            query_lens=(1,) * batch_size,
            seq_lens=(1,) * batch_size,
        ),
    )


def capture_decode_graphs(
    model: CausalLM,
    rotary: RotaryEmbedding,
    attention: AttentionBackend,
    kv_pool: KVPool,
    config: EngineConfig,
    model_config: ModelConfig,
    context_len: int,
) -> DecodeGraphs | None:
    """The runner's decode graphs, captured and logged with the time it took; None (logged with
    the reason) when its decode steps run eagerly."""
    sizes = configured_batch_sizes(config)
    reason = why_decode_runs_eagerly(kv_pool.device, sizes, attention, model_config)
    if reason is not None:
        if kv_pool.device.type == "cuda":
            logger.info("decode runs eagerly: %s", reason)
        return None
    graphs = DecodeGraphs(model, rotary, attention, kv_pool, sizes, -(-context_len // config.page_size))
    seconds = graphs.capture()
    logger.info(
        "captured %d CUDA graphs for decode batch sizes %s in %.1f s; larger batches run eagerly",
        len(sizes),
        ",".join(map(str, sizes)),
        seconds,
    )
    return graphs
