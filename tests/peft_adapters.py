"""LoRA adapters made by the real `peft` for the tests, and PEFT's greedy tokens as their oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.hf_oracle import hf_greedy, load_hf_dir


def save_peft_adapter(base_dir: Path, out: Path, seed: int, **lora: Any) -> Path:
    """A PEFT adapter for `base_dir`'s HF model, saved to `out`: `lora` are LoraConfig's settings (r 8,
    alpha 16 unless given), A and B random unless `init_lora_weights` says otherwise."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    settings = {"r": 8, "lora_alpha": 16, "init_lora_weights": False, **lora}
    get_peft_model(model, LoraConfig(**settings)).save_pretrained(out)
    return out


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompt: list[int], num_tokens: int) -> list[int]:
    """HF's fp32 greedy tokens of `base_dir` under the adapter at `adapter_dir` (None: the base model)."""
    model = load_hf_dir(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    return hf_greedy(model, prompt, num_tokens)
