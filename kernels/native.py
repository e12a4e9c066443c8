"""Tandem's C++ CPU kernels (`kernels/csrc/`), compiled once per machine and cached.

`make install` builds them (`python -m kernels.native`); a process that finds no build compiles
them on first use. The build targets the compiling machine's instruction set (`-march=native`,
or `TANDEM_KERNEL_ARCH`, e.g. `x86-64-v3` for images that run elsewhere): AVX-512 with VNNI,
AVX2 or scalar paths are chosen at compile time (`kernels/csrc/common.h`; `load().isa()` says
which). The build lands in `TANDEM_KERNEL_CACHE` (default: `$XDG_CACHE_HOME/tandem/kernels`, that is
`~/.cache/tandem/kernels`; `<python prefix>/share/tandem-kernels` where the home is not writable), named by
a hash of the sources, the flags, torch's and Python's versions and, for `-march=native`, the CPU's
flags, so an edit, another architecture or another torch builds anew, and every checkout and virtual
environment on one machine shares one build. Processes that find no build take turns to compile it
(a file lock that dies with its holder: a start killed mid-build blocks no later one). A build that is
there is imported directly, without torch's build step (which needs ninja and reads the sources'
times), so an image can ship the build alone and no compiler.

The sources: `qmatmul.cpp` (quantized matmul), `qamx.cpp` (its AMX tiles, on Xeons that have
them: `load().isa()` then ends in "+amx"), `attention.cpp` (paged attention), `layers.cpp`
(norm, SiLU, rotary), `decoder.cpp` (a whole dense decoder layer in one call), `repack.cpp`
(GGUF blocks -> matmul panels at load), `lora.cpp` (batched LoRA shrink and expand), each on raw
pointers, and `bindings.cpp`, the only one that includes torch's extension headers (the slow part
of a build), which checks the tensors and calls them.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (
    "bindings.cpp",
    "qmatmul.cpp",
    "qamx.cpp",
    "attention.cpp",
    "layers.cpp",
    "decoder.cpp",
    "repack.cpp",
    "lora.cpp",
)
_HEADERS = ("common.h", "kernels.h", "qamx.h", "qlayout.h", "qrows.h", "vec.h")


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded on this machine."""


def _flags() -> list[str]:
    arch = os.environ.get("TANDEM_KERNEL_ARCH", "native")
    if arch == "x86-64-v3" and not _cpu_has("avx2", "fma"):
        arch = "native"  # an image built for AVX2 on an older CPU: compile for this one, if a compiler is here
    # -fopenmp: at::parallel_for is a header template that splits work with `#pragma omp parallel`,
    # so without it every kernel runs on one thread whatever torch.set_num_threads says. The OpenMP
    # runtime it links against is torch's own libgomp.so.1 (same soname, already loaded).
    return ["-O3", f"-march={arch}", "-fno-math-errno", "-std=c++17", "-fopenmp"]


def _cpu_flags() -> list[str] | None:
    """The x86 flags /proc/cpuinfo lists (none on other CPUs); None where there is no /proc (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return None
    return line.partition(":")[2].split()


def _cpu_has(*flags: str) -> bool:
    have = _cpu_flags()
    return have is None or all(flag in have for flag in flags)  # not Linux: trust the configured architecture


def _cache_root() -> Path:
    configured = os.environ.get("TANDEM_KERNEL_CACHE")
    if configured:
        return Path(configured)
    try:
        home_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "kernels"
        home_cache.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # no home, or none writable (a system user): the environment's own directory
        return Path(sys.prefix) / "share" / "tandem-kernels"
    return home_cache


def _build_name(flags: list[str]) -> str:
    import torch

    content = b"".join((_CSRC / name).read_bytes() for name in _SOURCES + _HEADERS)
    target = [*flags, f"torch={torch.__version__}", f"python={sys.version_info[0]}.{sys.version_info[1]}"]
    if "-march=native" in flags:  # one cache may serve machines with other CPUs (a shared home)
        target += sorted(_cpu_flags() or ())
    return "tandem_cpu_" + hashlib.sha256(content + " ".join(target).encode()).hexdigest()[:12]


def _import_built(name: str, path: Path) -> ModuleType | None:
    """The build at `path`, imported as a Python extension; None when it does not load (a build that
    another process is still writing, say)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        logger.warning("cannot import the kernel build %s (%s); building it again", path, exc)
        return None
    return module


@functools.cache
def load() -> ModuleType:
    """The compiled module (building it first if needed). Raises KernelBuildError."""
    import torch  # noqa: F401  (the build links libtorch, which must be loaded first)

    flags = _flags()
    name = _build_name(flags)
    build_dir = _cache_root() / name
    built = build_dir / f"{name}.so"
    if built.is_file() and (module := _import_built(name, built)) is not None:
        return module
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        lock_file = open(build_dir.parent / f"{name}.lock", "w")  # held for the whole build, below
    except OSError as exc:
        raise KernelBuildError(f"cannot create the kernel build directory {build_dir} ({exc})") from exc
    with lock_file:
        # One build per machine at a time: a process that finds another building waits for it, then
        # imports what it built. The kernel drops the lock with its holder, so a builder that was killed
        # (Ctrl-C during a first start, the OOM killer) leaves no lock that blocks the next start.
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's build of Tandem's CPU kernels into %s", build_dir)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        if built.is_file() and (module := _import_built(name, built)) is not None:
            return module
        return _compile(name, build_dir, flags)


def _compile(name: str, build_dir: Path, flags: list[str]) -> ModuleType:
    """Compile the sources into `build_dir`; the caller holds the build lock."""
    from torch.utils import cpp_extension

    # torch's own build lock (a file it deletes when done) is left behind by a builder that was killed,
    # and makes every later build wait for it forever; no builder is running now.
    (build_dir / "lock").unlink(missing_ok=True)
    logger.info("compiling Tandem's CPU kernels into %s (once per machine, about a minute)", build_dir)
    started = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(_CSRC / source) for source in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # compiler missing, headers missing, link errors: all mean "no kernels"
        raise KernelBuildError(f"cannot build Tandem's CPU kernels ({type(exc).__name__}: {exc})") from exc
    logger.info("CPU kernels compiled in %.0f s", time.perf_counter() - started)
    return module


@functools.cache
def is_available() -> bool:
    """Whether the kernels load (building them if needed); logs why not, once."""
    try:
        load()
    except KernelBuildError as exc:
        logger.warning("%s; falling back to the torch implementations", exc)
        return False
    return True


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("building Tandem's CPU kernels ...", flush=True)
    load()
    print("Tandem's CPU kernels are built.", flush=True)
