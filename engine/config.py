"""Frozen configuration records for the model runtime.

`ModelConfig` describes an architecture (read from an HF `config.json` or GGUF metadata);
`EngineConfig` describes how one engine instance runs it (dtype, KV pool size, batching limits).
Values discovered at run time (the number of pages that fit, eos ids found in a tokenizer) live in
runtime state, never in these records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from engine.graph_batches import check_graph_batch_sizes


class ConfigError(ValueError):
    """A configuration value is missing or invalid."""


@dataclass(frozen=True, slots=True)
class LayerFeatures:
    """What a family's decoder layers compute beyond Llama's (each default is Llama's behaviour).

    `qk_norm`: an RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3). `sandwich_norms`:
    an RMSNorm on the attention output and on the MLP output before each residual add, the MLP's
    input norm named `pre_feedforward_layernorm` (Gemma 3). `activation`: the gated MLP's "silu" or
    "gelu_tanh". `attention_scale`: the softmax scale (None: head_dim ** -0.5). `sliding_window`:
    a layer attends to its last `sliding_window` positions only, on the layers in `sliding_layers`
    (all layers when empty); `local_rope_theta` is those layers' own rotary base (Gemma 3).
    `embedding_scale` multiplies the embeddings (in the model's dtype); `final_logit_softcap` caps
    logits as `c * tanh(logits / c)`.
    """

    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    attention_scale: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    embedding_scale: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive or None, got {self.sliding_window}")


ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder, as its family (`engine/models/`) reads them from an HF
    `config.json` or GGUF metadata. `architecture` is the HF class name the registry knows it by.

    `qkv_bias` / `o_proj_bias`: biases on q/k/v and on o. `features`: what the layers compute beyond
    Llama's (`LayerFeatures`). `eos_token_ids` holds every token id that ends generation by default.

    Mixture of experts (`num_experts` > 0): layer i routes each token to `num_experts_per_tok` of
    `num_experts` SwiGLU experts of width `moe_intermediate_size` when `is_moe_layer(i)`; the other
    layers keep a dense MLP of width `intermediate_size`. `shared_expert_intermediate_size` > 0 adds
    Qwen2-MoE's sigmoid-gated shared expert. `num_labels` > 0 means a sequence-classification model:
    a `score` head with that many outputs replaces `lm_head`.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: tuple[tuple[str, Any], ...] = field(default=())
    features: LayerFeatures = LayerFeatures()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the chosen experts' weights to sum to 1
    decoder_sparse_step: int = 1  # every n-th layer (1-based) is an MoE layer ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which stay dense
    num_labels: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        scaling = dict(self.rope_scaling)
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default", "llama3", "linear"):
            raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ConfigError("moe_intermediate_size and decoder_sparse_step must be positive")
        if self.num_labels < 0:
            raise ConfigError(f"num_labels must be >= 0, got {self.num_labels}")

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer `layer_id` routes tokens to experts (else it has a dense MLP)."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    def window_of(self, layer_id: int) -> int | None:
        """How many trailing positions layer `layer_id` attends to (None: all of them)."""
        features = self.features
        if features.sliding_window is None:
            return None
        return features.sliding_window if not features.sliding_layers or layer_id in features.sliding_layers else None


_DTYPES = ("bfloat16", "float32", "float16")
QUANTIZATIONS = ("none", "gguf", "q8_0", "q4_0", "q4_1")  # what each means: engine/weight_loader.py
SPECULATIVE_ALGORITHMS = ("ngram", "draft")  # draft proposers: engine/proposers.py, engine/draft_model.py
DRAFT_POLICIES = ("auto", "always")
MAX_LORA_RANK = 64  # the batched LoRA kernels' largest rank (kernels/lora.py)
# "meta" (shapes without data) lets tests run the whole forward pass with no memory and no GPU
_DEVICE = re.compile(r"cpu|meta|cuda(:\d+)?")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one engine runs a model.

    The KV pool holds `max_total_tokens` tokens when set, else as many as fit `kv_cache_gib`.
    `context_len` overrides the model's `max_position_embeddings` (it may only shrink it).
    A prefill step computes at most `max_prefill_tokens` prompt tokens, except that without
    chunking a longer prompt still runs whole, alone. `chunked_prefill_size` (None: off) caps a
    step at that many prompt tokens too and splits the prompt that would cross the cap, so it is
    prefilled over several steps (0 is accepted as off, as SGLang's users write it).
    `max_num_batched_tokens` (None: no cap beyond those) caps every step's tokens, decode and prompt
    together: decode tokens go first, prompts get what is left (engine/scheduler.py).
    `speculative_algorithm` "ngram" or "draft" (None: off) has each decoding request feed up to
    `speculative_num_draft_tokens` guessed tokens (prompt lookup, engine/proposers.py; a draft model
    the engine is given, engine/draft_model.py) and verify them in the same step; output follows the
    target distribution exactly either way.
    `speculative_draft_policy` "auto" verifies a draft only where the measured step times and the
    request's acceptance so far say it pays (engine/step_costs.py); "always": every draft, every step.
    `max_loras` (0: none) LoRA adapters of rank up to `max_lora_rank` can be held at once, each in a
    slot a request names (`Request.lora_slot`; engine/lora_slots.py).
    `max_decode_slowdown` (None: off) holds a step that decodes and also computes prompt tokens to
    about that many times a decode-only step's time, by its prompt tokens (engine/pacing.py); it
    needs chunking to split a prompt. A prompt with at most `unpaced_prompt_tokens` left to compute
    after its cached prefix runs whole, outside that pace (0: every prompt is paced).
    `overlap_schedule`: the server runtime queues a decode step that is certain while the step before
    it computes (engine/overlap.py); the tokens are the same either way.

    `device` is where the weights, the KV pool and every per-step tensor live ("cpu", "cuda",
    "cuda:<n>"; the entry point resolves "auto"). Quantized weights compute in a CPU kernel, so a
    non-CPU device needs `quantization="none"`. `attention_backend` and `sampling_backend` are
    names resolved for the device at start-up (`kernels.attention`, `kernels.sampling`).
    `kv_cache_dtype` is the KV pool's dtype (None: `dtype`); on CPU it may differ from `dtype` (a
    float32 model over a bfloat16 pool halves the bytes attention reads and a KV transfer moves),
    elsewhere it must not. Workers that hand KV to each other must agree on it.
    `cuda_graph_batch_sizes`: the decode batch sizes captured as CUDA graphs at start-up, on a CUDA
    device with an attention backend that can replay them (`engine/cuda_graph.py`); None: the
    defaults up to `max_running_requests` (`engine/graph_batches.py`); (): every step eager.
    """

    dtype: str = "bfloat16"
    page_size: int = 16
    max_total_tokens: int | None = None
    kv_cache_gib: float = 1.0
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int | None = None
    max_num_batched_tokens: int | None = None
    speculative_algorithm: str | None = None  # one of SPECULATIVE_ALGORITHMS
    speculative_num_draft_tokens: int = 4
    speculative_draft_policy: str = "auto"  # one of DRAFT_POLICIES
    max_decode_slowdown: float | None = 1.5
    unpaced_prompt_tokens: int = 64
    overlap_schedule: bool = True
    max_loras: int = 0
    max_lora_rank: int = 16
    context_len: int | None = None
    device: str = "cpu"
    attention_backend: str = "auto"
    sampling_backend: str = "auto"
    quantization: str = "none"  # one of QUANTIZATIONS
    int8_activations: bool = False  # quantized matmuls round activations to int8 blocks (llama.cpp's way)
    kv_cache_dtype: str | None = None
    enable_prefix_cache: bool = False
    kv_host_cache_gib: float = 0.0  # the prefix cache's host-memory tier (engine/kv_host_tier.py); 0: none
    kv_disk_cache_dir: str | None = None  # the prefix cache's disk tier (engine/kv_disk_tier.py); None: none
    kv_disk_cache_gib: float = 16.0
    cuda_graph_batch_sizes: tuple[int, ...] | None = None

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens a decoding request may feed per step (0: no speculation)."""
        return self.speculative_num_draft_tokens if self.speculative_algorithm else 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in _DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {_DTYPES} or None, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype not in (None, self.dtype) and self.device != "cpu":
            raise ConfigError(
                f"a KV pool in {self.kv_cache_dtype} under a {self.dtype} model is CPU only; on "
                f"{self.device} the pool is in the model's dtype (leave kv_cache_dtype unset)"
            )
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(f"max_total_tokens must be >= page_size, got {self.max_total_tokens}")
        if self.kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")
        if (self.kv_disk_cache_dir is not None or self.kv_host_cache_gib) and not self.enable_prefix_cache:
            raise ConfigError("a KV host or disk cache is a tier of the prefix cache: it needs the prefix cache on")
        if self.kv_host_cache_gib < 0:
            raise ConfigError(f"kv_host_cache_gib must be >= 0, got {self.kv_host_cache_gib}")
        if self.kv_disk_cache_gib <= 0:
            raise ConfigError(f"kv_disk_cache_gib must be positive, got {self.kv_disk_cache_gib}")
        if self.max_running_requests <= 0 or self.max_prefill_tokens <= 0:
            raise ConfigError("max_running_requests and max_prefill_tokens must be positive")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 0:
            raise ConfigError(
                f"chunked_prefill_size must be positive, or None or 0 (no chunking), got {self.chunked_prefill_size}"
            )
        if self.speculative_algorithm not in (None, *SPECULATIVE_ALGORITHMS):
            raise ConfigError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} or None, "
                f"got {self.speculative_algorithm!r}"
            )
        if self.speculative_draft_policy not in DRAFT_POLICIES:
            raise ConfigError(
                f"speculative_draft_policy must be one of {DRAFT_POLICIES}, got {self.speculative_draft_policy!r}"
            )
        if self.speculative_num_draft_tokens < 1:
            raise ConfigError(f"speculative_num_draft_tokens must be positive, got {self.speculative_num_draft_tokens}")
        if self.max_loras < 0 or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ConfigError(
                f"max_loras must be >= 0 and max_lora_rank in [1, {MAX_LORA_RANK}], got {self.max_loras} and "
                f"{self.max_lora_rank}"
            )
        if self.max_decode_slowdown is not None and self.max_decode_slowdown <= 1:
            raise ConfigError(f"max_decode_slowdown must be above 1, or None (off), got {self.max_decode_slowdown}")
        if self.unpaced_prompt_tokens < 0:
            raise ConfigError(f"unpaced_prompt_tokens must be 0 or more, got {self.unpaced_prompt_tokens}")
        decode_tokens = self.max_running_requests * (1 + self.num_draft_tokens)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < decode_tokens:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least {decode_tokens}: a step "
                f"schedules every running request's token{' and drafts' if self.num_draft_tokens else ''} "
                f"(max_running_requests {self.max_running_requests})"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"device must be cpu, cuda or cuda:<index>, got {self.device!r}")
        if self.quantization != "none" and self.device != "cpu":
            raise ConfigError(
                f"quantization {self.quantization!r} computes with the CPU kernel only; on "
                f"device {self.device!r} the weights must be floats (quantization none)"
            )
        if self.context_len is not None and self.context_len <= 1:
            raise ConfigError(f"context_len must be > 1, got {self.context_len}")
        if self.cuda_graph_batch_sizes is not None:
            try:
                check_graph_batch_sizes(self.cuda_graph_batch_sizes, self.max_running_requests)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
