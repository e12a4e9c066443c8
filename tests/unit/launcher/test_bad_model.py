"""`tandem serve` on a model it cannot serve: one line naming the problem and what to do, exit code 2,
no traceback, before any worker gets its config (real processes, real files)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_gguf, save_tiny_llama


def _serve(model_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "serve", "--model-path", str(model_path), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bad")
    return save_tiny_gguf(save_tiny_llama(directory / "hf"), directory / "model.gguf")


def _one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0]
    assert "Tandem is ready" not in result.stderr


def test_a_truncated_gguf_file(tiny_gguf: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    _one_line_error(_serve(truncated), "truncated or corrupted", "download it again")


def test_an_architecture_with_no_family(tiny_gguf: Path, tmp_path: Path) -> None:
    other = save_tiny_gguf(tiny_gguf.parent / "hf", tmp_path / "falcon.gguf", architecture="falcon")
    _one_line_error(_serve(other), "unsupported GGUF architecture 'falcon'", "supported: llama, qwen2, qwen3")


def test_a_missing_path(tmp_path: Path) -> None:
    _one_line_error(_serve(tmp_path / "nowhere.gguf"), "does not exist locally")


def test_the_bundled_default_passes_the_check() -> None:
    """With no --model-path, the check opens the bundled model the stack serves, and finds it servable."""
    from launcher.flags import build_parser
    from launcher.serve import checkpoint_problem, stack_configs

    stack = stack_configs(build_parser().parse_args(["serve"]))
    assert stack.gateway.model_path.endswith(".gguf")
    assert checkpoint_problem(stack.gateway.model_path) is None


def test_a_missing_draft_model(tmp_path: Path) -> None:
    """The draft model is checked beside the target, with the same one line."""
    missing = tmp_path / "draft.gguf"
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "serve", "--port", "0", "--speculative-algorithm", "draft",
         "--speculative-draft-model-path", str(missing)],
        capture_output=True, text=True, timeout=120,
    )
    _one_line_error(result, str(missing), "does not exist locally")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculative-algorithm", "draft"], "--speculative-algorithm draft needs --speculative-draft-model-path"),
        (["--speculative-draft-model-path", "d.gguf"], "used only with --speculative-algorithm draft"),
        (["--speculative-algorithm", "ngram", "--speculative-draft-model-path", "d.gguf"], "used only with"),
    ],
)
def test_draft_flags_that_do_not_go_together(flags: list[str], message: str) -> None:
    from launcher.flags import build_parser
    from launcher.serve import stack_configs

    with pytest.raises(SystemExit, match=message):
        stack_configs(build_parser().parse_args(["serve", *flags]))


def test_only_decode_workers_get_the_draft_model(tmp_path: Path) -> None:
    from launcher.flags import build_parser
    from launcher.serve import stack_configs

    draft = tmp_path / "draft.gguf"
    stack = stack_configs(build_parser().parse_args(
        ["serve", "--speculative-algorithm", "draft", "--speculative-draft-model-path", str(draft)]))
    assert [w.draft_model_path for w in stack.decodes] == [str(draft)]
    assert [w.engine.speculative_algorithm for w in stack.decodes] == ["draft"]
    assert all(w.draft_model_path is None and w.engine.speculative_algorithm is None for w in stack.prefills)
