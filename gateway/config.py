"""The gateway's frozen configuration."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gateway.sampling_defaults import SamplingDefaults
from tandem.internal_auth import InternalCredentials
from tandem.limits import DEFAULT_MAX_NEW_TOKENS
from tandem.tracing import check_endpoint

DEFAULT_MAX_QUEUED = 1024  # generations waiting for decode KV space (gateway/cluster/admission.py)
DEFAULT_MAX_QUEUE_WAIT_S = 120.0
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024  # any JSON body; /v1/files uploads have their own limit
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # on SIGTERM, how long the gateway (and, from the CLI, each worker) drains


class RouterPolicy(enum.StrEnum):
    """How the gateway places a request on its prefill and decode workers (gateway/cluster/routing.py)."""

    ROUND_ROBIN = "round_robin"  # each role in turn
    LEAST_LOAD = "least_load"  # the worker with the fewest requests (decode: then the most free pages)
    PREFIX_AWARE = "prefix_aware"  # each role: where the prompt's prefix is likely cached, within the load guard


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Where requests go. `policy` picks the workers; `prefix_load_guard` is how many more requests
    in flight the worker (prefill or decode) holding a prompt's prefix may have than the least loaded
    one of its role before the prompt goes elsewhere (prefix_aware only). A prompt of which its decode
    worker likely lacks fewer than `local_prefill_threshold` tokens (the whole prompt unless
    prefix_aware finds part of it cached there), or one arriving while every prefill worker has
    `prefill_busy_threshold` requests or more in flight, is prefilled by its decode worker, with no
    KV transfer (0 turns either off)."""

    policy: RouterPolicy = RouterPolicy.PREFIX_AWARE
    prefix_load_guard: int = 4
    local_prefill_threshold: int = 0
    prefill_busy_threshold: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", RouterPolicy(self.policy))  # a name from JSON or a flag
        for name in ("prefix_load_guard", "local_prefill_threshold", "prefill_busy_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Where the gateway listens, which workers it uses, and its limits.

    `model_path` is where the tokenizer and chat template come from (an HF directory or GGUF);
    `served_model_name` is the id clients pass as `model` (the model path is accepted too).
    `data_dir` holds uploaded files and batches (SQLite plus file contents; one gateway per directory).
    At most `batch_concurrency` batch lines run at once, and a new one starts only while fewer than
    `batch_yield_threshold` interactive requests are in flight.
    """

    model_path: str
    served_model_name: str
    prefill_addrs: tuple[str, ...]
    decode_addrs: tuple[str, ...]
    data_dir: str
    host: str = "127.0.0.1"
    port: int = 30000
    grpc_port: int = 30051  # the client gRPC API (tandem.api.v1) on `host`; 0: none
    reserve_timeout_s: float = 10.0
    prefill_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0
    max_queued_requests: int = DEFAULT_MAX_QUEUED  # generations waiting for decode KV space (admission)
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S  # ... and how long each may wait
    stall_timeout_s: float = 20.0  # a worker silent this long on a call is health-checked (gateway/cluster/handoff.py)
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # native /generate, as in SGLang
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # Bearer keys (gateway/api/auth.py): `api_key` opens every route but the open probes; `admin_api_key`,
    # when set, alone opens the admin routes. Kept out of repr so that no log line prints them.
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    skip_tokenizer_init: bool = False  # no tokenizer: token ids in and out, no text
    batch_concurrency: int = 8
    max_batch_requests: int = 256  # generations one HTTP request may start (prompts x n)
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies get a 413 unread
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # on SIGTERM: longest wait for the responses in flight
    batch_yield_threshold: int = 1
    is_embedding: bool = False  # prefill workers serve an embedding model; no decode workers
    expert_distribution_dir: str = "."  # where /dump_expert_distribution_record writes its CSV files
    internal: InternalCredentials = InternalCredentials()  # what the workers' tandem.v1 calls need
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # policy and conditional disaggregation
    otlp_traces_endpoint: str | None = None  # an OTLP/gRPC collector's URL: one trace per request; None: off

    def __post_init__(self) -> None:
        if not self.prefill_addrs or not (self.decode_addrs or self.is_embedding):
            raise ValueError("at least one prefill and one decode worker address are required")
        if self.is_embedding and self.decode_addrs:
            raise ValueError("an embedding gateway uses no decode workers")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port out of range: {self.port}")
        if not (0 <= self.grpc_port < 65536) or (self.grpc_port and self.grpc_port == self.port):
            raise ValueError(f"grpc_port must be 0 (off) or a port other than port, got {self.grpc_port}")
        if not self.data_dir:
            raise ValueError("data_dir must be set")
        if self.admin_api_key and self.admin_api_key == self.api_key:
            raise ValueError("the admin API key must differ from the user API key")
        for name in ("batch_concurrency", "batch_yield_threshold", "max_batch_requests", "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        check_endpoint(self.otlp_traces_endpoint)
        for name in (
            "reserve_timeout_s",
            "prefill_timeout_s",
            "request_timeout_s",
            "stall_timeout_s",
            "max_queue_wait_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
