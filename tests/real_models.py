"""The real GGUF models `make test` fetches (pinned in scripts/fetch_models.py): where their files are,
and greedy runs over them of Tandem's engine and of HF transformers' fp32 dequantized reference."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import PreTrainedModel

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.weights import Checkpoint
from gateway.text.tokenizer import Tokenizer
from scripts.fetch_models import MODELS, cache_dir, is_verified

QWEN_0_5B = "qwen2.5-coder-0.5b-instruct"
GEMMA_270M = "gemma-3-270m"


def real_model_path(name: str) -> Path:
    """The verified GGUF file of model `name` (a key of scripts.fetch_models.MODELS). Raises, naming the
    command that fetches it, when it is missing: `make test` always fetches the test models first."""
    model = MODELS[name]
    path = cache_dir(os.environ) / model.file_name
    if not is_verified(model, path):
        raise RuntimeError(
            f"{model.file_name} is missing or unverified in {path.parent}: run `make models` "
            f"(or `.venv/bin/python -m scripts.fetch_models {name}`)"
        )
    return path


def engine_greedy(
    checkpoint: Checkpoint, config: EngineConfig, prompts: list[list[int]], num_tokens: int
) -> list[list[int]]:
    """Tandem's `num_tokens` greedy tokens for each prompt, all of them submitted at once (eos not special)."""
    engine = Engine(checkpoint, config, progress=False)
    sampling = SamplingParams(temperature=0, max_new_tokens=num_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(ids), sampling))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            if out.token_id is not None:
                outputs[out.request_id].append(out.token_id)
    if engine.allocator.num_free + engine.pages.num_evictable_pages != engine.allocator.num_pages:
        raise AssertionError("the engine still holds KV pages after every request finished")
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def hf_greedy_batch(model: PreTrainedModel, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Plain greedy argmax for exactly `num_tokens` steps per prompt (eos not special), every prompt in
    one left-padded batch with HF's KV cache."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    steps = []
    for _ in range(num_tokens):
        next_ids = out.logits[:, -1].argmax(-1)
        steps.append(next_ids)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=next_ids[:, None], attention_mask=mask, position_ids=positions,
                    past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(steps, dim=1).tolist()


def count_identical(
    label: str, prompts: list[str], ours: list[list[int]], reference: list[list[int]], tokenizer: Tokenizer
) -> int:
    """How many prompts' tokens equal the reference's; prints the count and where each other one first differs."""
    matches = 0
    for prompt, tokens, expected in zip(prompts, ours, reference):
        if tokens == expected:
            matches += 1
            continue
        at = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))
        print(f"{label}: {prompt!r} differs from token {at}: {tokenizer.decode(tokens[at:])!r} "
              f"vs {tokenizer.decode(expected[at:])!r}")
    print(f"{label}: {matches}/{len(prompts)} identical to HF fp32")
    return matches


def up_to_end_of_text(tokens: list[int], end_ids: tuple[int, ...]) -> list[int]:
    """`tokens` up to and including the first of `end_ids`: the answer a server would stop at."""
    ends = [i for i, token in enumerate(tokens) if token in end_ids]
    return tokens[: ends[0] + 1] if ends else tokens
