"""Tiny random-weight checkpoints for CPU tests: HF safetensors directories and GGUF files.

Every parameter (norm weights and biases included) is drawn from a seeded generator, so a
loader or model that mixes up two tensors, drops a bias or ignores a norm gives different
numbers. Nothing here is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter
from transformers import (AutoModelForCausalLM, BertConfig, BertModel, LlamaConfig, LlamaForCausalLM,
                          PreTrainedModel, Qwen2Config, Qwen2ForCausalLM)

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
               rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)

_GGUF_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def save_tiny_llama(path: str | Path, tie_word_embeddings: bool = False, seed: int = 0,
                    max_shard_size: str | None = None,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write a random 2-layer Llama (hidden 64, 4 heads, 2 kv heads, vocab 256) to `path`."""
    config = LlamaConfig(tie_word_embeddings=tie_word_embeddings, **_COMMON)
    return _save(LlamaForCausalLM(config), path, seed, max_shard_size, dtype)


def save_tiny_qwen2(path: str | Path, seed: int = 0, max_shard_size: str | None = None,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write a random 2-layer Qwen2 (q/k/v biases, untied head, same sizes as Llama) to `path`."""
    config = Qwen2Config(tie_word_embeddings=False, use_sliding_window=False, **_COMMON)
    return _save(Qwen2ForCausalLM(config), path, seed, max_shard_size, dtype)


def save_tiny_bert(path: str | Path, seed: int = 0) -> Path:
    """Write a random 2-layer BertModel (hidden 64, 4 heads, vocab 256, 128 positions) to `path`."""
    config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128)
    return _save(BertModel(config), path, seed, None, torch.float32)


def _save(model: PreTrainedModel, path: str | Path, seed: int, max_shard_size: str | None,
          dtype: torch.dtype) -> Path:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.05 * noise)
    model = model.to(dtype)
    directory = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def save_tiny_gguf(hf_dir: str | Path, path: str | Path,
                   architecture: str | None = None) -> Path:
    """Convert the HF checkpoint in `hf_dir` to a float32 GGUF file as llama.cpp's converter does.

    Q and K rows are permuted for `llama` (interleaved rotary pairs), tensor names are mapped to
    llama.cpp's, and `lm_head.weight` is written only when embeddings are untied.
    `architecture` overrides `general.architecture` (to test rejection of other models).
    """
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = model.config
    arch = architecture or config.model_type
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        array = tensor.detach().to(torch.float32).numpy()
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # Copied in spirit from llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`.
    half = weights.shape[0] // num_heads // 2
    return (weights.reshape(num_heads, 2, half, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_BLOCK[module]}.{kind}"
