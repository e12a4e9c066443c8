"""Model families found by name: HF architecture string (or GGUF `general.architecture`) -> family.

Each family lives in its own module under `engine/models/`, imported only when a checkpoint asks for
it, and exposes `FAMILY`, a `ModelFamily`. Adding a dense family is one module plus one line here.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ConfigError, ModelConfig
from engine.models.family import ModelFamily

if TYPE_CHECKING:
    from engine.models.layers import CausalLM

# HF architecture -> the module whose FAMILY serves it
_MODULES = {
    "LlamaForCausalLM": "engine.models.llama",
    "LlamaForSequenceClassification": "engine.models.llama",
    "MistralForCausalLM": "engine.models.mistral",
    "Qwen2ForCausalLM": "engine.models.qwen2",
    "Qwen2ForSequenceClassification": "engine.models.qwen2",
    "Qwen3ForCausalLM": "engine.models.qwen3",
    "Phi3ForCausalLM": "engine.models.phi3",
    "Gemma3ForCausalLM": "engine.models.gemma3",
    "Qwen2MoeForCausalLM": "engine.models.qwen2_moe",
    "MixtralForCausalLM": "engine.models.mixtral",
}
# any other HF *ForCausalLM that transformers ships runs on its modeling code (engine/models/transformers_fallback.py)
_FALLBACK = "engine.models.transformers_fallback"
# llama.cpp's architecture names -> HF architecture (Mistral's GGUF files say "llama")
_GGUF = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def supported_architectures() -> tuple[str, ...]:
    """The HF architectures a family file serves."""
    return tuple(_MODULES)


def supported_gguf_architectures() -> tuple[str, ...]:
    return tuple(_GGUF)


def family_of(architecture: str) -> ModelFamily:
    """The family serving HF `architecture`: its family file's, else, for a `*ForCausalLM` class that
    transformers ships, the fallback on transformers' modeling code; ConfigError naming the supported
    ones otherwise."""
    module = _MODULES.get(architecture)
    if module is None and _has_transformers_class(architecture):
        module = _FALLBACK
    if module is None:
        raise ConfigError(
            f"unsupported architecture {architecture!r}: no family file serves it (supported: {', '.join(_MODULES)}) "
            "and transformers has no such *ForCausalLM class"
        )
    family: ModelFamily = importlib.import_module(module).FAMILY
    return family


def implementation_of(architecture: str) -> str:
    """Whose modeling code runs `architecture`: "tandem" (a family file) or "transformers" (the fallback)."""
    return "tandem" if architecture in _MODULES else "transformers"


def _has_transformers_class(architecture: str) -> bool:
    from engine.models.transformers_fallback import causal_lm_class  # imports transformers: only when asked

    return causal_lm_class(architecture) is not None


def gguf_architecture(name: str) -> str:
    """The HF architecture of a GGUF file's `general.architecture`; ConfigError if none serves it."""
    if name not in _GGUF:
        raise ConfigError(f"unsupported GGUF architecture {name!r}; supported: {', '.join(_GGUF)}")
    return _GGUF[name]


def config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """The `ModelConfig` of an HF config dict, read by its architecture's family."""
    archs = config.get("architectures") or []
    if not archs:
        raise ConfigError(f"config.json names no architectures; supported: {', '.join(_MODULES)}")
    return family_of(str(archs[0])).config_from_hf(config)


# torch.nn.init's in-place fills, which every module's reset_parameters calls. On meta tensors `normal_` goes
# through torch's reference ops, whose first use imports torch._dynamo: seconds at each start, for values
# that a meta tensor does not hold anyway.
_INIT_FILLS = (
    "normal_",
    "uniform_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "constant_",
    "zeros_",
    "ones_",
    "orthogonal_",
)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device and skip their random init."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FILLS}
    try:
        for name in _INIT_FILLS:
            setattr(torch.nn.init, name, _no_fill)
        with torch.device("meta"):
            yield
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)


def _no_fill(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def build_model(config: ModelConfig) -> CausalLM:
    """The module of `config`'s family (on the current default device: meta for shapes only)."""
    return family_of(config.architecture).build(config)
