"""A LoRA adapter on the bundled SmolLM2's packed GGUF weights against HF + PEFT's fp32 merged reference: an
adapter made by the real `peft` on HF's fp32 dequantized model (rank 8, every projection) is served by the
engine over the file's blocks kept packed (the CPU default) and a float32 KV pool; 16 chat prompts, 24
greedy tokens each, agree with the merged fp32 model's on at least 15 (packing rounds the base weights, so
a near tie may flip), and the adapter changes what the engine says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from engine.engine import Engine
from engine.lora import LoraAdapter
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from gateway.text.tokenizer import load_tokenizer
from launcher.configs import engine_config
from launcher.defaults import default_model_path
from launcher.flags import build_parser
from tests.hf_oracle import load_hf_gguf
from tests.real_models import count_identical, hf_greedy_batch

torch.set_flush_denormal(True)

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain what a prime number is.",
    "Give me three tips for sleeping better.",
    "What is the boiling point of water?",
    "List 3 countries and their capitals.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about the sea.",
    "How do plants make food?",
    "What is a hash table?",
    "Name a famous painter and one of their works.",
    "Why is the sky blue?",
    "What does a CPU do?",
    "What is recursion? Give a short example.",
    "How many days are in a leap year?",
    "Translate 'good morning' into Spanish.",
]
NUM_TOKENS = 24
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(the adapter's directory, the chat prompts' ids, the merged fp32 model's greedy tokens)."""
    gguf = Path(default_model_path())
    tokenizer = load_tokenizer(str(gguf))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    torch.manual_seed(7)
    model = get_peft_model(load_hf_gguf(gguf), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():  # PEFT starts B at zero: give it values that change the answers, not wreck them
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.02)
    adapter_dir = tmp_path_factory.mktemp("smollm2-lora")
    model.save_pretrained(adapter_dir)
    tokens = hf_greedy_batch(model.merge_and_unload().eval(), prompts, NUM_TOKENS)
    return adapter_dir, prompts, tokens


def _greedy(engine: Engine, prompts: list[list[int]], slot: int | None) -> list[list[int]]:
    sampling = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(
            Request(f"p{i}", list(prompt), sampling, lora_slot=slot, lora_id="a" if slot is not None else "")
        )
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        for output in engine.step():
            if output.token_id is not None:
                tokens.setdefault(output.request_id, []).append(output.token_id)
    return [tokens[f"p{i}"] for i in range(len(prompts))]


def test_packed_smollm2_with_an_adapter_matches_peft_fp32_on_15_of_16_prompts(
    reference: tuple[Path, list[list[int]], list[list[int]]],
) -> None:
    adapter_dir, prompts, expected = reference
    gguf = default_model_path()
    args = build_parser().parse_args(
        ["decode", "--model-path", gguf, "--kv-cache-dtype", "float32", "--max-loras", "1", "--max-lora-rank", "8"]
    )
    config = engine_config(args, "decode", is_embedding=False)
    assert (config.quantization, config.kv_cache_dtype, config.max_loras) == ("gguf", "float32", 1)
    engine = Engine(open_checkpoint(gguf), config, progress=False)
    engine.load_lora(0, LoraAdapter.load(adapter_dir, engine.model_config))
    ours = _greedy(engine, prompts, 0)
    tokenizer = load_tokenizer(gguf)
    assert count_identical(f"packed + LoRA, {NUM_TOKENS} tokens", PROMPTS, ours, expected, tokenizer) >= 15
    base = _greedy(engine, prompts, None)
    num_changed = sum(a != b for a, b in zip(ours, base))
    print(f"the adapter changes {num_changed}/{len(PROMPTS)} answers")
    assert num_changed >= 4  # the adapter speaks
