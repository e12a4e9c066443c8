"""Random GGUF blocks for tests: every bit of a block random but its float16 scales, which are set to
sane magnitudes (weights of about +-0.1), so that every code and sub-scale bit pattern is exercised
and a model made of them computes finite numbers. Also a GGUF file of a tiny HF model whose chosen
matrices are such random blocks, for the block types gguf-py cannot quantize to."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGML
from gguf.quants import dequantize as gguf_dequantize
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engine.weights.gguf_blocks import to_quantized
from kernels.quant import QuantFormat, QuantizedWeight
from tests import tiny_models

# (byte offset in the block, largest magnitude, is signed) of each float16 scale of a block type
_SCALES: dict[GGML, tuple[tuple[int, float, bool], ...]] = {
    GGML.Q8_0: ((0, 1e-3, False),),
    GGML.Q4_0: ((0, 0.02, False),),
    GGML.Q4_1: ((0, 0.01, False), (2, 0.1, True)),
    GGML.Q5_0: ((0, 0.01, False),),
    GGML.Q5_1: ((0, 5e-3, False), (2, 0.1, True)),
    GGML.Q4_K: ((0, 1.5e-4, False), (2, 1.5e-4, False)),
    GGML.Q5_K: ((0, 8e-5, False), (2, 1.5e-4, False)),
    GGML.Q6_K: ((208, 4e-5, False),),
    GGML.Q2_K: ((80, 1e-3, False), (82, 1e-3, False)),
    GGML.Q3_K: ((108, 2e-4, False),),
}
RANDOM_TYPES = tuple(_SCALES)


def random_blocks(qtype: GGML, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, cols / block_size * type_size]: the raw blocks of a random [rows, cols] tensor."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset, largest, is_signed in _SCALES[qtype]:
        low = -largest if is_signed else 0.0
        values = rng.uniform(low, largest, blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def save_tiny_kquant_model(hf_dir: Path, path: Path, types: dict[str, GGML], llama: bool = False,
                           seed: int = 0) -> Path:
    """A random 1-layer Qwen2 (or Llama) sized for K-quants (hidden 256, 4 heads of 64, 2 kv heads,
    intermediate 512, vocab 256, untied head) saved to `hf_dir`, and its GGUF at `path` whose tensors
    named by a key of `types` (a substring of HF names) are random blocks of that type
    (`random_blocks`, in place of tests.tiny_models' call of gguf-py's quantizer, which has none for
    most of these types)."""
    torch.manual_seed(seed)
    sizes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6,
                 rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if llama:
        LlamaForCausalLM(LlamaConfig(**sizes)).save_pretrained(hf_dir)
    else:
        Qwen2ForCausalLM(Qwen2Config(**sizes, use_sliding_window=False)).save_pretrained(hf_dir)
    counter = iter(range(10**6))

    def blocks_of(array: np.ndarray, qtype: GGML) -> np.ndarray:
        rows, cols = array.shape
        return random_blocks(qtype, rows, cols, seed * 1000 + next(counter))

    with mock.patch.object(tiny_models, "gguf_quantize", blocks_of):
        return tiny_models.save_tiny_gguf(hf_dir, path, quantize=types)


def gguf_dequantize_reference(blocks: np.ndarray, qtype: GGML) -> torch.Tensor:
    """gguf-py's float32 dequantization of [rows, bytes] blocks."""
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(blocks, qtype)))


def random_weight(fmt: QuantFormat, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """A `QuantizedWeight` of any format read from random GGUF blocks (cols a multiple of 256 for K-quants)."""
    qtype = GGML[fmt.name]
    return to_quantized(random_blocks(qtype, rows, cols, seed), qtype, (rows, cols))
