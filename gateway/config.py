"""The gateway's frozen configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.sampling_defaults import SamplingDefaults


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Where the gateway listens, which workers it uses, and its limits.

    `model_path` is where the tokenizer and chat template come from (an HF directory or GGUF);
    `served_model_name` is the id clients pass as `model` (the model path is accepted too).
    """

    model_path: str
    served_model_name: str
    prefill_addrs: tuple[str, ...]
    decode_addrs: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 30000
    reserve_timeout_s: float = 10.0
    prefill_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0
    default_max_new_tokens: int = 128     # native /generate, as in SGLang
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    def __post_init__(self) -> None:
        if not self.prefill_addrs or not self.decode_addrs:
            raise ValueError("at least one prefill and one decode worker address are required")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port out of range: {self.port}")
        for name in ("reserve_timeout_s", "prefill_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
