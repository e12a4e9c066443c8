"""The real Gemma 3 270M (base) Q4_K_M file: Tandem's engine against HF transformers' fp32 dequantized
reference (16 raw completion prompts, 32 greedy tokens: all identical in fp32 with dequantized weights, all
but at most one, up to the end of each text, with the CPU defaults for a GGUF file), and `tandem serve` on it
answering a completion and a native `/generate` request. A base model has no chat template: raw text only."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import requests

from engine.config import EngineConfig
from engine.weights import Checkpoint, open_checkpoint
from gateway.text.tokenizer import Tokenizer, load_tokenizer
from launcher.configs import engine_config
from launcher.flags import build_parser
from tests.e2e.stack import Stack, start_stack
from tests.hf_oracle import gguf_greedy_reference
from tests.real_models import (
    GEMMA_270M,
    count_identical,
    engine_greedy,
    real_model_path,
    up_to_end_of_text,
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "The three primary colors are",
    "import numpy as np\n",
    "The largest planet in the solar system is",
    "Water boils at",
    "In 1969, the first man to walk on the Moon was",
    "The chemical symbol for gold is",
    "SELECT name FROM users WHERE",
    "The Python keyword that defines a function is",
    "The speed of light is about",
    "To bake bread, you first",
    "The Eiffel Tower is located in",
    "Photosynthesis is the process by which",
    "for (int i = 0; i < n; i++) {",
]
NUM_TOKENS = 32
# A 270M base model continues "The capital of France is" with " the capital of the country of France.":
# coherence is checked on questions it answers.
QUESTION = "Question: What is the capital of France?\nAnswer:"
MIN_DEFAULT_MATCHES = 15  # of 16: packed blocks and a bfloat16 KV pool may flip a near tie


@pytest.fixture(scope="module")
def model_path() -> Path:
    return real_model_path(GEMMA_270M)


@pytest.fixture(scope="module")
def checkpoint(model_path: Path) -> Checkpoint:
    return open_checkpoint(str(model_path))


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Tokenizer:
    return load_tokenizer(str(model_path))


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]  # with Gemma's bos, as its tokenizer asks


@pytest.fixture(scope="module")
def hf_tokens(model_path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return gguf_greedy_reference(model_path, prompts, NUM_TOKENS)


def test_gemma3_file_ends_generation_where_hf_does(checkpoint: Checkpoint) -> None:
    # The file names <eos> (1) only; Gemma 3's generation config also ends on <end_of_turn> (106).
    assert checkpoint.config.eos_token_ids == (1, 106)


def test_gemma3_fp32_engine_equals_hf_fp32_on_every_prompt(
    checkpoint: Checkpoint, prompts: list[list[int]], hf_tokens: list[list[int]], tokenizer: Tokenizer
) -> None:
    config = EngineConfig(dtype="float32", quantization="none", max_total_tokens=4096)
    ours = engine_greedy(checkpoint, config, prompts, NUM_TOKENS)
    assert count_identical(f"gemma3 fp32, {NUM_TOKENS} tokens", PROMPTS, ours, hf_tokens, tokenizer) == len(PROMPTS)
    assert "Paris" in tokenizer.decode(ours[PROMPTS.index("The Eiffel Tower is located in")])


def test_gemma3_default_cpu_engine_matches_hf_fp32_on_15_of_16_prompts(
    model_path: Path, checkpoint: Checkpoint, prompts: list[list[int]], hf_tokens: list[list[int]], tokenizer: Tokenizer
) -> None:
    args = build_parser().parse_args(["decode", "--model-path", str(model_path), "--device", "cpu"])
    config = engine_config(args, "decode", is_embedding=False)
    ours = engine_greedy(checkpoint, config, prompts, NUM_TOKENS)
    label = f"gemma3 default cpu ({config.quantization}, {config.kv_cache_dtype} KV)"
    count_identical(f"{label}, {NUM_TOKENS} tokens", PROMPTS, ours, hf_tokens, tokenizer)
    answers = [up_to_end_of_text(tokens, tokenizer.eos_token_ids) for tokens in ours]
    expected = [up_to_end_of_text(tokens, tokenizer.eos_token_ids) for tokens in hf_tokens]
    assert count_identical(f"{label}, up to end of text", PROMPTS, answers, expected, tokenizer) >= MIN_DEFAULT_MATCHES


@pytest.fixture(scope="module")
def gemma_stack(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Stack:
    stack = start_stack(tmp_path_factory.mktemp("gemma_stack"), "--model-path", str(model_path), "--default-sampling",
                        '{"temperature": 0}', "--context-length", "2048", "--max-total-tokens", "8192",
                        "--torch-threads", "1", timeout_s=600)
    yield stack
    survivors = stack.stop()
    assert stack.proc.returncode == 0
    assert survivors == [], f"orphaned processes after Ctrl-C: {survivors}"


@pytest.mark.slow
def test_gemma3_stack_completion_answers_paris(gemma_stack: Stack, model_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{gemma_stack.url}/v1", api_key="None")
    response = client.completions.create(model=str(model_path), prompt=QUESTION, temperature=0, max_tokens=16)
    print(f"Response: {response}")

    [choice] = response.choices
    assert response.object == "text_completion" and choice.finish_reason in ("stop", "length")
    assert "Paris" in choice.text
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    gemma_stack.assert_no_pages_held()


@pytest.mark.slow
def test_gemma3_stack_generate_places_the_eiffel_tower_in_paris(gemma_stack: Stack) -> None:
    response = requests.post(f"http://localhost:{gemma_stack.port}/generate", json={
        "text": "The Eiffel Tower is located in", "sampling_params": {"temperature": 0, "max_new_tokens": 32}})
    print(response.json())

    body = response.json()
    assert response.status_code == 200 and body.keys() == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"} <= meta.keys()
    assert meta["completion_tokens"] == len(body["output_ids"]) >= 1 and "Paris" in body["text"]
    gemma_stack.assert_no_pages_held()
