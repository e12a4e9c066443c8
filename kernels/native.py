"""Tandem's C++ CPU kernels (`kernels/csrc/`), compiled once per machine and cached.

`make install` builds them (`python -m kernels.native`); a process that finds no build compiles
them on first use. The build targets the compiling machine's instruction set (`-march=native`,
or `TANDEM_KERNEL_ARCH`, e.g. `x86-64-v3` for images that run elsewhere): AVX-512 with VNNI,
AVX2 or scalar paths are chosen at compile time (`kernels/csrc/common.h`; `load().isa()` says
which). The build lands in `TANDEM_KERNEL_CACHE` (default: `<python prefix>/share/tandem-kernels`),
named by a hash of the sources and flags, so an edit or another architecture builds anew.

The sources: `qmatmul.cpp` (quantized matmul), `attention.cpp` (paged attention), `layers.cpp`
(norm, SiLU, rotary), `decoder.cpp` (a whole dense decoder layer in one call), `repack.cpp`
(GGUF blocks -> matmul panels at load), each on raw pointers, and `bindings.cpp`, the only one
that includes torch's extension headers (the slow part of a build), which checks the tensors and
calls them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("bindings.cpp", "qmatmul.cpp", "attention.cpp", "layers.cpp", "decoder.cpp", "repack.cpp")
_HEADERS = ("common.h", "kernels.h", "vec.h")


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


def _cpu_has(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return True  # not Linux: trust the configured architecture
    return all(flag in line.split() for flag in flags)


def _build_dir(name: str) -> Path:
    root = os.environ.get("TANDEM_KERNEL_CACHE") or os.path.join(sys.prefix, "share", "tandem-kernels")
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def load() -> ModuleType:
    """The compiled module (building it first if needed). Raises KernelBuildError."""
    from torch.utils import cpp_extension

    flags = _flags()
    content = b"".join((_CSRC / name).read_bytes() for name in _SOURCES + _HEADERS)
    digest = hashlib.sha256(content + " ".join(flags).encode()).hexdigest()[:12]
    name = f"tandem_cpu_{digest}"
    build_dir = _build_dir(name)
    is_built = any(build_dir.glob(f"{name}*.so"))
    if not is_built:
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
    if not is_built:
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
