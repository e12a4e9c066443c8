"""Mistral: Llama's layers with a sliding window over the last `sliding_window` positions on every layer."""

from __future__ import annotations

from engine.models.family import ModelFamily
from engine.models.layers import CausalLM
from engine.models.llama import _from_hf

FAMILY = ModelFamily(name="mistral", config_from_hf=_from_hf, build=CausalLM)
