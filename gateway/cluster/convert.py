"""Gateway records <-> `tandem.v1` messages: the gateway's one converter, used by `WorkerClient` only.

Presence is kept both ways: a record field that is None is an unset proto field, and an unset
optional proto field reads as None. The proto's enums (finish reason, worker role) map to
`FinishReason` and `Role` here and nowhere else. A decode worker's `KvTarget` is not decoded: it
stays the bytes the worker sent, so that the prefill worker gets every field of it.
"""

from __future__ import annotations

from gateway.cluster.worker_records import (
    ExpertCounts,
    KvEvents,
    KvLayout,
    KvTarget,
    LoraAdapterInfo,
    ModelInfo,
    PrefillResult,
    WorkerLoad,
)
from gateway.records import Finish, FinishReason, GeneratedToken, Role, TokenChunk
from tandem.sampling import SCALAR_FIELDS, GrammarKind, SamplingSpec
from tandem.v1 import common_pb2, decode_pb2, prefill_pb2, worker_pb2

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}
_ROLES = {common_pb2.WORKER_ROLE_PREFILL: Role.PREFILL, common_pb2.WORKER_ROLE_DECODE: Role.DECODE}


def sampling_to_proto(spec: SamplingSpec) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(
        stop_token_ids=spec.stop_token_ids,
        logit_bias=dict(spec.logit_bias),
        token_ids_logprob=spec.token_ids_logprob,
    )
    for name in SCALAR_FIELDS:
        value = getattr(spec, name)
        if value is not None:
            setattr(params, name, value)
    if spec.grammar is not None:
        kind = spec.grammar.kind
        setattr(params, kind.value, True if kind is GrammarKind.JSON_OBJECT else spec.grammar.text)
    return params


def token_from_proto(msg: common_pb2.TokenOutput) -> GeneratedToken:
    return GeneratedToken(
        msg.token_id,
        msg.logprob,
        tuple((t.token_id, t.logprob) for t in msg.top_logprobs),
        tuple((t.token_id, t.logprob) for t in msg.token_ids_logprobs),
    )


def token_to_proto(token: GeneratedToken) -> common_pb2.TokenOutput:
    return common_pb2.TokenOutput(
        token_id=token.token_id,
        logprob=token.logprob,
        top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in token.top],
        token_ids_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in token.requested],
    )


def layout_from_proto(msg: common_pb2.KvLayout) -> KvLayout:
    return KvLayout(msg.num_layers, msg.page_size, msg.num_kv_heads, msg.head_dim, msg.dtype, msg.page_bytes, msg.order)


def kv_target_from_proto(msg: common_pb2.KvTarget) -> KvTarget:
    """The target as its bytes: fields this gateway's stubs do not know are kept (as unknown fields)
    and serialized with the rest."""
    return KvTarget(msg.SerializeToString(), msg.grant)


def kv_target_to_proto(target: KvTarget) -> common_pb2.KvTarget:
    return common_pb2.KvTarget.FromString(target.wire)


def prefill_from_proto(msg: prefill_pb2.PrefillResponse) -> PrefillResult:
    return PrefillResult(
        token_from_proto(msg.first_token),
        msg.cached_tokens,
        msg.queue_ms,
        msg.compute_ms,
        msg.transfer_ms,
        msg.kv_bytes,
        msg.weights_id,
        tuple(token_from_proto(t) for t in msg.prompt_logprobs),
    )


def chunk_from_proto(msg: decode_pb2.GenerateResponse) -> TokenChunk:
    reason = _FINISH_REASONS.get(msg.finish_reason)
    matched = msg.matched_token_id if msg.HasField("matched_token_id") else None
    return TokenChunk(
        [token_from_proto(t) for t in msg.tokens],
        Finish(reason, matched, msg.message) if reason is not None else None,
        queue_ms=msg.queue_ms if msg.HasField("queue_ms") else None,
        prefill_compute_ms=msg.prefill_compute_ms if msg.HasField("prefill_compute_ms") else None,
        cached_tokens=msg.cached_tokens,
        spec_verify_ct=msg.spec_verify_ct,
        spec_accepted_tokens=msg.spec_accepted_tokens,
    )


def model_info_from_proto(msg: common_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_path=msg.model_path,
        architecture=msg.architecture,
        context_len=msg.context_len,
        vocab_size=msg.vocab_size,
        eos_token_ids=tuple(msg.eos_token_ids),
        kv_layout=layout_from_proto(msg.kv_layout),
        num_pages=msg.num_pages,
        role=_ROLES.get(msg.role),
        version=msg.version,
        is_embedding=msg.is_embedding,
        embedding_dim=msg.embedding_dim,
        is_matryoshka=msg.is_matryoshka,
        matryoshka_dimensions=tuple(msg.matryoshka_dimensions),
        weights_id=msg.weights_id,
        num_attention_heads=msg.num_attention_heads,
        implementation=msg.implementation,
        is_classifier=msg.is_classifier,
        lora_adapters=tuple(LoraAdapterInfo(a.name, a.rank) for a in msg.lora_adapters),
        max_loras=msg.max_loras,
        prefix_cache_disabled=msg.prefix_cache_disabled,
    )


def load_from_proto(msg: common_pb2.GetLoadResponse) -> WorkerLoad:
    return WorkerLoad(msg.num_running, msg.num_waiting, msg.num_free_pages, msg.num_total_pages, msg.num_cached_pages)


def kv_events_from_proto(msg: worker_pb2.KvEvents) -> KvEvents:
    return KvEvents(msg.is_snapshot, tuple(msg.stored), tuple(msg.removed))


def expert_counts_from_proto(msg: common_pb2.DumpExpertDistributionRecordResponse) -> ExpertCounts:
    return ExpertCounts(tuple(msg.layer_ids), msg.num_experts, tuple(msg.counts), msg.num_experts_per_tok)
