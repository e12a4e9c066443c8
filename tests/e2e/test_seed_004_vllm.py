"""Seed 004 (a vLLM serving guide): vLLM's server flags and its client calls work against Tandem."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.e2e.stack import Stack, start_stack

pytestmark = pytest.mark.slow

NAME = "DeepSeek-R1-Distill-Qwen-7B"   # the seed's served name, kept; the weights are SmolLM2's


@pytest.fixture(scope="module")
def vllm_style(tmp_path_factory, smollm2_path: Path) -> Stack:
    # the seed's command line, with vLLM's flag names: --model, --max-model-len, --dtype=half
    stack = start_stack(tmp_path_factory.mktemp("seed004"), "--model", str(smollm2_path), "--served-model-name",
                        NAME, "--max-model-len=2048", "--dtype=half", "--host", "127.0.0.1",
                        "--max-total-tokens", "4096", "--torch-threads", "1")
    yield stack
    assert stack.stop() == []


def test_seed_004_models_and_completions(vllm_style: Stack) -> None:
    client = openai.OpenAI(base_url=f"{vllm_style.url}/v1", api_key="EMPTY")
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME] and models.data[0].model_extra["max_model_len"] == 2048
    for prompt in ("我想问你，5的阶乘是多少？<think>\n", "我想问一下大模型学习计画？<think>\n"):
        completion = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=24)
        assert completion.choices[0].text and completion.usage.completion_tokens <= 24
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "5的阶乘是多少？"}],
                                          temperature=0, max_tokens=24)
    assert chat.choices[0].message.content
