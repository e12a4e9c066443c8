"""Request records shared by the scheduler, the model runner and the servers. No torch here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from engine.errors import ContextLengthExceededError, InvalidRequestError
from tandem.limits import DEFAULT_MAX_NEW_TOKENS, LOGIT_BIAS, SAMPLING_RANGES
from tandem.sampling import GrammarSpec, SamplingSpec


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # prompt KV not computed yet (or only its first chunks)
    LOADING = "loading"  # not queued yet: its prompt's cached pages are being read from a slow KV tier
    RECEIVING = "receiving"  # reserved: its pages await its prompt's KV (`num_computed` tokens) from another process
    RUNNING = "running"  # has KV for every token but the last one; decodes each step
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # eos or a stop token id
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # this request's computation went wrong (non-finite logits); the batch goes on


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Resolved sampling settings: a request's `SamplingSpec` (`from_spec`), whose unset fields take these
    defaults (for any gRPC client); the values must lie in `tandem.limits`' ranges, the gateway's too.
    The fields are the spec's, by name. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0  # eos and stop token ids are masked until this many
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens, in [-2, 2]
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt and generated tokens, > 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs_num: int = 0  # also return this many most likely tokens per position
    token_ids_logprob: tuple[int, ...] = ()  # also return the logprobs of these ids per position
    grammar: GrammarSpec | None = None  # constrain the output (JSON schema, regex, EBNF)

    def __post_init__(self) -> None:
        for name, allowed in SAMPLING_RANGES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise InvalidRequestError(allowed.error(name, value))
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequestError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if any(bias not in LOGIT_BIAS for _, bias in self.logit_bias):
            raise InvalidRequestError(f"logit_bias values {LOGIT_BIAS.rule}")

    @classmethod
    def from_spec(cls, spec: SamplingSpec) -> SamplingParams:
        """The spec's set fields over these defaults; a value out of range raises InvalidRequestError."""
        return cls(**{f.name: value for f in fields(spec) if (value := getattr(spec, f.name)) is not None})

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class Request:
    """One sequence in the engine.

    `prompt_ids` + `output_ids` is the sequence; KV is held in `page_ids` for the first
    `num_computed` tokens. Each step computes some of the rest (the scheduler says how many) and
    samples the next token once it reaches the last one: a long prompt may take several steps
    (chunked prefill), a decoding request computes its newest token each step. A prefill-only request
    (`is_prefill_only`) finishes after its first sampled token; the engine's KV connector may then
    keep its pages while it sends them (`kv_params`: what to send where, opaque to the engine).
    With `prompt_logprob_start` set, prefill also scores the prompt's own tokens from that position
    on (`prompt_logprobs`), so the prefix cache may serve at most the tokens before it.
    A running request preempted for lack of pages (`is_resuming`) gave its pages back; it waits to
    be computed again over its whole sequence so far, and the token sampled at the end of that
    is its next output token, as a decode step would have sampled it.
    `priority` orders the waiting queue and the choice of whom to preempt (lower value: first served,
    last preempted).
    `draft_ids`: tokens a proposer guessed to follow the sequence (speculative decoding), fed with
    the newest token in one step and verified there; the scheduler sets them, the step clears them.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    is_prefill_only: bool = False
    page_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    grammar_matcher: Any = None  # runtime state of `sampling.grammar` (engine.grammar)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    matched_token_id: int | None = None
    abort_message: str = ""  # why it was aborted, or why it failed (FinishReason.ERROR)
    prompt_logprob_start: int | None = None  # score the prompt from this position (None: don't)
    prompt_logprobs: PromptLogprobs | None = None
    prefill_started_at: float | None = None  # time.perf_counter() when its (first chunk's) prefill began
    is_resuming: bool = False  # preempted: its KV is recomputed over its whole sequence so far
    priority: int = 0  # lower is served first and preempted last (vLLM's convention)
    draft_ids: list[int] = field(default_factory=list)
    num_spec_steps: int = 0  # steps that verified drafts for it
    num_accepted_drafts: int = 0  # of its drafts, those accepted as output
    num_rejecting_steps: int = 0  # of its verifying steps, those that rejected a draft
    lora_id: str = ""  # the LoRA adapter it runs under, as loaded ("" for none): its prefix cache namespace
    lora_slot: int | None = None  # where that adapter's weights are (engine/lora_slots.py); None: the base model
    kv_params: object = None  # for the engine's KV connector (engine/kv_connector.py); None: nothing to move

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens `start ... end - 1` of the sequence (prompt, then output, then drafts), without
        copying the rest."""
        if end > self.seq_len:
            return (
                self.token_ids(start, self.seq_len) + self.draft_ids[max(0, start - self.seq_len) : end - self.seq_len]
            )
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - num_prompt]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What a prompt must fit: token ids in [0, `vocab_size`), at most `context_len` tokens with the
    next one. The checks raise InvalidRequestError or ContextLengthExceededError."""

    vocab_size: int
    context_len: int

    def check_prompt(
        self, token_ids: list[int], allow_full_context: bool = False, logprob_start: int | None = None
    ) -> None:
        """Refuse an empty prompt, an id outside the vocabulary, a prompt leaving no room for a token
        (with `allow_full_context`: longer than the context), or a `logprob_start` (None: the prompt
        is not scored) that is no position of the prompt, in that order."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.vocab_size
        bad = next((t for t in token_ids if not (0 <= t < vocab)), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        limit = self.context_len if allow_full_context else self.context_len - 1
        if len(token_ids) > limit:
            raise ContextLengthExceededError(
                f"prompt has {len(token_ids)} tokens; the context length is {self.context_len}"
            )
        prompt_len = len(token_ids)
        if logprob_start is not None and not (0 <= logprob_start < prompt_len):
            raise InvalidRequestError(
                f"logprob_start_len must be in [0, {prompt_len}) for a {prompt_len}-token prompt, got {logprob_start}"
            )

    def check_prompt_len(self, prompt_len: int) -> None:
        """The checks of a prompt known only by its length (its KV is written from elsewhere):
        at least one token, and room for one more."""
        if prompt_len < 1:
            raise InvalidRequestError("prompt_len must be >= 1")
        if prompt_len >= self.context_len:
            raise ContextLengthExceededError(
                f"prompt has {prompt_len} tokens; the context length is {self.context_len}"
            )


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of a prompt's last `len(token_ids)` tokens (each given the tokens before it;
    position 0 has none, so never the whole prompt), with the top / requested logprobs the
    request's sampling params ask for at each position."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]
    requested: tuple[tuple[tuple[int, float], ...], ...]


