"""Conversions between tandem.v1 protobuf messages and engine records (the gRPC edge)."""

from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.grammar_spec import GrammarKind, GrammarSpec
from engine.kv_pool import KVLayout
from engine.moe import ExpertDistribution
from engine.request import FinishReason, PromptLogprobs, SamplingParams, StepOutput
from tandem.v1 import common_pb2

DEFAULT_MAX_NEW_TOKENS = 128

_FINISH_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


_ROLE_TO_PROTO = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE}


def role_to_proto(role: str) -> int:
    """"prefill" / "decode" (WorkerConfig.role) -> common_pb2.WorkerRole."""
    return _ROLE_TO_PROTO[role]


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Apply defaults for unset fields; invalid values raise InvalidRequestError."""
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        min_p=msg.min_p if msg.HasField("min_p") else 0.0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos if msg.HasField("ignore_eos") else False,
        min_new_tokens=msg.min_new_tokens if msg.HasField("min_new_tokens") else 0,
        presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else 0.0,
        frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else 0.0,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        top_logprobs_num=msg.top_logprobs_num if msg.HasField("top_logprobs_num") else 0,
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
    return common_pb2.KvLayout(num_layers=layout.num_layers, page_size=layout.page_size,
                               num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                               dtype=str(layout.dtype).removeprefix("torch."), page_bytes=layout.page_bytes)


def check_layout_matches(local: KVLayout, remote: common_pb2.KvLayout) -> None:
    """Raise InvalidRequestError when a peer's pages differ from ours in any way."""
    mine = layout_to_proto(local)
    if mine != remote:
        raise InvalidRequestError(
            f"KV layout mismatch between prefill and decode: local {_describe(mine)}, remote {_describe(remote)}")


def finish_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO.get(reason, common_pb2.FINISH_REASON_UNSPECIFIED) if reason else \
        common_pb2.FINISH_REASON_UNSPECIFIED


def token_to_proto(output: StepOutput) -> common_pb2.TokenOutput:
    return _token_output(output.token_id, output.logprob, output.top_logprobs, output.token_ids_logprobs)


def prompt_logprobs_to_proto(scored: PromptLogprobs | None) -> list[common_pb2.TokenOutput]:
    """One TokenOutput per scored prompt position (see PrefillResponse.prompt_logprobs)."""
    if scored is None:
        return []
    return [_token_output(*position)
            for position in zip(scored.token_ids, scored.logprobs, scored.top, scored.requested)]


def _token_output(token_id: int, logprob: float, top: tuple[tuple[int, float], ...],
                  requested: tuple[tuple[int, float], ...]) -> common_pb2.TokenOutput:
    return common_pb2.TokenOutput(
        token_id=token_id, logprob=logprob,
        top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in top],
        token_ids_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in requested])


def expert_distribution_to_proto(record: ExpertDistribution) -> common_pb2.DumpExpertDistributionRecordResponse:
    return common_pb2.DumpExpertDistributionRecordResponse(
        layer_ids=record.layer_ids, num_experts=record.num_experts, num_experts_per_tok=record.num_experts_per_tok,
        counts=[count for row in record.counts for count in row])


def _describe(layout: common_pb2.KvLayout) -> str:
    return (f"layers={layout.num_layers} page_size={layout.page_size} kv_heads={layout.num_kv_heads} "
            f"head_dim={layout.head_dim} dtype={layout.dtype}")
