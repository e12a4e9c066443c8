"""BERT encoder (HF `BertModel`) as plain nn.Modules with HF parameter names.

The attribute names mirror transformers' `BertModel.state_dict()` (`embeddings.word_embeddings`,
`encoder.layer.{i}.attention.self.query`, ...), so a safetensors file saved from `BertModel`
loads with no renaming. A bare encoder has no pooler head: sentence embeddings pool the last hidden
states instead (`engine/pooling.py`). `BertForSequenceClassification` (a cross-encoder) keeps HF's
`bert.` prefix, its pooler (dense + tanh over [CLS]) and its `classifier`. Only absolute position
embeddings are supported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ConfigError
from engine.models.registry import on_meta

ARCHITECTURE = "BertModel"
CLASSIFIER_ARCHITECTURE = "BertForSequenceClassification"
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True, slots=True)
class BertConfig:
    """Shape and numerics of a BERT encoder, read from an HF `config.json`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str = "gelu"
    num_labels: int = 0  # 0: a bare encoder; else a sequence classifier with this many outputs

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.num_labels < 0:
            raise ConfigError(f"num_labels must not be negative, got {self.num_labels}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"unsupported hidden_act {self.hidden_act!r}; supported: {sorted(_ACTIVATIONS)}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> BertConfig:
        kind = config.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ConfigError(f"unsupported position_embedding_type {kind!r}; only 'absolute' is")
        try:
            return cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=int(config["hidden_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=int(config["num_attention_heads"]),
                intermediate_size=int(config["intermediate_size"]),
                max_position_embeddings=int(config.get("max_position_embeddings", 512)),
                type_vocab_size=int(config.get("type_vocab_size", 2)),
                layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
                hidden_act=str(config.get("hidden_act", "gelu")),
                num_labels=_num_labels(config),
            )
        except KeyError as exc:
            raise ConfigError(f"BERT config lacks required field {exc.args[0]!r}") from None


def _num_labels(config: Mapping[str, Any]) -> int:
    """A classifier's outputs as HF counts them (`id2label`, else `num_labels`, else 2); 0 for an encoder."""
    if (config.get("architectures") or [None])[0] != CLASSIFIER_ARCHITECTURE:
        return 0
    labels = config.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else int(config.get("num_labels", 2))


def is_bert_config(config: Mapping[str, Any]) -> bool:
    """True for an HF config that describes a bare BERT encoder or a BERT sequence classifier."""
    return (config.get("architectures") or [None])[0] in (ARCHITECTURE, CLASSIFIER_ARCHITECTURE)


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, L] -> [B, L, H]; positions start at 0. `token_type_ids` [B, L] int64 (a
        pair's segments, 0 then 1); None: every token is segment 0."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, H], key_mask [B, 1, 1, L] (True = a real token) -> [B, L, H]."""
        batch, length, hidden = x.shape
        q, k, v = (
            proj(x).view(batch, length, self.num_heads, -1).transpose(1, 2)
            for proj in (self.query, self.key, self.value)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return out.transpose(1, 2).reshape(batch, length, hidden)


class DenseLayerNorm(nn.Module):
    """`LayerNorm(dense(x) + residual)`: BERT's attention output and layer output blocks."""

    def __init__(self, in_size: int, out_size: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, out_size)
        self.LayerNorm = nn.LayerNorm(out_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = DenseLayerNorm(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, key_mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = DenseLayerNorm(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, key_mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class BertModel(nn.Module):
    """`forward` maps right-padded token ids to the last hidden states; padding never leaks into real rows.

    With `config.num_labels` it is HF's `BertForSequenceClassification` instead: the encoder under
    `bert` (with its pooler) and `classifier`, and `forward` returns every row's classifier output
    [B, L, num_labels], of which row 0 ([CLS]) is the sequence's (HF's logits).
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        if config.num_labels:
            self.bert = _BertEncoderWithPooler(config)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        else:
            self.embeddings = BertEmbeddings(config)
            self.encoder = BertEncoder(config)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [B, L] int64, attention_mask [B, L] bool (True = real token), token_type_ids
        [B, L] int64 or None -> [B, L, H] (a classifier's: [B, L, num_labels]).

        Rows of padded positions hold unspecified values; callers pool over real tokens only.
        """
        if self.config.num_labels:
            return self.classifier(self.bert.pooler(self.bert(input_ids, attention_mask, token_type_ids)))
        return _encode(self.embeddings, self.encoder, input_ids, attention_mask, token_type_ids)

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.bert.embeddings.word_embeddings if self.config.num_labels else self.embeddings.word_embeddings

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; every parameter must be covered exactly once."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in tensors:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(params[name].shape)}"
                )
            with torch.no_grad():
                params[name].copy_(tensor)
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


class _BertEncoderWithPooler(nn.Module):
    """HF's `BertModel` inside a classifier (`bert.`): the encoder plus the pooler's dense layer."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        return _encode(self.embeddings, self.encoder, input_ids, attention_mask, token_type_ids)


def _encode(
    embeddings: BertEmbeddings,
    encoder: BertEncoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    token_type_ids: torch.Tensor | None,
) -> torch.Tensor:
    key_mask = attention_mask[:, None, None, :]
    x = embeddings(input_ids, token_type_ids)
    for layer in encoder.layer:
        x = layer(x, key_mask)
    return x


def expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape for every parameter of `config` (no tensor is allocated)."""
    with on_meta():
        model = BertModel(config)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}
