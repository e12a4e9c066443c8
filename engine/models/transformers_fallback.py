"""Any HF `*ForCausalLM` that transformers ships and no family file serves, run by transformers' own
modeling code over Tandem's paged KV pool.

The HF model runs as one sequence of batch 1 holding every new token of the step (`input_ids[None]`,
`position_ids=positions[None]`), with no HF cache and no HF mask: its attention layers call
`tandem_attention` (registered as transformers' attention implementation "tandem"), which writes the
new tokens' rotated K/V into the pool at the step's (write_pages, write_offsets) and attends through the
engine's backend with the step's page table. The pool's layout is the one the family files use, so a
prefill worker's pages hand off to a decode worker as for any other model. Per-step data (backend, pool,
metadata) travel in the forward's keyword arguments, which transformers passes down to the attention
function.

Parameter names are the HF checkpoint's: the wrapper registers the HF model's own children as its own.
Float weights only (a quantized engine is refused at load), no fused C++ layers, no Tandem rotary tables
(transformers computes rotary itself).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from engine.config import ConfigError, ModelConfig
from engine.forward_batch import ForwardBatch
from engine.models.config_readers import config_from_hf
from engine.models.family import ModelFamily
from engine.weight_loader import load_into
from kernels.attention import AttentionBackend, AttentionMetadata, torch_paged_attention
from kernels.layers import RotaryEmbedding
from kernels.packing import PackedWeight
from kernels.quant import QuantizedWeight

if TYPE_CHECKING:
    from engine.models.layers import CausalLM

logger = logging.getLogger(__name__)

ATTENTION = "tandem"  # the name the attention function is registered under in transformers
_STEP = "tandem_step"  # the keyword argument carrying `TandemStep` down to `tandem_attention`
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_UNSUPPORTED_KWARGS = ("softcap", "s_aux")  # attention arguments the engine's backends cannot honour


def causal_lm_class(architecture: str) -> type[transformers.PreTrainedModel] | None:
    """The `*ForCausalLM` class transformers ships under the name `architecture`, or None."""
    if not architecture.endswith("ForCausalLM"):
        return None
    try:
        cls = getattr(transformers, architecture)
    except (AttributeError, ImportError):  # unknown name, or a class whose extra dependency is missing
        return None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None


@dataclass(frozen=True, slots=True)
class TransformersModelConfig(ModelConfig):
    """A `ModelConfig` that also holds the checkpoint's `config.json` (as JSON text: frozen and
    hashable), from which every build makes the HF config afresh."""

    hf_config_json: str = "{}"


@dataclass(frozen=True, slots=True)
class TandemStep:
    """What `tandem_attention` needs of one forward pass: the backend, the whole KV pool
    [P, L, 2, S, Hkv, D] (written) and the step's metadata on the pool's device."""

    backend: AttentionBackend
    kv_pool: torch.Tensor
    meta: AttentionMetadata


@dataclass(frozen=True, slots=True)
class _ArgumentProbe:
    """Stands in for `TandemStep` in the one-token forward `load_weights` ends with: each attention call
    checks the arguments its layer passes and computes nothing."""


def tandem_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, Hq, T, D], key/value [1, Hkv, T, D], already
    rotated, for the step's new tokens; returns ([1, T, Hq, D], None). Writes key and value into layer
    `module.layer_idx` of the step's pool, then attends causally over each sequence's pages, with HF's
    `scaling` and, on a sliding-window layer, the last `sliding_window` positions only."""
    step: TandemStep | _ArgumentProbe | None = kwargs.get(_STEP)
    if step is None:
        raise RuntimeError("the tandem attention runs inside TransformersCausalLM.forward only")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{type(module).__name__} passes {name!r}, which Tandem's attention cannot apply")
    if isinstance(step, _ArgumentProbe):
        return torch.zeros_like(query.transpose(1, 2)), None
    meta, backend = step.meta, step.backend
    layer_idx = cast(int, module.layer_idx)
    cache = step.kv_pool[:, layer_idx]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    if k.shape[1:] != cache.shape[-2:]:
        raise RuntimeError(f"layer {layer_idx}'s K/V heads {tuple(k.shape[1:])} do not fit the KV pool's")
    cache[meta.write_pages, 0, meta.write_offsets] = k.to(cache.dtype)
    cache[meta.write_pages, 1, meta.write_offsets] = v.to(cache.dtype)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    if scaling is not None and not math.isclose(scaling, backend.scale):
        q = q * (scaling / backend.scale)  # the backends scale by head_dim ** -0.5; another scale is folded into q
    if sliding_window is None or max(meta.seq_lens) <= sliding_window:
        out = backend.attend(q, cache, meta)
    elif sliding_window == backend.sliding_window:  # the window the backend planned for (FlashInfer's)
        out = backend.attend(q, cache, meta, sliding_window)
    else:
        out = torch_paged_attention(q, cache, meta, backend.page_size, backend.scale, sliding_window)
    return out.unsqueeze(0), None


