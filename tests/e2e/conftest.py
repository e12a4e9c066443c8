"""One `tandem serve` stack (three real processes) shared by the e2e modules that ask for it."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from launcher.defaults import default_model_path

from tests.e2e.error_bodies import Findings, watch_error_bodies
from tests.e2e.stack import Stack, start_stack

MODEL = "SmolLM2-135M-Instruct"
CONTEXT_LEN = 1024


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    # fp32 with dequantized weights, so greedy output can be compared with HF token for token
    # Weights may be updated from the bundled model's directory and from the tests' temporary ones.
    weights_dirs = ("--weights-dir", str(Path(default_model_path()).parent),
                    "--weights-dir", str(tmp_path_factory.getbasetemp()))
    stack = start_stack(tmp_path_factory.mktemp("stack"), *weights_dirs, "--dtype", "float32", "--quantization", "none",
                        "--context-length",
                        str(CONTEXT_LEN), "--max-total-tokens", "8192", "--torch-threads", "1")
    yield stack
    survivors = stack.stop()
    assert stack.proc.returncode == 0
    assert survivors == [], f"orphaned processes after Ctrl-C: {survivors}"


@pytest.fixture(autouse=True)
def no_pages_leak(request):
    """After every test that used the shared stack, no KV page is held on either worker."""
    yield
    if "stack" in request.fixturenames:
        request.getfixturevalue("stack").assert_no_pages_held()


@pytest.fixture(autouse=True)
def error_bodies_name_no_internals(monkeypatch):
    """No error body any e2e test receives names an internal address, path or exception."""
    findings = Findings()
    watch_error_bodies(monkeypatch, findings)
    yield findings
    assert not findings.items, f"error bodies naming internal details: {findings.items}"


@pytest.fixture(scope="session")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="None")
