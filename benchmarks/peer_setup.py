"""What the peer benchmark needs from outside the repo, made once under a cache directory.

    <cache>/bin/llama-server-<version>   llama.cpp's server, built from the llama-cpp-python sdist
    <cache>/client-venv/                 SGLang's bench_serving and the few modules it imports
    <cache>/tokenizer/<name>/            the model's tokenizer, for bench_serving's random prompts

Each step is skipped when its result is already there, so only the first run builds or installs.
Builds run under `nice -n 19` with two jobs: the development machines have two shared cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tandem-bench"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# sglang 0.5.9 is the newest release whose bench_serving imports without torch, triton and the
# CUDA kernel packages (later releases import sglang.srt from it).
SGLANG_VERSION = "0.5.9"
CLIENT_MODULES = ["aiohttp", "numpy", "requests", "tqdm", "transformers", "pillow", "pybase64", "datasets",
                  "ipython", "pydantic"]
# Offline, CPU-only, and nothing the server does not need: no web UI (its prebuilt copy is a
# download), no HTTPS, no tests or examples; a static binary so that it can be cached on its own.
# The instruction sets are named from /proc/cpuinfo, never left to GGML_NATIVE: on the Xeons these machines
# may have, GGML_NATIVE=ON picks llama.cpp's AMX path, and that build crashes in these VMs. AMX stays off.
GGML_ISA_OPTIONS = (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
                    ("bmi2", "GGML_BMI2"), ("avx_vnni", "GGML_AVX_VNNI"), ("avx512f", "GGML_AVX512"),
                    ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
                    ("avx512_bf16", "GGML_AVX512_BF16"))
LLAMA_CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
                     "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_EXAMPLES=OFF"]
HEARTBEAT_S = 30.0


def cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists for the first core (empty where it is missing)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    line = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def llama_isa_flags(flags: set[str]) -> list[str]:
    """llama.cpp's CMake options for a CPU with `flags`: each instruction set it has, on; AMX and native, off."""
    options = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return options + [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in GGML_ISA_OPTIONS]


def say(message: str) -> None:
    print(f"[peer-bench] {message}", flush=True)


class StepFailed(RuntimeError):
    """A build, install or client command exited with an error; the message ends with its log's tail."""


def run_logged(cmd: list[str], log_path: Path, label: str, env: dict[str, str] | None = None) -> None:
    """Run `cmd` with its output in `log_path`, printing its latest line every HEARTBEAT_S seconds.

    Raises StepFailed when it exits with an error."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                try:
                    proc.wait(HEARTBEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    say(f"{label}: {time.monotonic() - start:.0f} s, {last_line(log_path)}")
        except BaseException:   # Ctrl-C: leave no build or client running behind
            proc.kill()
            proc.wait()
            raise
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise StepFailed(f"{label} failed ({proc.returncode}); log {log_path}:\n{tail}")


def last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1][:120] if lines else ""


def ensure_llama_server(cache_dir: Path, version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2) -> Path:
    """The cached llama-server binary for llama-cpp-python `version`, building it when missing."""
    isa = llama_isa_flags(cpu_flags())
    enabled = [option.split("=")[0].removeprefix("-DGGML_").lower() for option in isa[4:] if option.endswith("=ON")]
    binary = cache_dir / "bin" / f"llama-server-{version}-{'-'.join(enabled) or 'generic'}"
    if binary.is_file():
        say(f"llama-server: cached {binary}")
        return binary
    source = unpack_sdist(cache_dir, version)
    build_dir = source / "build-server"
    logs = cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    nice = ["nice", "-n", "19"]
    say(f"llama-server: building from {source / 'vendor' / 'llama.cpp'} for {', '.join(enabled)} (-j{jobs}, nice 19; "
        f"several minutes on two cores; log {logs / 'llama-build.log'})")
    start = time.monotonic()
    run_logged([*nice, "cmake", "-S", str(source / "vendor" / "llama.cpp"), "-B", str(build_dir),
                *LLAMA_CMAKE_FLAGS, *isa], logs / "llama-configure.log", "cmake configure")
    run_logged([*nice, "cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
               logs / "llama-build.log", "cmake build")
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build_dir / "bin" / "llama-server", binary)
    say(f"llama-server: built in {time.monotonic() - start:.0f} s, cached at {binary}")
    return binary


def unpack_sdist(cache_dir: Path, version: str) -> Path:
    """The unpacked llama-cpp-python `version` sdist (downloaded with pip when missing)."""
    source = cache_dir / f"llama_cpp_python-{version}"
    if (source / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return source
    sdist_dir = cache_dir / "sdist"
    archive = sdist_dir / f"llama_cpp_python-{version}.tar.gz"
    if not archive.is_file():
        say(f"llama-cpp-python {version}: downloading the sdist")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--dest", str(sdist_dir), f"llama-cpp-python=={version}"], check=True)
    say(f"llama-cpp-python {version}: unpacking {archive.name}")
    with tarfile.open(archive) as tar:
        tar.extractall(cache_dir, filter="data")
    return source


def ensure_client_python(cache_dir: Path) -> Path:
    """The python of a venv holding SGLang's bench_serving (sglang without its dependencies, plus the
    modules bench_serving imports; no torch)."""
    venv = cache_dir / "client-venv"
    python = venv / "bin" / "python"
    stamp = venv / f".stamp-sglang-{SGLANG_VERSION}"
    if stamp.is_file():
        return python
    logs = cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    say(f"bench client: installing sglang=={SGLANG_VERSION} (--no-deps) into {venv}")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    run_logged([*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"], logs / "client-sglang.log", "pip sglang")
    run_logged([*pip, *CLIENT_MODULES], logs / "client-modules.log", "pip client modules")
    subprocess.run([str(python), "-c", "import sglang.bench_serving"], check=True, env=client_env())
    stamp.touch()
    return python


def client_env() -> dict[str, str]:
    """The environment for the bench client: no hub look-ups (none is reachable)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def ensure_tokenizer(cache_dir: Path, gguf_path: Path, name: str) -> Path:
    """A tokenizer directory for `gguf_path`, saved once from the GGUF's own vocabulary."""
    directory = cache_dir / "tokenizer" / name
    if (directory / "tokenizer_config.json").is_file():
        return directory
    say(f"tokenizer: saving {gguf_path.name}'s tokenizer to {directory}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(directory)
    return directory
