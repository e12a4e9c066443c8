"""HF transformers as the test oracle: SmolLM2 from its GGUF, greedy decoding, full-sequence logits.

Weights come from transformers' own GGUF loader (`load_gguf_checkpoint`), independent of ours.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from engine.engine import Engine
from engine.page_allocator import pages_needed
from engine.request import Request, SamplingParams


def load_hf_smollm2(gguf_path: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(LlamaConfig.from_dict(config))   # real init: rotary buffers must exist
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF oracle load mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("HF oracle: lm_head is not tied to the embeddings")
    return model.to(dtype).eval()


def load_hf_dir(path: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model: PreTrainedModel, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Plain greedy argmax for exactly `num_tokens` steps (eos is not special), with HF's KV cache."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(num_tokens):
        next_id = int(out.logits[0, -1].argmax())
        tokens.append(next_id)
        out = model(input_ids=torch.tensor([[next_id]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_last_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([token_ids])).logits[0, -1].float()


def assert_logits_match_hf(engine: Engine, hf: PreTrainedModel, lengths: tuple[int, ...], page_size: int,
                           num_decode_steps: int) -> None:
    """Random prompts of `lengths` prefill in one batch through `engine.runner`, then decode together
    `num_decode_steps` times: each row's logits must equal HF's full-sequence forward at that position."""
    generator = torch.Generator().manual_seed(0)
    requests = [Request(f"r{n}", torch.randint(3, 256, (n,), generator=generator).tolist(), SamplingParams())
                for n in lengths]
    for req in requests:
        req.page_ids = engine.allocator.allocate(pages_needed(req.prompt_len, page_size))
    logits = engine.runner.forward_logits(requests, is_decode=False)
    for _ in range(num_decode_steps):
        for row, req in enumerate(requests):
            expected = hf_last_logits(hf, req.prompt_ids + req.output_ids)
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
        for row, req in enumerate(requests):
            req.num_computed = req.seq_len
            req.output_ids.append(int(logits[row].argmax()))
            if pages_needed(req.seq_len, page_size) > len(req.page_ids):
                req.page_ids += engine.allocator.allocate(1)
        logits = engine.runner.forward_logits(requests, is_decode=True)
