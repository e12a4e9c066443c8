"""`WorkerConfig`: everything a prefill or decode server process needs, frozen. Imports no torch, so
the launcher reads its defaults for the command line and rebuilds it from `tandem serve`'s hand-off
without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from kv_transfer import TransportConfig
from tandem.internal_auth import InternalCredentials
from tandem.tracing import check_endpoint


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a prefill or decode server process needs."""

    role: str  # "prefill" or "decode"
    model_path: str
    host: str
    port: int  # 0: any free port (tests; `RunningWorker.address` tells which)
    engine: EngineConfig
    transport: TransportConfig  # its transfer_timeout_s: prefill's longest KV write before the request fails
    torch_threads: int
    # decode: above torch_threads, the engine loop picks each step's threads between the two from measured
    # step times (server_runtime/threads.py); 0 or torch_threads: always torch_threads
    max_torch_threads: int = 0
    reservation_ttl_s: float = 300.0  # decode: pages held for a prefill that never comes (long queues wait)
    write_grace_s: float = 30.0  # decode: unused reservation pages rest this long before reuse
    is_embedding: bool = False  # prefill: serve Embed from an embedding model; no engine, KV or decode
    metrics_port: int = 0  # HTTP port serving Prometheus text; 0: no metrics endpoint
    credentials: InternalCredentials = InternalCredentials()  # the token (and TLS) every tandem.v1 call needs
    # Keys KV write grants (kv_grants.py); the workers' alone, never the gateway's. None: an open plane's public key.
    kv_grant_secret: str | None = field(default=None, repr=False)
    weights_dirs: tuple[str, ...] = ()  # UpdateWeights loads only from under these; (): the model's directory
    grammar_compile_timeout_s: float = 5.0  # a request's grammar that takes longer to compile is refused
    drain_timeout_s: float = 30.0  # on SIGTERM/SIGINT: longest wait for the requests in flight to finish
    otlp_traces_endpoint: str | None = None  # an OTLP/gRPC collector's URL for this worker's spans; None: off
    # LoRA adapters (engine.max_loras > 0): loaded at start by name, and where LoadLoraAdapter may load from
    lora_paths: tuple[tuple[str, str], ...] = ()
    lora_dir: str | None = None
    # "host:port" of the cluster's KV store (`tandem kv-store`), where the prefix cache keeps pages too; None: none
    kv_store: str | None = None
    draft_model_path: str | None = None  # decode: the draft model of engine.speculative_algorithm "draft"

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port out of range: {self.port}")
        if not (0 <= self.metrics_port < 65536) or (self.metrics_port and self.metrics_port == self.port):
            raise ValueError(f"metrics_port must be 0 (off) or a port other than port, got {self.metrics_port}")
        if self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1")
        if self.max_torch_threads < 0:
            raise ValueError("max_torch_threads must be >= 0")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError("grammar_compile_timeout_s must be positive")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.reservation_ttl_s <= 0 or self.write_grace_s < 0:
            raise ValueError("reservation_ttl_s must be positive, write_grace_s >= 0")
        check_endpoint(self.otlp_traces_endpoint)
        if self.kv_store is not None:
            host, _, port = self.kv_store.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"kv_store must be the store's host:port, got {self.kv_store!r}")
        if (self.lora_paths or self.lora_dir) and self.engine.max_loras == 0:
            raise ValueError("LoRA adapters need slots for them: set --max-loras (engine.max_loras) above 0")
        if self.engine.speculative_algorithm == "draft" and self.draft_model_path is None:
            raise ValueError("--speculative-algorithm draft needs --speculative-draft-model-path (draft_model_path)")
        if self.draft_model_path is not None and self.engine.speculative_algorithm != "draft":
            raise ValueError(
                "--speculative-draft-model-path (draft_model_path) is used only with --speculative-algorithm draft"
            )
        if self.is_embedding and self.role != "prefill":
            raise ValueError("is_embedding is for prefill workers only: embeddings need no decode")
        if self.engine.device != "cpu" and not self.is_embedding and self.transport.backend == "local":
            # memmove reads and writes host memory: a device pointer there would crash the process.
            # (Mooncake's CPU build is refused when the transport starts: which build is installed
            # is a fact of the machine, not of the config.)
            raise ValueError(
                f"the local KV transport copies host memory only, not {self.engine.device} memory: run "
                "prefill and decode workers with --kv-transport mooncake, or with --device cpu"
            )

    @property
    def kind_name(self) -> str:
        """The worker kind this config is for: "prefill", "decode" or "embedding"."""
        return "embedding" if self.is_embedding else self.role
