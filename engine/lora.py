"""LoRA adapters as data: a PEFT adapter directory read, checked against the base model, and kept as float32
A/B pairs per (layer, projection); where adapters may load from (`resolve_adapter_path`) and `--lora-paths`.

An adapter is PEFT's `save_pretrained` output: `adapter_config.json` plus `adapter_model.safetensors`
(never `adapter_model.bin`: a pickle runs code when read). It may target q/k/v/o of attention and
gate/up/down of a dense MLP; PEFT features that change the forward pass beyond `scaling * B @ A x`
(DoRA, biases, modules_to_save, embedding or lm_head targets, ...) are refused, never dropped. Every
failure is a `LoraLoadError` naming the adapter and what is wrong.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import LoraLoadError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"
DEFAULT_MAX_RANK = 64


class Projection(enum.Enum):
    """A projection an adapter may target, by its HF module name (Tandem merges q/k/v and gate/up into
    `qkv_proj` and `gate_up_proj`; an adapter keeps one A/B pair per part)."""

    Q_PROJ = "q_proj"
    K_PROJ = "k_proj"
    V_PROJ = "v_proj"
    O_PROJ = "o_proj"
    GATE_PROJ = "gate_proj"
    UP_PROJ = "up_proj"
    DOWN_PROJ = "down_proj"

    @property
    def block(self) -> str:
        """The decoder layer's submodule holding it."""
        return "mlp" if self in (Projection.GATE_PROJ, Projection.UP_PROJ, Projection.DOWN_PROJ) else "self_attn"

    def shape(self, config: ModelConfig) -> tuple[int, int]:
        """(out_features, in_features) of this projection in `config`'s dense layers."""
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        hidden, inner = config.hidden_size, config.intermediate_size
        return {
            Projection.Q_PROJ: (q_size, hidden),
            Projection.K_PROJ: (kv_size, hidden),
            Projection.V_PROJ: (kv_size, hidden),
            Projection.O_PROJ: (hidden, q_size),
            Projection.GATE_PROJ: (inner, hidden),
            Projection.UP_PROJ: (inner, hidden),
            Projection.DOWN_PROJ: (hidden, inner),
        }[self]


