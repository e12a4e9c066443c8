"""Tandem's engine on the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file against HF transformers' fp32
dequantized reference: 16 chat prompts, 32 greedy tokens each. In fp32 with dequantized weights the
tokens are the same for every prompt; with the file's blocks kept packed over a float32 KV pool, for all
but at most one over all 32 tokens; with the CPU defaults `tandem serve` picks for a GGUF file (packed
blocks, a bfloat16 KV pool), for all but at most one up to the end of each answer. Each run prints how
many prompts match."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.weights import Checkpoint, open_checkpoint
from gateway.text.tokenizer import Tokenizer, load_tokenizer
from launcher.configs import engine_config
from launcher.flags import build_parser
from tests.hf_oracle import gguf_greedy_reference
from tests.real_models import (
    QWEN_0_5B,
    count_identical,
    engine_greedy,
    real_model_path,
    up_to_end_of_text,
)

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain what a prime number is.",
    "What does the `git rebase` command do?",
    "Write a SQL query that counts the rows of a table named users.",
    "List 3 countries and their capitals.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about the sea.",
    "How do I read a file line by line in Python?",
    "What is a hash table?",
    "Write a bash command that counts the lines of every .py file in a folder.",
    "Why is the sky blue?",
    "Write a JavaScript function that returns the largest number in an array.",
    "What is recursion? Give a short example.",
    "Explain the difference between TCP and UDP.",
    "Write a C function that swaps two integers through pointers.",
]
NUM_TOKENS = 32
MIN_DEFAULT_MATCHES = 15  # of 16: a bfloat16 KV pool may flip a near tie (logits within a few hundredths)
# <|endoftext|> and <|im_end|>: where Qwen2.5's own generation config ends an answer. Tokens after it (generated
# here with ignore_eos) continue text the model has ended, where near ties are common.
END_OF_TEXT = (151643, 151645)


@pytest.fixture(scope="module")
def model_path() -> Path:
    return real_model_path(QWEN_0_5B)


@pytest.fixture(scope="module")
def checkpoint(model_path: Path) -> Checkpoint:
    """Opened once for both engines: reading the file's metadata (its 151,936-token vocabulary) takes seconds."""
    return open_checkpoint(str(model_path))


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Tokenizer:
    return load_tokenizer(str(model_path))


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_tokens(model_path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """The reference's greedy tokens (kept once per machine); its 2.4 GB of fp32 weights are freed before any
    engine loads."""
    return gguf_greedy_reference(model_path, prompts, NUM_TOKENS)


def test_the_file_ends_generation_where_hf_does(checkpoint: Checkpoint) -> None:
    # The file names <|im_end|> as eos; Qwen2.5's generation config also ends on <|endoftext|>.
    assert checkpoint.config.eos_token_ids == END_OF_TEXT[::-1]


def test_fp32_engine_equals_hf_fp32_on_every_prompt(
    checkpoint: Checkpoint, prompts: list[list[int]], hf_tokens: list[list[int]], tokenizer: Tokenizer
) -> None:
    config = EngineConfig(dtype="float32", quantization="none", max_total_tokens=4096)
    ours = engine_greedy(checkpoint, config, prompts, NUM_TOKENS)
    assert count_identical(f"fp32, {NUM_TOKENS} tokens", PROMPTS, ours, hf_tokens, tokenizer) == len(PROMPTS)
    assert "Paris" in tokenizer.decode(ours[0])


def test_packed_weights_match_hf_fp32_on_15_of_16_prompts_for_32_tokens(
    model_path: Path, checkpoint: Checkpoint, prompts: list[list[int]], hf_tokens: list[list[int]], tokenizer: Tokenizer
) -> None:
    """The Q4_K/Q5_0/Q6_K/Q8_0 blocks kept packed (the CPU default) over a float32 KV pool: every token of
    every answer, end of text or not, against the fp32 dequantized reference."""
    args = build_parser().parse_args(["decode", "--model-path", str(model_path), "--kv-cache-dtype", "float32"])
    config = engine_config(args, "decode", is_embedding=False)
    assert (config.quantization, config.kv_cache_dtype) == ("gguf", "float32")
    ours = engine_greedy(checkpoint, config, prompts, NUM_TOKENS)
    assert count_identical(f"packed, fp32 KV, {NUM_TOKENS} tokens", PROMPTS, ours, hf_tokens, tokenizer) >= 15


def test_default_cpu_engine_matches_hf_fp32_on_15_of_16_prompts(
    model_path: Path, checkpoint: Checkpoint, prompts: list[list[int]], hf_tokens: list[list[int]], tokenizer: Tokenizer
) -> None:
    args = build_parser().parse_args(["decode", "--model-path", str(model_path), "--device", "cpu"])
    config = engine_config(args, "decode", is_embedding=False)
    assert (config.quantization, config.dtype) == ("gguf", "float32")  # what a GGUF file gets on CPU by default
    ours = engine_greedy(checkpoint, config, prompts, NUM_TOKENS)
    label = f"default cpu ({config.quantization}, {config.kv_cache_dtype} KV)"
    count_identical(f"{label}, {NUM_TOKENS} tokens", PROMPTS, ours, hf_tokens, tokenizer)
    answers = [up_to_end_of_text(tokens, END_OF_TEXT) for tokens in ours]
    expected = [up_to_end_of_text(tokens, END_OF_TEXT) for tokens in hf_tokens]
    assert count_identical(f"{label}, up to end of text", PROMPTS, answers, expected, tokenizer) >= MIN_DEFAULT_MATCHES
    assert "Paris" in tokenizer.decode(ours[0])
