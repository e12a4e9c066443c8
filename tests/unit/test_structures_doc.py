"""docs/structures.md names every module of the packages, and no module that is gone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCUMENTED = ("engine", "kernels", "kv_transfer", "server_runtime", "prefill_server", "decode_server", "gateway",
              "launcher", "protos", "benchmarks", "scripts")


def _tracked_modules() -> set[str]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return {path for path in listed.stdout.split()
            if path.split("/")[0] in DOCUMENTED and "_pb2" not in path and (REPO_ROOT / path).exists()}


def test_every_module_has_its_line_and_every_line_its_module() -> None:
    text = (REPO_ROOT / "docs" / "structures.md").read_text()
    named = set(re.findall(r"^- `([\w/]+\.py)`", text, flags=re.MULTILINE))
    modules = _tracked_modules()
    assert sorted(modules - named) == [], "modules without a line in docs/structures.md"
    assert sorted(m for m in named - modules if m.split("/")[0] in DOCUMENTED) == [], "lines naming no module"
