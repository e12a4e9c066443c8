"""`ModelFamily`: what one model family file tells the rest of the engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ModelConfig

if TYPE_CHECKING:
    from engine.models.config_readers import GGUFMetadata
    from engine.models.layers import CausalLM


def _unchanged(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One family: how to read its config, how to build its module, how its checkpoints differ.

    `build(config)` returns the model as plain modules whose parameter names are the HF checkpoint's
    (fused projections list their parts); built on the meta device, it is also where parameter shapes
    come from (`engine.weights.names.expected_shapes`). `config_from_gguf` is None for families with no
    GGUF mapping. `gguf_rope_permuted`: llama.cpp's converter interleaved the rotary pairs of q and k
    (the reader undoes it). `from_hf_tensor(name, tensor)` turns an HF checkpoint tensor into the form
    the module keeps (Gemma's norms store `w` for `1 + w`; GGUF files already hold `1 + w`).
    """

    name: str
    config_from_hf: Callable[[Mapping[str, Any]], ModelConfig]
    build: Callable[[ModelConfig], CausalLM]
    config_from_gguf: Callable[[GGUFMetadata], ModelConfig] | None = None
    gguf_rope_permuted: bool = False
    from_hf_tensor: Callable[[str, torch.Tensor], torch.Tensor] = _unchanged