transformers.AttentionInterface.register(ATTENTION, tandem_attention)


class _GivenHidden(nn.Module):
    """Stands in for the decoder in `TransformersCausalLM`'s head view: returns the rows it is given."""

    def forward(self, *args: Any, inputs_embeds: torch.Tensor, **kwargs: Any) -> BaseModelOutputWithPast:
        return BaseModelOutputWithPast(last_hidden_state=inputs_embeds)


class TransformersCausalLM(nn.Module):
    """An HF `*ForCausalLM` behind `CausalLM`'s interface (forward, compute_logits, fuse_layers,
    load_weights, config). Its children are the HF model's, so parameter names are the checkpoint's."""

    _hf: transformers.PreTrainedModel
    _head: transformers.PreTrainedModel

    def __init__(self, config: TransformersModelConfig) -> None:
        super().__init__()
        self.config = config
        hf = _build_hf_model(config)
        for name, child in hf.named_children():
            self.add_module(name, child)
        # kept out of `_modules` (its children are registered above): the HF forward paths to call
        object.__setattr__(self, "_hf", hf)
        head = copy.copy(hf)  # the HF ForCausalLM forward over given hidden rows: any logit scaling it applies
        head._modules = {**hf._modules, hf.base_model_prefix: _GivenHidden()}
        object.__setattr__(self, "_head", head)
        # transformers computes these buffers (rotary inv_freq) at init; materializing on another device
        # leaves them uninitialized, and casting the model would round them: `load_weights` rebuilds them
        self._computed_buffers = {name: buf.dtype for name, buf in hf.named_non_persistent_buffers()}
        fixed = [name for name, dtype in self._computed_buffers.items() if not dtype.is_floating_point]
        if fixed:
            raise ConfigError(f"{config.architecture} computes non-float buffers {fixed}, which Tandem cannot rebuild")

    def forward(
        self, batch: ForwardBatch, rotary: RotaryEmbedding, backend: AttentionBackend, kv_pool: torch.Tensor
    ) -> torch.Tensor:
        """The final hidden states [T, hidden] of `batch`'s T new tokens; their K/V are written into
        `kv_pool` [P, num_layers, 2, S, Hkv, D]. `rotary` is unused (transformers rotates), as is
        `batch.expert_counts`."""
        out = self._hf.base_model(
            input_ids=batch.input_ids.unsqueeze(0),
            position_ids=batch.positions.unsqueeze(0),
            use_cache=False,
            **{_STEP: TandemStep(backend, kv_pool, batch.meta)},
        )
        hidden: torch.Tensor = out.last_hidden_state[0]
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of hidden rows [N, hidden], as the architecture's ForCausalLM computes them."""
        logits: torch.Tensor = self._head(inputs_embeds=hidden.unsqueeze(0), use_cache=False).logits[0]
        return logits.float()

    def fuse_layers(self, backend: AttentionBackend, kv_dtype: torch.dtype) -> int:
        """No layer of an HF model runs as one C++ call."""
        return 0

    def load_weights(
        self,
        tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight | PackedWeight]],
        quantization: str = "none",
        int8_activations: bool = False,
    ) -> None:
        """Copy HF-named float tensors into the parameters (every one covered exactly) and recompute the
        buffers transformers derives from the config. ConfigError for a quantized engine or tensor."""
        if quantization not in ("none", "gguf") or int8_activations:
            raise ConfigError(
                f"{self.config.architecture} runs on transformers' modeling code, which takes float weights only "
                f"(quantization none), not quantization {quantization!r}"
                + (" with int8 activations" if int8_activations else "")
            )
        self._recompute_buffers()
        load_into(self, ((name, _float(name, value, self.config.architecture)) for name, value in tensors), "none")
        self._check_attention_arguments()

    def _check_attention_arguments(self) -> None:
        """One token through the HF decoder with `_ArgumentProbe` for a step, so that a layer passing an
        argument the backends cannot apply (attention sinks, logit soft-capping) is refused at start-up
        with a ConfigError, not at the first request."""
        token = torch.zeros(1, 1, dtype=torch.long, device=next(self.parameters()).device)
        try:
            with torch.no_grad():
                self._hf.base_model(input_ids=token, position_ids=token, use_cache=False, **{_STEP: _ArgumentProbe()})
        except NotImplementedError as exc:
            raise ConfigError(f"{self.config.architecture} cannot run on Tandem's paged attention: {exc}") from exc

    def _recompute_buffers(self) -> None:
        """Each computed buffer afresh, in the dtype transformers made it in, by the HF model's own
        `_init_weights` of its module (which knows rotary's); ConfigError for one it leaves unset."""
        hf, fresh = self._hf, {}
        for name, dtype in self._computed_buffers.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = hf.get_submodule(owner_name)
            old = owner.get_buffer(leaf)
            fresh[name] = owner._buffers[leaf] = torch.full(old.shape, math.nan, dtype=dtype, device=old.device)
        with torch.no_grad():
            for owner_name in sorted({name.rpartition(".")[0] for name in fresh}):
                hf._init_weights(hf.get_submodule(owner_name))
        unset = [name for name, buffer in fresh.items() if bool(buffer.isnan().any())]
        if unset:
            raise ConfigError(f"{self.config.architecture}: transformers does not recompute the buffers {unset}")


