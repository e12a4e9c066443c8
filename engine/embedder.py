"""Embedder: token id lists -> pooled sentence vectors, for prefill workers started with --is-embedding.

Two kinds of model are served:

- a BERT encoder (`engine/bert.py`, HF `BertModel` directory): bidirectional attention over a
  right-padded batch; pooling from the directory's sentence-transformers files (mean for
  all-MiniLM-L6-v2); or a BERT cross-encoder (`BertForSequenceClassification`), whose "embedding"
  is its [CLS] row's `num_labels` logits, fed a pair's token types;
- a Llama/Qwen2 decoder (`engine/model.py` `CausalLM`, any checkpoint `open_checkpoint` reads):
  causal attention, pooling `last` unless a sentence-transformers `modules.json` says otherwise
  (gte-Qwen2 style). Its lm_head is loaded but unused;
- a sequence-classification (reward) model, HF `LlamaForSequenceClassification` /
  `Qwen2ForSequenceClassification`: the decoder's `score` head applied to every token, then the last
  token's scores taken, unnormalized, as HF does. Its "embedding" is the `num_labels` scores.

No KV is kept between calls: a batch is one full forward pass. The decoder's attention backend
writes K/V into pages, so each batch gets a scratch page pool sized for it and dropped after it.
The model and each batch live on `EngineConfig.device`; the vectors come back in host memory.
An `Embedder` is single-threaded: callers must never run two of its calls at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.bert import ARCHITECTURE as BERT_ARCHITECTURE
from engine.bert import CLASSIFIER_ARCHITECTURE as BERT_CLASSIFIER_ARCHITECTURE
from engine.bert import BertModel
from engine.config import EngineConfig
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.forward_batch import paged_forward_batch
from engine.model_setup import attention_backend, load_causal_lm, materialize, rotary_embedding, torch_dtype
from engine.models.layers import CausalLM
from engine.page_allocator import pages_needed
from engine.pooling import PoolingConfig, PoolingMode, pool, read_pooling_config, truncate
from engine.weights import open_checkpoint
from engine.weights.bert_checkpoint import is_bert_dir, open_bert_checkpoint, read_hf_config

_SCRATCH_PAGE_SIZE = 16


@dataclass(frozen=True, slots=True)
class EmbeddingModelInfo:
    """What a client may ask of the model. `matryoshka_dimensions` empty with `is_matryoshka`
    means any size from 1 to `embedding_dim`."""

    architecture: str
    context_len: int
    vocab_size: int
    embedding_dim: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    is_classifier: bool = False  # the vectors are a sequence classifier's `embedding_dim` logits
    num_token_types: int = 1  # segment ids an input may carry (2 for a BERT pair)

    def check_dimensions(self, dimensions: int | None) -> None:
        """Raise `InvalidRequestError` unless `dimensions` (None = full size) is a size this model serves."""
        if dimensions is None or dimensions == self.embedding_dim:
            return
        if not self.is_matryoshka:
            raise InvalidRequestError(
                f"this model does not support `dimensions` other than its full size {self.embedding_dim}: "
                "it declares no Matryoshka training, so truncated vectors would lose quality"
            )
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise InvalidRequestError(
                f"`dimensions` must be one of {sorted(self.matryoshka_dimensions)} or "
                f"{self.embedding_dim} for this model, got {dimensions}"
            )
        if not 1 <= dimensions <= self.embedding_dim:
            raise InvalidRequestError(f"`dimensions` must be between 1 and {self.embedding_dim}, got {dimensions}")


class Encoder(Protocol):
    def hidden_states(
        self, token_lists: Sequence[Sequence[int]], token_type_lists: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """Last hidden states of every token, packed: [sum of lengths, hidden] (a classifier's: [.., num_labels]).
        `token_type_lists`: each input's segment ids, as long as its tokens (None: all 0)."""
        ...


class PaddedBert:
    """Runs `BertModel` on a right-padded batch and packs the real rows."""

    def __init__(self, model: BertModel) -> None:
        self.model = model

    def hidden_states(
        self, token_lists: Sequence[Sequence[int]], token_type_lists: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        longest = max(len(t) for t in token_lists)
        input_ids = self._padded(token_lists, longest)
        token_type_ids = None if token_type_lists is None else self._padded(token_type_lists, longest)
        lens = torch.tensor([len(t) for t in token_lists], device=self.device)
        mask = torch.arange(longest, device=self.device).unsqueeze(0) < lens.unsqueeze(1)
        return self.model(input_ids, mask, token_type_ids)[mask]

    def _padded(self, lists: Sequence[Sequence[int]], longest: int) -> torch.Tensor:
        padded = [list(values) + [0] * (longest - len(values)) for values in lists]
        return torch.tensor(padded, dtype=torch.int64, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.model.word_embeddings.weight.device


class ScratchDecoder:
    """Runs `CausalLM`'s decoder over whole sequences, its K/V written to a throwaway page pool."""

    def __init__(
        self,
        model: CausalLM,
        context_len: int,
        engine_config: EngineConfig,
        dtype: torch.dtype,
        apply_head: bool = False,
    ) -> None:
        mc = model.config
        self.model = model
        self.dtype = dtype
        self.apply_head = apply_head  # return each token's head output (a classifier's scores) instead
        self.device = torch.device(engine_config.device)
        self.rotary = rotary_embedding(mc, context_len, dtype, self.device)
        self.attention = attention_backend(engine_config.attention_backend, mc, _SCRATCH_PAGE_SIZE, dtype, self.device)

    def hidden_states(
        self, token_lists: Sequence[Sequence[int]], token_type_lists: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """`token_type_lists` is ignored: a decoder has no segments (`Embedder` allows only type 0 for it)."""
        mc, size = self.model.config, _SCRATCH_PAGE_SIZE
        num_pages = [pages_needed(len(tokens), size) for tokens in token_lists]
        first = accumulate(num_pages[:-1], initial=0)
        pages = [range(f, f + n) for f, n in zip(first, num_pages)]  # each sequence's own run of scratch pages
        host = paged_forward_batch(token_lists, [0] * len(token_lists), pages, size)
        self.attention.plan(host.meta)
        batch = host.to(self.device)
        scratch = torch.empty(
            sum(num_pages), mc.num_layers, 2, size, mc.num_kv_heads, mc.head_dim, dtype=self.dtype, device=self.device
        )
        hidden = self.model(batch, self.rotary, self.attention, scratch)
        return self.model.compute_logits(hidden) if self.apply_head else hidden


class Embedder:
    """Embeds batches of token lists; batches larger than `max_batch_tokens` (padded) run in pieces."""

    def __init__(
        self, encoder: Encoder, pooling: PoolingConfig, info: EmbeddingModelInfo, max_batch_tokens: int
    ) -> None:
        self.encoder = encoder
        self.pooling = pooling
        self.info = info
        self.max_batch_tokens = max_batch_tokens

    @torch.inference_mode()
    def embed(
        self,
        token_lists: Sequence[Sequence[int]],
        dimensions: int | None = None,
        token_type_lists: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """[len(token_lists), dimensions or embedding_dim] float32, rows in input order.

        `token_type_lists`: each input's segment ids (a BERT cross-encoder's pair: 0s then 1s), as
        long as its tokens; None: every token is segment 0.

        Raises `InvalidRequestError` (no inputs, an empty input, a token outside the vocabulary, a
        size the model does not serve, token types the model has not) or `ContextLengthExceededError`
        before computing anything.
        """
        self.check(token_lists, dimensions)
        self._check_token_types(token_lists, token_type_lists)
        order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
        vectors = torch.empty(len(token_lists), self.info.embedding_dim, dtype=torch.float32)
        for rows in self._pieces(order, token_lists):
            batch = [token_lists[i] for i in rows]
            types = None if token_type_lists is None else [token_type_lists[i] for i in rows]
            hidden = self.encoder.hidden_states(batch, types)
            vectors[rows] = pool(hidden, [len(t) for t in batch], self.pooling).cpu()
        if dimensions is not None and dimensions != self.info.embedding_dim:
            vectors = truncate(vectors, dimensions, self.pooling.normalize)
        return vectors

    def check(self, token_lists: Sequence[Sequence[int]], dimensions: int | None) -> None:
        if not token_lists:
            raise InvalidRequestError("no inputs to embed")
        for i, tokens in enumerate(token_lists):
            if not tokens:
                raise InvalidRequestError(f"input {i} has no tokens")
            if len(tokens) > self.info.context_len:
                raise ContextLengthExceededError(
                    f"input {i} has {len(tokens)} tokens; the model's maximum is {self.info.context_len}"
                )
            bad = next((t for t in tokens if not 0 <= t < self.info.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"input {i}: token id {bad} is outside [0, {self.info.vocab_size})")
        self.info.check_dimensions(dimensions)

    def _check_token_types(
        self, token_lists: Sequence[Sequence[int]], token_type_lists: Sequence[Sequence[int]] | None
    ) -> None:
        if token_type_lists is None:
            return
        if len(token_type_lists) != len(token_lists):
            raise InvalidRequestError(f"{len(token_type_lists)} token type lists for {len(token_lists)} inputs")
        for i, (tokens, types) in enumerate(zip(token_lists, token_type_lists)):
            if len(types) != len(tokens):
                raise InvalidRequestError(f"input {i}: {len(types)} token types for {len(tokens)} tokens")
            bad = next((t for t in types if not 0 <= t < self.info.num_token_types), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"input {i}: token type {bad} is outside [0, {self.info.num_token_types}) for this model"
                )

    def _pieces(self, order: list[int], token_lists: Sequence[Sequence[int]]) -> list[list[int]]:
        """Split `order` (ascending length) so each piece's padded size stays within max_batch_tokens."""
        pieces: list[list[int]] = [[]]
        for i in order:
            if pieces[-1] and (len(pieces[-1]) + 1) * len(token_lists[i]) > self.max_batch_tokens:
                pieces.append([])
            pieces[-1].append(i)
        return pieces


def load_embedder(model_path: str, config: EngineConfig, progress: bool = True) -> Embedder:
    """Load a BERT directory or a decoder checkpoint for embedding, in `config.dtype`, on `config.device`.

    `config.max_prefill_tokens` bounds one forward pass; `config.context_len` may shrink the model's.
    """
    dtype = torch_dtype(config.dtype)
    num_token_types = 1
    if is_bert_dir(model_path):
        checkpoint = open_bert_checkpoint(model_path)
        bert = materialize(lambda: BertModel(checkpoint.config), dtype, config.device).eval()
        bert.load_weights(checkpoint.tensors(progress=progress))
        encoder: Encoder = PaddedBert(bert)
        bc = checkpoint.config
        is_classifier, num_token_types = bc.num_labels > 0, bc.type_vocab_size
        mc_max, vocab = bc.max_position_embeddings, bc.vocab_size
        hidden = bc.num_labels or bc.hidden_size
        arch = BERT_CLASSIFIER_ARCHITECTURE if is_classifier else BERT_ARCHITECTURE
        default_mode = PoolingMode.CLS
    else:
        decoder_checkpoint = open_checkpoint(model_path)
        mc = decoder_checkpoint.config
        model = load_causal_lm(decoder_checkpoint, dtype, config.device, progress=progress)
        is_classifier = mc.num_labels > 0
        mc_max, vocab, arch = mc.max_position_embeddings, mc.vocab_size, mc.architecture
        hidden = mc.num_labels if is_classifier else mc.hidden_size
        encoder = ScratchDecoder(
            model, min(config.context_len or mc_max, mc_max), config, dtype, apply_head=is_classifier
        )
        default_mode = PoolingMode.LAST
    if is_classifier:  # the scores are the model's own output: [CLS]'s or the last token's, never normalized or cut
        pooling, matryoshka = PoolingConfig(default_mode, normalize=False), None
    else:
        pooling, matryoshka = read_pooling_config(model_path, default_mode), _matryoshka(model_path)
    info = EmbeddingModelInfo(
        architecture=arch,
        context_len=min(config.context_len or mc_max, mc_max),
        vocab_size=vocab,
        embedding_dim=hidden,
        is_matryoshka=matryoshka is not None,
        matryoshka_dimensions=matryoshka or (),
        is_classifier=is_classifier,
        num_token_types=num_token_types,
    )
    return Embedder(encoder, pooling, info, config.max_prefill_tokens)


def _matryoshka(model_path: str) -> tuple[int, ...] | None:
    """The sizes config.json declares (`matryoshka_dimensions`, or `is_matryoshka` for any); None if none."""
    directory = Path(model_path)
    if not (directory / "config.json").is_file():
        return None
    raw: dict[str, Any] = read_hf_config(directory)
    sizes = raw.get("matryoshka_dimensions")
    if isinstance(sizes, list) and sizes:
        return tuple(int(s) for s in sizes)
    return () if raw.get("is_matryoshka") else None
