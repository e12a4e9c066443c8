"""Print one image's pip requirements, one a line, read from pyproject.toml so the images follow it.

    python3 docker/python_deps.py gateway|worker [--accelerator cpu|cuda] [--pyproject PATH]

torch is left out: `docker/install-torch.sh` installs it first (a wheel from the build's wheels
directory, or the PyTorch index for the accelerator). The gateway gets only what it imports; the
worker image can run every role, `tandem serve` included, so it gets everything.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

INSTALLED_SEPARATELY = frozenset({"torch"})
# The KV transport's wheel differs per accelerator: pyproject's dependencies name the CPU one, which the
# CUDA image swaps for the CUDA build (both install the same `mooncake` package). What the CUDA image adds,
# each pinned there: the optional dependency groups named here (FlashInfer; Mooncake's CUDA build).
MOONCAKE = "mooncake-transfer-engine"
ACCELERATOR_EXTRAS = {"cpu": (), "cuda": ("gpu", "mooncake-cuda")}
# What only the workers import: checkpoint reading, stub generation at build time, grammar-constrained
# decoding (the engine applies the grammar masks). Server reflection (grpcio-reflection) and the rich
# error details (grpcio-status, which brings googleapis-common-protos) serve the gateway's gRPC API too.
WORKER_ONLY = frozenset({"safetensors", "grpcio-tools", "xgrammar"})


def requirement_name(requirement: str) -> str:
    """The normalized project name at the start of a PEP 508 requirement string."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def image_requirements(
    dependencies: list[str], role: str, accelerator: str, extras: dict[str, list[str]] | None = None
) -> list[str]:
    """The requirement lines for `role` ("gateway" or "worker") on `accelerator` ("cpu" or "cuda");
    `extras` are pyproject's optional dependency groups (a CUDA worker adds those ACCELERATOR_EXTRAS names)."""
    if role not in ("gateway", "worker") or accelerator not in ACCELERATOR_EXTRAS:
        raise ValueError(f"unknown role/accelerator {role!r}/{accelerator!r}")
    lines = []
    for requirement in dependencies:
        name = requirement_name(requirement)
        if name in INSTALLED_SEPARATELY:
            continue
        if name.startswith(MOONCAKE) and (role == "gateway" or accelerator != "cpu"):
            continue
        if role == "gateway" and name in WORKER_ONLY:
            continue
        lines.append(requirement)
    if role == "worker":
        for group in ACCELERATOR_EXTRAS[accelerator]:
            if not extras or group not in extras:
                raise ValueError(f"pyproject.toml has no optional dependency group {group!r}")
            lines.extend(extras[group])
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["gateway", "worker"])
    parser.add_argument("--accelerator", choices=sorted(ACCELERATOR_EXTRAS), default="cpu")
    parser.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parent.parent / "pyproject.toml")
    args = parser.parse_args(argv)
    project = tomllib.loads(args.pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    print("\n".join(image_requirements(project["dependencies"], args.role, args.accelerator, extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