_T = TypeVar("_T")
_PROJECTIONS = {p.value: p for p in Projection}
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")
# adapter_config.json keys whose PEFT feature changes the forward pass beyond `scaling * B @ A x`: set, refused
_UNSERVED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
    "layer_replication": "layer_replication",
    "use_qalora": "QA-LoRA (use_qalora)",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
}
_EMBEDDING_TARGETS = ("embed_tokens", "lm_head")


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One projection's low-rank update: W' = W + scaling * b @ a, so y = x W^T + scaling * (x a^T) b^T.
    `a` [rank, in_features] and `b` [out_features, rank] are float32 on the CPU, never mutated."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def delta(self) -> torch.Tensor:
        """The dense update `scaling * b @ a` [out_features, in_features] (the merged weight minus the base's)."""
        return self.scaling * (self.b @ self.a)


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """What `adapter_config.json` says that serving needs, checked. `rank_pattern`/`alpha_pattern` map
    PEFT's module-name regexes to a module's own rank/alpha, as `peft.utils.other.get_pattern_key` reads them."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # a list of module names, or one regex over full module names
    base_model_name_or_path: str | None
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    def rank_of(self, module: str) -> int:
        """The rank PEFT gave `module` (its full name, e.g. `model.layers.0.self_attn.q_proj`)."""
        return _by_pattern(self.rank_pattern, module, self.rank)

    def scaling_of(self, module: str) -> float:
        """alpha / sqrt(r) with rsLoRA, else alpha / r, with `module`'s own rank and alpha."""
        rank, alpha = self.rank_of(module), _by_pattern(self.alpha_pattern, module, self.alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _by_pattern(patterns: tuple[tuple[str, _T], ...], module: str, default: _T) -> _T:
    for pattern, value in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A PEFT LoRA adapter checked against one base `ModelConfig`: `weights[(layer, projection)]` for every
    projection it targets (layers and projections it leaves out are the base's own). Not mutated once loaded."""

    path: Path
    settings: LoraSettings
    weights: Mapping[tuple[int, Projection], LoraWeights]

    @property
    def rank(self) -> int:
        """The largest rank of its projections."""
        return max(w.rank for w in self.weights.values())

    @property
    def projections(self) -> frozenset[Projection]:
        return frozenset(projection for _, projection in self.weights)

    @property
    def num_bytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())

    @classmethod
    def load(cls, directory: Path, config: ModelConfig, max_rank: int = DEFAULT_MAX_RANK) -> LoraAdapter:
        """Read the PEFT adapter in `directory` for a base model of `config`, ranks at most `max_rank`.

        Headers and shapes are checked before any tensor is read; raises `LoraLoadError` on any problem."""
        if not directory.is_dir():
            raise LoraLoadError(f"LoRA adapter {directory} is not a directory")
        weights_path = directory / ADAPTER_WEIGHTS
        if not weights_path.is_file():
            if (directory / PICKLED_WEIGHTS).is_file():
                raise LoraLoadError(
                    f"LoRA adapter {directory} has only {PICKLED_WEIGHTS}, a pickle, which can run code when read: "
                    f"save it as {ADAPTER_WEIGHTS} (PEFT's save_pretrained(safe_serialization=True))"
                )
            raise LoraLoadError(f"LoRA adapter {directory} has no {ADAPTER_WEIGHTS}")
        settings = read_settings(directory / ADAPTER_CONFIG)
        pairs = _read_pairs(weights_path)
        _check_shapes(pairs, settings, config, max_rank, directory)
        return cls(directory, settings, _read_weights(weights_path, pairs, settings))


def read_settings(path: Path) -> LoraSettings:
    """The checked settings of a PEFT `adapter_config.json`; `LoraLoadError` for an unreadable file, a
    non-LoRA adapter, a feature Tandem does not serve, or embedding/lm_head targets."""
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise LoraLoadError(f"{path} does not hold a JSON object")
    if raw.get("peft_type") != "LORA":
        raise LoraLoadError(f"{path}: peft_type is {raw.get('peft_type')!r}, not 'LORA'")
    unserved = [what for key, what in _UNSERVED.items() if raw.get(key)]
    if raw.get("bias", "none") != "none":
        unserved.append(f"trained base biases (bias={raw['bias']!r})")
    if unserved:
        raise LoraLoadError(f"{path}: Tandem does not serve {', '.join(unserved)}")
    targets = raw.get("target_modules")
    target_modules = targets if isinstance(targets, str) else tuple(targets or ())
    named = [t for t in ((targets,) if isinstance(targets, str) else target_modules) if t in _EMBEDDING_TARGETS]
    if named:
        raise LoraLoadError(f"{path}: adapters on {', '.join(named)} are not served (only q/k/v/o/gate/up/down)")
    try:
        settings = LoraSettings(
            rank=_positive_int(raw.get("r"), "r"),
            alpha=float(raw.get("lora_alpha", 8)),
            use_rslora=bool(raw.get("use_rslora", False)),
            target_modules=target_modules,
            base_model_name_or_path=raw.get("base_model_name_or_path"),
            rank_pattern=tuple(
                (str(k), _positive_int(v, f"rank_pattern[{k!r}]")) for k, v in _items(raw, "rank_pattern")
            ),
            alpha_pattern=tuple((str(k), float(v)) for k, v in _items(raw, "alpha_pattern")),
        )
        for pattern, _ in (*settings.rank_pattern, *settings.alpha_pattern):
            re.compile(pattern)
    except (TypeError, ValueError, re.error) as exc:
        raise LoraLoadError(f"{path}: {exc}") from exc
    return settings


def _positive_int(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def _items(raw: Mapping[str, Any], key: str) -> Iterable[tuple[Any, Any]]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object, got {value!r}")
    return value.items()


# (layer, projection) -> {"A": (shape, stored name), "B": ...}
_Pairs = dict[tuple[int, Projection], dict[str, tuple[tuple[int, ...], str]]]


def _read_pairs(path: Path) -> _Pairs:
    """Every tensor's (layer, projection, A/B) and shape from the header; unknown names are refused."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as exc:  # safetensors raises its own untyped errors for corrupt headers
        raise LoraLoadError(f"cannot read the safetensors header of {path}: {exc}") from exc
    pairs: _Pairs = {}
    unknown = []
    for name, shape in shapes.items():
        match = _TENSOR.fullmatch(name)
        projection = _PROJECTIONS.get(match.group(3)) if match else None
        if match is None or projection is None or projection.block != match.group(2):
            unknown.append(name)
            continue
        pairs.setdefault((int(match.group(1)), projection), {})[match.group(4)] = (shape, name)
    if unknown:
        embedding = any(target in name for name in unknown for target in _EMBEDDING_TARGETS)
        hint = "embedding and lm_head adapters are not served; " if embedding else ""
        raise LoraLoadError(
            f"{path}: {hint}tensors Tandem cannot place (it serves LoRA on q/k/v/o_proj and gate/up/down_proj "
            f"of the decoder layers): {_preview(sorted(unknown))}"
        )
    if not pairs:
        raise LoraLoadError(f"{path} holds no LoRA tensors")
    return pairs


def _check_shapes(pairs: _Pairs, settings: LoraSettings, config: ModelConfig, max_rank: int, where: Path) -> None:
    """Raise `LoraLoadError` naming every projection whose tensors do not fit `config` or the rank limit."""
    problems = []
    extra_layers = sorted({layer for layer, _ in pairs if layer >= config.num_layers})
    if extra_layers:
        problems.append(f"it has layers {extra_layers} but the base model has {config.num_layers} layers")
    for (layer, projection), found in sorted(pairs.items(), key=lambda item: (item[0][0], item[0][1].value)):
        module = _module_name(layer, projection)
        if layer >= config.num_layers:
            continue
        if projection.block == "mlp" and config.is_moe_layer(layer):
            problems.append(f"{module}: layer {layer} of the base model has experts, not a dense MLP")
            continue
        if set(found) != {"A", "B"}:
            problems.append(f"{module}: lora_{'B' if 'A' in found else 'A'} is missing")
            continue
        rank = settings.rank_of(module)
        out_features, in_features = projection.shape(config)
        for part, expected in (("A", (rank, in_features)), ("B", (out_features, rank))):
            shape = found[part][0]
            if shape != expected:
                problems.append(f"{module}.lora_{part} is {list(shape)}, expected {list(expected)}")
        if rank > max_rank:
            problems.append(f"{module}: rank {rank} is over the limit of {max_rank}")
    if problems:
        base = (
            f"{config.architecture} (hidden {config.hidden_size}, {config.num_layers} layers, "
            f"{config.num_heads} heads of {config.head_dim}, {config.num_kv_heads} KV heads, "
            f"intermediate {config.intermediate_size})"
        )
        made_for = f" (made for {settings.base_model_name_or_path})" if settings.base_model_name_or_path else ""
        raise LoraLoadError(f"LoRA adapter {where}{made_for} does not fit the served {base}: {_preview(problems)}")


def _read_weights(path: Path, pairs: _Pairs, settings: LoraSettings) -> dict[tuple[int, Projection], LoraWeights]:
    weights = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for (layer, projection), found in sorted(pairs.items(), key=lambda item: (item[0][0], item[0][1].value)):
                a, b = (handle.get_tensor(found[part][1]).to(torch.float32).contiguous() for part in ("A", "B"))
                module = _module_name(layer, projection)
                if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                    raise LoraLoadError(f"{path}: {module} holds non-finite values")
                weights[(layer, projection)] = LoraWeights(a, b, settings.scaling_of(module))
    except LoraLoadError:
        raise
    except Exception as exc:  # a truncated file fails only when its data is read
        raise LoraLoadError(f"cannot read the tensors of {path}: {exc}") from exc
    return weights


def _module_name(layer: int, projection: Projection) -> str:
    """PEFT's key for rank/alpha patterns: the module's full name in the HF model."""
    return f"model.layers.{layer}.{projection.block}.{projection.value}"


def resolve_adapter_path(lora_dir: Path | None, path_or_name: str) -> Path:
    """The real directory of an adapter named at run time: `path_or_name` relative to `lora_dir` (or an
    absolute path), symlinks resolved, which must lie inside `lora_dir`. `lora_dir` None: loading at run
    time is off. Raises `LoraLoadError` for an escape (`..`, a symlink or an absolute path outside) or a
    missing directory."""
    if lora_dir is None:
        raise LoraLoadError("loading LoRA adapters at run time is off: start the server with --lora-dir")
    if not path_or_name or "\x00" in path_or_name:
        raise LoraLoadError(f"invalid LoRA adapter path {path_or_name!r}")
    root = lora_dir.resolve()
    if not root.is_dir():
        raise LoraLoadError(f"--lora-dir {lora_dir} is not a directory")
    resolved = (root / path_or_name).resolve()  # an absolute path_or_name replaces root here
    if resolved == root or not resolved.is_relative_to(root):
        raise LoraLoadError(f"LoRA adapter path {path_or_name!r} is outside --lora-dir {lora_dir}")
    if not resolved.is_dir():
        raise LoraLoadError(f"no LoRA adapter directory {path_or_name!r} in --lora-dir {lora_dir}")
    return resolved


def _preview(items: list[str], limit: int = 4) -> str:
    shown = "; ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} (+{len(items) - limit} more)"
