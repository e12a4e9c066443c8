"""Server-side sampling defaults, used where a request leaves a field unset.

As vLLM does, they come from the model's `generation_config.json` when an HF directory has one;
`--default-sampling` overrides them. Explicit request values always win.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"default temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise ValueError(f"default top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"default top_k must be >= -1, got {self.top_k}")
        if self.min_p is not None and not (0 <= self.min_p <= 1):
            raise ValueError(f"default min_p must be in [0, 1], got {self.min_p}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "SamplingDefaults":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown default sampling keys {unknown}; known: {sorted(known)}")
        return cls(**values)

    def overridden_by(self, other: "SamplingDefaults") -> "SamplingDefaults":
        return replace(self, **{f.name: getattr(other, f.name) for f in fields(other)
                                if getattr(other, f.name) is not None})


def load_generation_config(model_path: str) -> SamplingDefaults:
    """Sampling fields of `generation_config.json` beside an HF model; empty for GGUF files."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return SamplingDefaults()
    config = json.loads(path.read_text())
    if config.get("do_sample") is False:
        return SamplingDefaults(temperature=0.0)
    values = {k: config[k] for k in ("temperature", "top_p", "top_k", "min_p") if config.get(k) is not None}
    defaults = SamplingDefaults.from_mapping(values)
    if values:
        logger.info("sampling defaults from %s: %s", path, values)
    return defaults
