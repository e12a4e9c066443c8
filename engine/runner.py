"""ModelRunner: owns the model, the KV pool tensor, the attention backend and the sampler; runs one batch.

It turns a step's `SchedulerOutput` into input tensors and attention metadata, runs one forward
pass, samples the next token of each request that reaches its last known token and returns them as
a `ModelOutput`. It never changes request state.

Everything lives on `EngineConfig.device`, chosen once here: the weights (materialized there),
the KV pool, the rotary tables, the expert counts. Each step's `ForwardBatch` is built on the host
(in pinned memory when the device is CUDA), handed to the attention backend's `plan`, then copied
to the device without blocking.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from engine.config import EngineConfig, ModelConfig
from engine.cuda_graph import capture_decode_graphs
from engine.forward_batch import ForwardBatch, build_forward_batch, paged_forward_batch
from engine.grammar import GrammarBackend
from engine.kv_pool import KVLayout, KVPool
from engine.logits import adjust_logits, logprob_extras, score_prompt
from engine.lora_slots import LoraBatch, LoraSlots
from engine.model_setup import attention_backend, load_causal_lm, load_causal_lm_weights, rotary_embedding, torch_dtype
from engine.moe import ExpertRecorder
from engine.request import PromptLogprobs, Request
from engine.step_records import ModelOutput, SampledToken, SchedulerOutput
from engine.weights import Checkpoint
from kernels.attention import resolve_attention_backend
from kernels.lora import NO_ADAPTER
from kernels.quant_linear import QuantizedEmbedding, QuantizedLinear
from kernels.rejection_sampling import verify_drafts
from kernels.sampling import SamplingBatch, create_sampler, resolve_sampler

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FaultHooks:
    """Faults injected on purpose, for the chaos tests only (tests/chaos); the default injects none.
    The server runtime reads them from TANDEM_FAULT_* environment variables (server_runtime/worker.py)."""

    nan_logits_seed: int | None = None  # requests whose sampling seed is this get NaN logits


class ModelRunner:
    def __init__(
        self,
        checkpoint: Checkpoint,
        config: EngineConfig,
        context_len: int,
        progress: bool = True,
        faults: FaultHooks = FaultHooks(),
    ) -> None:
        self.model_config: ModelConfig = checkpoint.config
        self.faults = faults
        self.dtype = torch_dtype(config.dtype)
        self.device = torch.device(config.device)
        self.page_size = config.page_size
        self._pin = self.device.type == "cuda"  # pinned host inputs: asynchronous copies to the GPU
        mc = self.model_config
        self.quantization, self.int8_activations = config.quantization, config.int8_activations
        self.model = load_causal_lm(
            checkpoint, self.dtype, self.device, self.quantization, self.int8_activations, progress
        )
        self.expert_recorder = ExpertRecorder(mc, self.device)  # counts tokens per expert while recording
        self.lora_slots = (
            LoraSlots(mc, config.max_loras, config.max_lora_rank, self.device, self.dtype) if config.max_loras else None
        )
        self.kv_dtype = torch_dtype(config.kv_cache_dtype or config.dtype)
        self.layout = KVLayout.for_model(mc, config.page_size, self.kv_dtype)
        num_pages = self._num_pages(config)
        # on a GPU, one scratch page more for the padded rows of CUDA-graph decode steps (engine/cuda_graph.py)
        self.kv_pool = KVPool(self.layout, num_pages, self.device, num_scratch_pages=int(self._pin))
        self.rotary = rotary_embedding(mc, context_len, self.dtype, self.device)
        attention = resolve_attention_backend(config.attention_backend, self.device, self.dtype)
        self.attention = attention_backend(attention, mc, config.page_size, self.dtype, self.device)
        num_fused = self.model.fuse_layers(self.attention, self.kv_dtype)
        sampler = resolve_sampler(config.sampling_backend, self.device)
        self.sampler = create_sampler(sampler, self.device)
        self.decode_graphs = capture_decode_graphs(
            self.model, self.rotary, self.attention, self.kv_pool, config, mc, context_len
        )  # None: every decode step runs eagerly
        self.weight_bytes = _weight_bytes(self.model)  # resident: packed blocks, floats, each shared tensor once
        logger.info(
            "model on %s: dtype %s, quantization %s%s (%.1f MiB of weights, %.2fx the file's %.1f MiB), "
            "attention %s, sampling %s, "
            "%d of %d layers fused (one C++ call each)",
            self.device,
            config.dtype,
            config.quantization,
            " with int8 activations" if config.int8_activations else "",
            self.weight_bytes / 2**20,
            self.weight_bytes / checkpoint.num_tensor_bytes,
            checkpoint.num_tensor_bytes / 2**20,
            attention,
            sampler,
            num_fused,
            mc.num_layers,
        )
        logger.info(
            "KV pool: %d pages x %d tokens (%.1f MiB, %s)",
            num_pages,
            config.page_size,
            self.kv_pool.num_bytes / 2**20,
            config.kv_cache_dtype or config.dtype,
        )

    def load_weights(self, checkpoint: Checkpoint, progress: bool = False) -> None:
        """(Re)load the model's weights in the configured quantization (shapes checked per tensor)."""
        load_causal_lm_weights(self.model, checkpoint, self.quantization, self.int8_activations, progress)
        self.model.fuse_layers(self.attention, self.kv_dtype)  # the fused layers point at the weights just replaced

    def _num_pages(self, config: EngineConfig) -> int:
        if config.max_total_tokens is not None:
            return max(1, config.max_total_tokens // config.page_size)
        return max(1, int(config.kv_cache_gib * 2**30) // self.layout.page_bytes)

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput, grammar: GrammarBackend | None = None) -> ModelOutput:
        """Compute the step's tokens (writing their KV into the pool) and sample the next token of each
        sampling request, verifying its draft tokens first when it has some (each accepted draft is
        an output token too); score the prompt pieces asked for. Reads request state, changes none."""
        requests = scheduled.requests
        hidden, forward_batch = self._forward(requests, scheduled.num_new_tokens, scheduled.is_decode_only)
        prompt: tuple[PromptLogprobs | None, ...] = ()
        if any(r.prompt_logprob_start is not None for r in requests):
            prompt = tuple(self._prompt_logprobs(hidden, requests, forward_batch.query_lens))
        samplers = [i for i, is_sampling in enumerate(scheduled.is_sampling) if is_sampling]
        sampled: list[tuple[SampledToken, ...]] = [() for _ in requests]
        if not samplers:
            return ModelOutput(tuple(sampled), prompt)
        batch = [requests[i] for i in samplers]
        num_rows = [len(r.draft_ids) + 1 for r in batch]  # logit rows per sampling request: its last ones
        if len(samplers) == len(requests) and all(n == 1 for n in num_rows):
            logit_rows = forward_batch.logit_rows
        else:
            ends = list(accumulate(forward_batch.query_lens))
            rows = [row for i, n in zip(samplers, num_rows) for row in range(ends[i] - n, ends[i])]
            logit_rows = torch.tensor(rows, device=hidden.device)
        owners = [r for r, n in zip(batch, num_rows) for _ in range(n)]  # the request of each logit row
        logits, non_finite_rows = self._finite_logits(self.model.compute_logits(hidden[logit_rows]), owners)
        adjusted = adjust_logits(logits, owners, self.model_config.eos_token_ids)
        if grammar is not None and any(r.grammar_matcher is not None for r in batch):
            adjusted = grammar.mask_logits(adjusted, [r.grammar_matcher for r in batch], [r.draft_ids for r in batch])
        tokens = self._sample(logits, adjusted, batch, owners, num_rows)
        for i, request_tokens in zip(samplers, tokens):
            sampled[i] = request_tokens
        row_owners = [i for i, n in zip(samplers, num_rows) for _ in range(n)]  # each logit row's batch index
        return ModelOutput(tuple(sampled), prompt, frozenset(row_owners[row] for row in non_finite_rows))

    def _sample(
        self,
        logits: torch.Tensor,
        adjusted: torch.Tensor,
        batch: list[Request],
        owners: list[Request],
        num_rows: list[int],
    ) -> list[tuple[SampledToken, ...]]:
        """Each request's tokens from its logit rows (raw `logits`, `adjusted` to sample from):
        one sampled token, or, with drafts, the accepted drafts and one more (rejection sampling keeps
        the target distribution). Logprobs are of the raw logits."""
        sampling = _sampling_batch(batch, self.device)
        logprobs: torch.Tensor | None = None
        if all(n == 1 for n in num_rows):
            token_ids, logprobs = self.sampler.sample(adjusted, sampling)
            emitted = [[t] for t in token_ids.tolist()]
        else:
            emitted = verify_drafts(self.sampler, adjusted, [r.draft_ids for r in batch], None, sampling).token_ids
        firsts = accumulate(num_rows, initial=0)
        rows = [first + j for first, tokens in zip(firsts, emitted) for j in range(len(tokens))]  # of each token
        needs_extras = any(r.sampling.top_logprobs_num or r.sampling.token_ids_logprob for r in batch)
        raw_logprobs = None
        if logprobs is None or adjusted is not logits or needs_extras:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
            flat = torch.tensor([t for tokens in emitted for t in tokens], device=logits.device)
            logprobs = raw_logprobs[torch.tensor(rows, device=logits.device), flat]
        flat_logprobs = logprobs.tolist()
        extras = logprob_extras(raw_logprobs, owners) if needs_extras and raw_logprobs is not None else None
        results: list[tuple[SampledToken, ...]] = []
        at = 0
        for tokens in emitted:
            results.append(
                tuple(
                    SampledToken(
                        t, flat_logprobs[k], *((extras.top[rows[k]], extras.requested[rows[k]]) if extras else ((), ()))
                    )
                    for k, t in enumerate(tokens, start=at)
                )
            )
            at += len(tokens)
        return results

    def _finite_logits(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """`logits` [B, V], with every row that has no usable distribution (a NaN or +inf anywhere, or
        only -inf) set to zeros, so sampling the batch stays well defined; and those rows, whose
        requests the engine fails. One [B] reduction and one scalar read per step."""
        seed = self.faults.nan_logits_seed
        if seed is not None and any(r.sampling.seed == seed for r in requests):
            logits = logits.clone()
            logits[[row for row, r in enumerate(requests) if r.sampling.seed == seed]] = float("nan")
        is_usable = torch.isfinite(logits.amax(dim=-1))  # amax propagates NaN
        if bool(is_usable.all()):
            return logits, ()
        rows = tuple((~is_usable).nonzero().flatten().tolist())
        return logits.masked_fill(~is_usable.unsqueeze(1), 0.0), rows

    @torch.inference_mode()
    def forward_logits(self, requests: list[Request], num_new_tokens: list[int] | None = None) -> torch.Tensor:
        """One forward pass in which request i computes `num_new_tokens[i]` tokens from `num_computed`
        on (None: all it lacks); fp32 logits [B, V] on the device at each request's last new token
        (KV written)."""
        counts = num_new_tokens or [r.seq_len - r.num_computed for r in requests]
        hidden, batch = self._forward(requests, counts, is_decode_only=all(n == 1 for n in counts))
        return self.model.compute_logits(hidden[batch.logit_rows])

    def _forward(
        self, requests: Sequence[Request], num_new_tokens: Sequence[int], is_decode_only: bool
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """Final hidden states [T, hidden] of every new token, and the step's batch on the device
        (from a CUDA graph when a decode-only step with no LoRA adapter fits one)."""
        lora = self._lora_batch(requests, num_new_tokens)
        if is_decode_only and self.decode_graphs is not None and lora is None:
            replayed = self.decode_graphs.replay(requests)
            if replayed is not None:
                return replayed
        counts = self.expert_recorder.step_counts()
        host = build_forward_batch(requests, num_new_tokens, self.page_size, self._pin, counts)
        if lora is not None:
            host = replace(host, lora=lora)
        return self._run(host)

    @torch.inference_mode()
    def forward_paged(
        self, new_token_ids: Sequence[Sequence[int]], starts: Sequence[int], page_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """One forward pass over sequences that are no `Request`s (a draft model's, engine/draft_model.py):
        sequence i feeds `new_token_ids[i]` after `starts[i]` tokens whose KV is in its pages `page_ids[i]`
        (`paged_forward_batch`). fp32 logits [B, V] at each one's last new token (KV written)."""
        hidden, batch = self._run(paged_forward_batch(new_token_ids, starts, page_ids, self.page_size, self._pin))
        return self.model.compute_logits(hidden[batch.logit_rows])

    def _run(self, host: ForwardBatch) -> tuple[torch.Tensor, ForwardBatch]:
        """The model over a host batch: planned, copied to the device, computed; hidden states and the device batch."""
        self.attention.plan(host.meta)
        batch = host.to(self.device)
        return self.model(batch, self.rotary, self.attention, self.kv_pool.tensor), batch

    def _lora_batch(self, requests: Sequence[Request], num_new_tokens: Sequence[int]) -> LoraBatch | None:
        """Which adapter slot each new token's row takes, when any request runs under one."""
        if self.lora_slots is None or all(r.lora_slot is None for r in requests):
            return None
        slots = [NO_ADAPTER if r.lora_slot is None else r.lora_slot for r in requests]
        return self.lora_slots.batch([slot for slot, n in zip(slots, num_new_tokens) for _ in range(n)])

    def _prompt_logprobs(
        self, hidden: torch.Tensor, requests: Sequence[Request], query_lens: tuple[int, ...]
    ) -> list[PromptLogprobs | None]:
        """Score each asking request's prompt tokens from max(prompt_logprob_start, 1) on, as far as this
        step's rows reach: the row of position p predicts token p + 1, and a prefill chunk holds rows
        num_computed ... num_computed + rows - 1 (the scheduler kept positions from start - 1 uncached).
        None for a request that asks nothing or whose chunk scores nothing."""
        results: list[PromptLogprobs | None] = []
        offset = 0
        for req, num_rows in zip(requests, query_lens):
            begin = req.num_computed
            first = max(req.prompt_logprob_start or 0, 1, begin + 1)
            last = min(begin + num_rows, req.prompt_len - 1)
            if req.prompt_logprob_start is None or first > last:
                results.append(None)
            else:
                rows = hidden[offset + first - 1 - begin : offset + last - begin]
                results.append(
                    score_prompt(self.model.compute_logits, rows, req.prompt_ids[: last + 1], first, req.sampling)
                )
            offset += num_rows
        return results


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and packed quantized weights, each shared tensor counted once."""
    tensors: dict[int, torch.Tensor] = {id(p): p for p in model.parameters()}
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            tensors[id(module.quantized.data)] = module.quantized.data
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _sampling_batch(requests: list[Request], device: torch.device) -> SamplingBatch:
    params = [r.sampling for r in requests]
    return SamplingBatch(
        temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        top_ks=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        is_greedy=torch.tensor([p.is_greedy for p in params], dtype=torch.bool, device=device),
        seeds=tuple(p.seed for p in params),
        steps=tuple(len(r.output_ids) for r in requests),
    )
