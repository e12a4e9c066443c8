"""Tiny random-weight checkpoints for CPU tests: HF safetensors directories and GGUF files.

Every parameter (norm weights and biases included) is drawn from a seeded generator, so a
loader or model that mixes up two tensors, drops a bias or ignores a norm gives different
numbers. Nothing here is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize as gguf_quantize
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, BertConfig, BertModel, LlamaConfig, LlamaForCausalLM,
                          LlamaForSequenceClassification, MixtralConfig, MixtralForCausalLM, PreTrainedModel,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM)
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

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


TINY_WINDOW = 8  # the sliding window of the tiny windowed families: prompts in tests run past it


def save_tiny_qwen3(path: str | Path, seed: int = 0) -> Path:
    """Write a random 2-layer Qwen3 (q/k norms, head_dim 32 != hidden / heads; layer 1 slides over 8)."""
    config = Qwen3Config(**{**_COMMON, "max_position_embeddings": 256}, head_dim=32, tie_word_embeddings=False,
                         use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1)
    return _save(Qwen3ForCausalLM(config), path, seed, None, torch.float32)


def save_tiny_mistral(path: str | Path, seed: int = 0) -> Path:
    """Write a random 2-layer Mistral whose every layer slides over the last 8 positions."""
    config = MistralConfig(**{**_COMMON, "max_position_embeddings": 256}, sliding_window=TINY_WINDOW,
                           tie_word_embeddings=False)
    return _save(MistralForCausalLM(config), path, seed, None, torch.float32)


def save_tiny_phi3(path: str | Path, seed: int = 0) -> Path:
    """Write a random 2-layer Phi-3 (fused qkv_proj and gate_up_proj in the checkpoint, window 8)."""
    config = Phi3Config(**{**_COMMON, "max_position_embeddings": 256}, sliding_window=TINY_WINDOW,
                        pad_token_id=0, tie_word_embeddings=False)
    return _save(Phi3ForCausalLM(config), path, seed, None, torch.float32)


def save_tiny_gemma3(path: str | Path, seed: int = 0, query_pre_attn_scalar: int = 32) -> Path:
    """Write a random 6-layer Gemma 3 text model: layers 0-4 slide over 8 positions with rope base 10k,
    layer 5 is global with base 1e6 (Gemma's pattern), q/k norms, sandwich norms, GeLU-tanh, tied head,
    and a softmax scale from `query_pre_attn_scalar` (head_dim is 16)."""
    config = Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 6, "max_position_embeddings": 256}, head_dim=16,
        sliding_window=TINY_WINDOW, query_pre_attn_scalar=query_pre_attn_scalar, tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], pad_token_id=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    return _save(Gemma3ForCausalLM(config), path, seed, None, torch.float32)


# Routers get larger weights than the rest so that routing is decisive: no two experts' probabilities
# are close enough for float rounding (ours vs HF's) to swap the chosen ones.
_ROUTER_SCALE = {".gate.weight": 40.0}


def save_tiny_qwen2_moe(path: str | Path, seed: int = 0, norm_topk_prob: bool = False,
                        dtype: torch.dtype = torch.float32) -> Path:
    """Write a random 3-layer Qwen2-MoE to `path`: layers 0 and 2 route each token to 2 of 8 experts
    (width 32) plus a sigmoid-gated shared expert (width 96); layer 1 is dense (`mlp_only_layers`).
    512 positions, so that a generation stack can run SGLang's default 128 new tokens."""
    config = Qwen2MoeConfig(**{**_COMMON, "num_hidden_layers": 3, "max_position_embeddings": 512},
                            tie_word_embeddings=False, use_sliding_window=False, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96,
                            norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[1])
    return _save(Qwen2MoeForCausalLM(config), path, seed, None, dtype, _ROUTER_SCALE)


def save_tiny_mixtral(path: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write a random 2-layer Mixtral to `path`: every layer routes each token to 2 of 4 experts (width 32)."""
    config = MixtralConfig(**{**_COMMON, "intermediate_size": 32}, tie_word_embeddings=False, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=None)
    return _save(MixtralForCausalLM(config), path, seed, None, dtype, _ROUTER_SCALE)


def save_tiny_classifier(path: str | Path, seed: int = 0, num_labels: int = 1, qwen2: bool = False) -> Path:
    """Write a random 2-layer `LlamaForSequenceClassification` (or Qwen2's) with `num_labels` outputs
    (1: a reward model) to `path`. No pad token, so HF scores the last token as Tandem does."""
    if qwen2:
        model: PreTrainedModel = Qwen2ForSequenceClassification(
            Qwen2Config(num_labels=num_labels, use_sliding_window=False, **_COMMON))
    else:
        model = LlamaForSequenceClassification(LlamaConfig(num_labels=num_labels, **_COMMON))
    return _save(model, path, seed, None, torch.float32)


TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|eot|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def save_tiny_tokenizer(path: str | Path) -> Path:
    """Train a tiny BPE tokenizer (vocabulary under 256, so any tiny model here can
    take its ids) with a chat template, and save it as HF tokenizer files into `path`."""
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=250, show_progress=False, special_tokens=[
        "<unk>", "<s>", "</s>", "<|eot|>", "<|user|>", "<|assistant|>", "<|system|>"])
    corpus = ["What is the capital of France? The capital of France is Paris.",
              "What is the range of the numeric output of a sigmoid node in a neural network?",
              "The output of a sigmoid node is bounded between -1 and 1, or between 0 and 1."]
    raw.train_from_iterator(corpus * 5, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory


def save_tiny_bert(path: str | Path, seed: int = 0) -> Path:
    """Write a random 2-layer BertModel (hidden 64, 4 heads, vocab 256, 128 positions) to `path`."""
    config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128)
    return _save(BertModel(config), path, seed, None, torch.float32)


def _save(model: PreTrainedModel, path: str | Path, seed: int, max_shard_size: str | None,
          dtype: torch.dtype, scales: dict[str, float] | None = None) -> Path:
    """Randomize every parameter (weights whose name ends with a key of `scales` are multiplied by
    its value) and save `model` in `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                scale = next((v for k, v in (scales or {}).items() if name.endswith(k)), 1.0)
                param.copy_(0.05 * scale * noise)
    model = model.to(dtype)
    directory = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def save_tiny_gguf(hf_dir: str | Path, path: str | Path,
                   architecture: str | None = None, quantize: dict[str, GGMLQuantizationType] | None = None) -> Path:
    """Convert the HF checkpoint in `hf_dir` to a float32 GGUF file as llama.cpp's converter does.

    Q and K rows are permuted for `llama` (interleaved rotary pairs), tensor names are mapped to
    llama.cpp's, and `lm_head.weight` is written only when embeddings are untied.
    `architecture` overrides `general.architecture` (to test rejection of other models).
    `quantize` maps a substring of HF tensor names (e.g. "q_proj.weight") to the block type those
    matrices are stored in (gguf-py's quantizer), as a quantized llama.cpp file holds them.
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
        qtype = next((t for part, t in (quantize or {}).items() if part in name), None)
        if qtype is None:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
        else:
            writer.add_tensor(_gguf_name(name), gguf_quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
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


def save_tiny_olmo2(path: str | Path, seed: int = 0) -> Path:
    """Write a random 2-layer OLMo 2 (q/k norms over all heads, norms after attention and MLP; no Tandem
    family file, so it runs on the transformers fallback)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(**_COMMON, tie_word_embeddings=False)
    return _save(Olmo2ForCausalLM(config), path, seed, None, torch.float32)


def save_tiny_granite(path: str | Path, seed: int = 0) -> Path:
    """Write a random 2-layer Granite with tied embeddings and every multiplier off its default (attention
    scale 0.3 != head_dim ** -0.5, logits divided by 4): a transformers-fallback architecture."""
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(**_COMMON, tie_word_embeddings=True, attention_multiplier=0.3, logits_scaling=4.0,
                           embedding_multiplier=2.0, residual_multiplier=0.5)
    return _save(GraniteForCausalLM(config), path, seed, None, torch.float32)


def save_tiny_gpt_oss(path: str | Path, seed: int = 0) -> Path:
    """Write a random 2-layer GPT-OSS (4 experts, 2 a token): its attention layers pass attention sinks
    (`s_aux`), which Tandem's backends cannot apply, so the transformers fallback refuses it."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(**_COMMON, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=TINY_WINDOW, layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _save(GptOssForCausalLM(config), path, seed, None, torch.float32)


def save_tiny_olmo3(path: str | Path, seed: int = 0) -> Path:
    """Write a random 2-layer OLMo 3 whose layer 0 slides over the last TINY_WINDOW positions (a
    transformers-fallback architecture with a window)."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    config = Olmo3Config(**_COMMON, tie_word_embeddings=False, sliding_window=TINY_WINDOW,
                         layer_types=["sliding_attention", "full_attention"])
    return _save(Olmo3ForCausalLM(config), path, seed, None, torch.float32)
