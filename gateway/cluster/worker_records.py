"""The workers' answers as gateway records: what `WorkerClient` (`gateway/cluster/client.py`) takes
and returns instead of protos. Plain frozen values; the generation's own records (tokens, finish
reasons, sampling options) are in `gateway/records.py`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gateway.records import GeneratedToken, Role


class Health(enum.Enum):
    """A worker's answer to a health check."""

    SERVING = "serving"
    NOT_SERVING = "not_serving"  # it answered, but takes no new requests (starting, draining)
    NO_ANSWER = "no_answer"  # it did not answer in time, or could not be reached


class ExpertRecordOp(enum.Enum):
    """The expert distribution record's three calls (every worker answers each)."""

    START = "start"  # clear the counts and start counting
    STOP = "stop"  # stop counting; the counts stay for the next dump
    DUMP = "dump"  # return the counts and clear them


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Shape of one KV page; prefill and decode must agree on it byte for byte. `dtype` is torch's
    name ("bfloat16"); `page_bytes` counts all layers, K and V; `order` is the pool tensor's axis
    order ("" from a worker that does not say)."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_bytes: int
    order: str = ""


@dataclass(frozen=True, slots=True)
class KvTarget:
    """Pages a decode worker reserved for one request, where the prefill worker writes its KV, with
    the grant that permits exactly that write. The gateway only passes it on: `wire` is the proto
    (`tandem.v1.KvTarget`) serialized as the decode worker sent it, handed to the prefill worker
    unchanged, so that every field of it arrives there, those this gateway does not know included.
    `grant` is the one field the gateway itself reads (Generate and CancelPrefill name it)."""

    wire: bytes = field(repr=False)
    grant: str


@dataclass(frozen=True, slots=True)
class Reservation:
    """A decode worker's answer to Reserve: the pages are held for `ttl_ms` waiting for Generate.
    `cached_tokens`: leading prompt tokens whose KV the worker already held (its prefix cache; whole
    pages), which the prefill worker does not write."""

    kv_target: KvTarget
    ttl_ms: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prefill worker's answer: the first token, with the KV written into the reserved pages.
    Times in milliseconds; `prompt_logprobs` only when asked for (from `logprob_start_len`)."""

    first_token: GeneratedToken
    cached_tokens: int
    queue_ms: float
    compute_ms: float
    transfer_ms: float
    kv_bytes: int
    weights_id: str
    prompt_logprobs: tuple[GeneratedToken, ...] = ()


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One vector per input, in input order, and the tokens embedded over all inputs."""

    vectors: list[list[float]]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a worker reports about its model (GetModelInfo). `kv_layout` is all zeros and
    `weights_id` empty on embedding workers; `role` is None when the worker does not say."""

    model_path: str
    architecture: str
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_layout: KvLayout
    num_pages: int
    role: Role | None
    version: str
    is_embedding: bool
    embedding_dim: int
    is_matryoshka: bool
    matryoshka_dimensions: tuple[int, ...]
    weights_id: str
    num_attention_heads: int = 0
    implementation: str = ""  # "tandem" or "transformers": whose modeling code; "" when the worker does not say
    is_classifier: bool = False  # embedding workers: the vectors are a sequence classifier's logits
    lora_adapters: tuple[LoraAdapterInfo, ...] = ()  # the LoRA adapters loaded now
    max_loras: int = 0  # how many adapters the worker holds at once (0: it serves none)
    prefix_cache_disabled: bool = False  # it keeps no prefix cache: the router expects no hit there

    @property
    def lora_names(self) -> frozenset[str]:
        return frozenset(a.name for a in self.lora_adapters)


@dataclass(frozen=True, slots=True)
class LoraAdapterInfo:
    """A LoRA adapter loaded on a worker (GetModelInfo): its name, which requests give, and rank."""

    name: str
    rank: int


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's requests and KV pages now (GetLoad); cached pages are held by the prefix cache only."""

    num_running: int
    num_waiting: int
    num_free_pages: int
    num_total_pages: int
    num_cached_pages: int


@dataclass(frozen=True, slots=True)
class KvEvents:
    """One message of a worker's KV event stream (SubscribeKvEvents): page keys (`tandem.page_keys`)
    that joined its prefix cache (`stored`) and left it (`removed`) since the last message; a snapshot
    (`is_snapshot`, the stream's first) lists in `stored` every page it holds now."""

    is_snapshot: bool
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class FlushResult:
    """FlushCache's answer: refused (`success` False, `message` says why) while requests run."""

    success: bool
    message: str = ""
    num_freed_pages: int = 0


@dataclass(frozen=True, slots=True)
class UpdateResult:
    """UpdateWeights' answer: the worker's weights after the call (`weights_id`)."""

    success: bool
    message: str = ""
    weights_id: str = ""


@dataclass(frozen=True, slots=True)
class ExpertCounts:
    """A worker's expert distribution dump: `counts[i * num_experts + e]` tokens went to expert `e`
    of MoE layer `layer_ids[i]` (ascending; dense layers left out)."""

    layer_ids: tuple[int, ...]
    num_experts: int
    counts: tuple[int, ...]
    num_experts_per_tok: int