def join_prompt_logprobs(earlier: PromptLogprobs | None, later: PromptLogprobs | None) -> PromptLogprobs | None:
    """`earlier`'s positions, then `later`'s, which must be the positions right after them (as the
    pieces of one prompt scored by consecutive prefill chunks are). None is an empty piece."""
    if earlier is None:
        return later
    if later is None:
        return earlier
    return PromptLogprobs(
        earlier.token_ids + later.token_ids,
        earlier.logprobs + later.logprobs,
        earlier.top + later.top,
        earlier.requested + later.requested,
    )


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one engine step produced for one request: a new token, a finish, or both.

    `top_logprobs` holds (token_id, logprob) of the most likely tokens when asked for, and
    `token_ids_logprobs` the logprobs of the ids the request named, in its order.
    """

    request_id: str
    token_id: int | None
    logprob: float | None
    finish_reason: FinishReason | None = None
    matched_token_id: int | None = None
    abort_message: str = ""  # for ABORT and ERROR: why
    top_logprobs: tuple[tuple[int, float], ...] = ()
    token_ids_logprobs: tuple[tuple[int, float], ...] = ()
    cached_tokens: int = 0  # set on a request's first token: prompt tokens served from the cache
    weights_id: str = ""  # the engine's `weights_id` when this output was computed
    prompt_logprobs: PromptLogprobs | None = None  # on the first token, when the request asked
    prefill_started_at: float | None = None  # on the first token: when its prefill forward began
    spec_verify_ct: int = 0  # with the finish: the steps that verified drafts for it (speculative decoding)
    spec_accepted_tokens: int = 0  # with the finish: its drafts accepted as output
