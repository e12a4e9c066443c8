"""Conversions between tandem.v1 protobuf messages and engine records (the gRPC edge)."""

from __future__ import annotations

from engine.embedder import EmbeddingModelInfo
from engine.errors import InvalidRequestError
from engine.kv_pool import KVLayout, KVPool
from engine.moe import ExpertDistribution
from engine.request import FinishReason, PromptLogprobs, SamplingParams, StepOutput
from engine.stats import EngineStats
from server_runtime.context import EngineFacts
from tandem.sampling import SCALAR_FIELDS, GrammarKind, GrammarSpec, SamplingSpec
from tandem.v1 import common_pb2

_FINISH_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


_ROLE_TO_PROTO: dict[str, common_pb2.WorkerRole] = {
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
}


def role_to_proto(role: str) -> common_pb2.WorkerRole:
    """ "prefill" / "decode" (WorkerConfig.role) -> common_pb2.WorkerRole."""
    return _ROLE_TO_PROTO[role]


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The request's settings resolved over the engine's defaults; invalid values raise InvalidRequestError."""
    return SamplingParams.from_spec(spec_from_proto(msg))


def spec_from_proto(msg: common_pb2.SamplingParams) -> SamplingSpec:
    """The gateway's `SamplingSpec` back: an unset optional field reads as None."""
    return SamplingSpec(
        **{name: getattr(msg, name) for name in SCALAR_FIELDS if msg.HasField(name)},
        stop_token_ids=tuple(msg.stop_token_ids),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        token_ids_logprob=tuple(msg.token_ids_logprob),
        grammar=_grammar_from_proto(msg),
    )


def _grammar_from_proto(msg: common_pb2.SamplingParams) -> GrammarSpec | None:
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT) if msg.json_object else None
    return GrammarSpec(GrammarKind(kind), getattr(msg, kind))


def layout_to_proto(layout: KVLayout) -> common_pb2.KvLayout:
    return common_pb2.KvLayout(
        num_layers=layout.num_layers,
        page_size=layout.page_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=str(layout.dtype).removeprefix("torch."),
        page_bytes=layout.page_bytes,
        order=",".join(KVPool.AXES),
    )


def check_layout_matches(local: KVLayout, remote: common_pb2.KvLayout) -> None:
    """Raise InvalidRequestError when a peer's pages differ from ours in any way."""
    mine = layout_to_proto(local)
    if mine != remote:
        raise InvalidRequestError(
            f"KV layout mismatch between prefill and decode: local {_describe(mine)}, remote {_describe(remote)}"
        )


def finish_to_proto(reason: FinishReason | None) -> int:
    return (
        _FINISH_TO_PROTO.get(reason, common_pb2.FINISH_REASON_UNSPECIFIED)
        if reason
        else common_pb2.FINISH_REASON_UNSPECIFIED
    )


def token_to_proto(output: StepOutput) -> common_pb2.TokenOutput:
    """The token of an output that carries one (a finish-only output has none)."""
    if output.token_id is None or output.logprob is None:
        raise ValueError(f"the output of {output.request_id} carries no token")
    return _token_output(output.token_id, output.logprob, output.top_logprobs, output.token_ids_logprobs)


def prompt_logprobs_to_proto(scored: PromptLogprobs | None) -> list[common_pb2.TokenOutput]:
    """One TokenOutput per scored prompt position (see PrefillResponse.prompt_logprobs)."""
    if scored is None:
        return []
    return [
        _token_output(*position) for position in zip(scored.token_ids, scored.logprobs, scored.top, scored.requested)
    ]


def _token_output(
    token_id: int, logprob: float, top: tuple[tuple[int, float], ...], requested: tuple[tuple[int, float], ...]
) -> common_pb2.TokenOutput:
    return common_pb2.TokenOutput(
        token_id=token_id,
        logprob=logprob,
        top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in top],
        token_ids_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in requested],
    )


def model_info_to_proto(
    facts: EngineFacts, model_path: str, role: str, version: str, weights_id: str
) -> common_pb2.GetModelInfoResponse:
    """An engine worker's GetModelInfo answer."""
    return common_pb2.GetModelInfoResponse(
        model_path=model_path,
        architecture=facts.architecture,
        implementation=facts.implementation,
        context_len=facts.context_len,
        vocab_size=facts.vocab_size,
        eos_token_ids=list(facts.eos_token_ids),
        kv_layout=layout_to_proto(facts.layout),
        num_pages=facts.num_pages,
        role=role_to_proto(role),
        version=version,
        weights_id=weights_id,
        num_attention_heads=facts.num_attention_heads,
    )


def embedding_model_info_to_proto(
    info: EmbeddingModelInfo, model_path: str, version: str
) -> common_pb2.GetModelInfoResponse:
    """An embedding worker's GetModelInfo answer: a prefill role, no KV."""
    return common_pb2.GetModelInfoResponse(
        model_path=model_path,
        architecture=info.architecture,
        context_len=info.context_len,
        vocab_size=info.vocab_size,
        role=common_pb2.WORKER_ROLE_PREFILL,
        version=version,
        is_embedding=True,
        embedding_dim=info.embedding_dim,
        is_matryoshka=info.is_matryoshka,
        matryoshka_dimensions=list(info.matryoshka_dimensions),
        is_classifier=info.is_classifier,
    )


def load_to_proto(stats: EngineStats) -> common_pb2.GetLoadResponse:
    return common_pb2.GetLoadResponse(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_free_pages=stats.num_free_pages,
        num_total_pages=stats.num_total_pages,
        num_cached_pages=stats.num_cached_pages,
    )


def expert_distribution_to_proto(record: ExpertDistribution) -> common_pb2.DumpExpertDistributionRecordResponse:
    return common_pb2.DumpExpertDistributionRecordResponse(
        layer_ids=record.layer_ids,
        num_experts=record.num_experts,
        num_experts_per_tok=record.num_experts_per_tok,
        counts=[count for row in record.counts for count in row],
    )


def _describe(layout: common_pb2.KvLayout) -> str:
    return (
        f"layers={layout.num_layers} page_size={layout.page_size} kv_heads={layout.num_kv_heads} "
        f"head_dim={layout.head_dim} dtype={layout.dtype} order={layout.order or 'unstated'}"
    )