def _float(name: str, value: torch.Tensor | QuantizedWeight | PackedWeight, architecture: str) -> torch.Tensor:
    if isinstance(value, (QuantizedWeight, PackedWeight)):
        raise ConfigError(f"{name}: {architecture} runs on transformers' modeling code, which takes float weights only")
    return value


def _hf_config(config: Mapping[str, Any]) -> tuple[type[transformers.PreTrainedModel], transformers.PretrainedConfig]:
    """The HF class `config` names and its HF config (defaults filled in); ConfigError when transformers
    cannot run it over the paged KV pool."""
    architecture = str(config["architectures"][0])
    cls = causal_lm_class(architecture)
    if cls is None:
        raise ConfigError(f"transformers has no *ForCausalLM class {architecture!r}")
    config_class = cls.config_class
    if config_class is None:
        raise ConfigError(f"transformers' {architecture} names no config class")
    model_type = config.get("model_type", config_class.model_type)
    if model_type != config_class.model_type:
        raise ConfigError(f"model_type {model_type!r} is not {architecture}'s ({config_class.model_type!r})")
    if not getattr(cls, "_supports_attention_backend", False):
        raise ConfigError(f"{architecture} does not take transformers' attention functions, so not Tandem's paged KV")
    hf_config = config_class.from_dict(dict(config))
    layer_types = set(getattr(hf_config, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES
    if layer_types:
        raise ConfigError(f"{architecture} has layers that are not full or sliding attention: {sorted(layer_types)}")
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise ConfigError(f"{architecture} with attn_logit_softcapping is not supported")
    return cls, hf_config


def _build_hf_model(config: TransformersModelConfig) -> transformers.PreTrainedModel:
    cls, hf_config = _hf_config(json.loads(config.hf_config_json))
    hf_config._attn_implementation = ATTENTION
    hf = cls(hf_config).train(False)
    if hf.base_model is hf or hf._parameters or hf._buffers:
        raise ConfigError(f"{config.architecture}'s layout has no separate decoder module; it cannot run in Tandem")
    if config.tie_word_embeddings and not (
        isinstance(getattr(hf, "lm_head", None), nn.Linear) and hasattr(getattr(hf, "model", None), "embed_tokens")
    ):
        raise ConfigError(f"{config.architecture} ties its embeddings without model.embed_tokens and lm_head")
    return hf


def _from_hf(config: Mapping[str, Any]) -> TransformersModelConfig:
    cls, hf_config = _hf_config(config)
    architecture = str(config["architectures"][0])
    common = {**hf_config.to_dict(), "architectures": [architecture]}
    try:
        # transformers computes rotary and windows itself: the Tandem fields for them stay at their defaults
        base = config_from_hf(common, rope_scaling=())
    except KeyError as exc:
        raise ConfigError(f"{architecture}'s config lacks {exc.args[0]!r}, which Tandem needs for the KV pool") from exc
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and bool(cls._tied_weights_keys)
    logger.info(
        "%s has no Tandem family file: transformers' modeling code runs it over the paged KV pool", architecture
    )
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    if "sliding_attention" in (getattr(hf_config, "layer_types", None) or ()):
        # the window HF's sliding layers pass to the attention function, for the backend to plan with
        fields["features"] = dataclasses.replace(base.features, sliding_window=int(hf_config.sliding_window))
    return TransformersModelConfig(**{**fields, "tie_word_embeddings": tied}, hf_config_json=json.dumps(dict(config)))


def _build(config: ModelConfig) -> CausalLM:
    if not isinstance(config, TransformersModelConfig):
        raise ConfigError(f"{config.architecture} was not read by the transformers fallback")
    # the interface `CausalLM` states (forward, compute_logits, fuse_layers, load_weights, config)
    return cast("CausalLM", TransformersCausalLM(config))


FAMILY = ModelFamily(name="transformers", config_from_hf=_from_hf, build=_build)
