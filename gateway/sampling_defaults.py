"""Server-side sampling defaults, used where a request leaves a field unset.

As vLLM does, they come from the model's `generation_config.json` when an HF directory has one;
`--default-sampling` overrides them. Explicit request values always win.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from tandem.limits import SAMPLING_RANGES

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """None: no default (the workers' own applies). Each value must be one a request may send."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value, allowed = getattr(self, field.name), SAMPLING_RANGES[field.name]
            if value is not None and value not in allowed:
                raise ValueError("default " + allowed.error(field.name, value))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SamplingDefaults:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown default sampling keys {unknown}; known: {sorted(known)}")
        return cls(**values)

    def overridden_by(self, other: SamplingDefaults) -> SamplingDefaults:
        return replace(
            self, **{f.name: getattr(other, f.name) for f in fields(other) if getattr(other, f.name) is not None}
        )


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
