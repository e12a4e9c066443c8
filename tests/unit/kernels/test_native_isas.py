"""The kernels' other instruction-set paths, each built in a child process (TANDEM_KERNEL_ARCH):
AVX2 (x86-64-v3, what images are built for) and portable scalar code (x86-64). The quantized
matmul gives the same bits on every path for every format (on a CPU with AMX, this process's 45
rows run on its tiles), mixed-format weights included, with
int16 and int8 activations (same integer sums, same float operations per column); attention (with
and without a sliding window), RMSNorm, SiLU, GeLU-tanh and the LoRA shrink / expand agree to float
rounding. Each build is
cached, so only the first run compiles."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kernels import native
from kernels.attention import AttentionMetadata

REPO_ROOT = Path(__file__).resolve().parents[3]

# run in the child: build for the requested architecture, compute on fixed inputs, save the outputs
_CHILD = """
import sys, torch
torch.set_flush_denormal(True)
sys.path.insert(0, {root!r})
from tests.unit.kernels.test_native_isas import compute
torch.save(compute(), {out!r})
"""


def compute() -> dict[str, torch.Tensor]:
    """Every kernel on fixed inputs, with the kernels this process builds (the matmul's 45 rows in
    tiles of every length, a partial last panel, every format from random GGUF blocks and a weight
    of three formats; attention over pages of both dtypes, GQA 3, a short last tile, with and without
    sliding windows; RMSNorm over head-sized rows; SiLU and GeLU-tanh over a width with a scalar tail;
    LoRA over segments of one and many rows, inputs with a scalar tail, ranks 8 and 64, and a partial
    last tile of outputs)."""
    from kernels.lora import segments_from_slots
    from kernels.packing import pack
    from kernels.quant import QuantFormat
    from tests.unit.kernels.gguf_random import random_weight

    kernels = native.load()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(45, 512, generator=gen) * torch.rand(45, 1, generator=gen)
    out: dict[str, torch.Tensor] = {"isa": torch.tensor(list(kernels.isa().encode()))}
    weights = {fmt.name: pack(random_weight(fmt, 40, 512, seed=fmt.value)) for fmt in QuantFormat}
    formats = (QuantFormat.Q5_0, QuantFormat.Q8_0, QuantFormat.Q6_K)
    weights["mixed"] = pack([random_weight(fmt, 20 + 3 * i, 512, seed=10 + i) for i, fmt in enumerate(formats)])
    for name, weight in weights.items():
        for qmax in (32767, 127):
            out[f"qmatmul-{name}-{qmax}"] = kernels.qmatmul(x, weight.data, weight.table, qmax)
    pages, size = [[3, 0, 5], [1, 4]], 16
    meta = AttentionMetadata.build(pages, [1, 20], [37, 20], size)
    pool = torch.randn(6, 2, size, 3, 64, generator=gen)
    q = torch.randn(21, 9, 64, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        cache = pool.to(dtype)
        for window in (0, 5, 19):  # none; a window starting mid-page and mid-tile; one past a page
            out[f"attention-{dtype}-window{window}"] = kernels.paged_attention(
                q, cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, 0.125, window
            )
    out["silu"] = kernels.silu_and_mul(torch.randn(3, 2 * 37, generator=gen) * 4)
    out["gelu_tanh"] = kernels.gelu_tanh_and_mul(torch.randn(3, 2 * 37, generator=gen) * 4)
    heads = torch.randn(5, 7 * 32, generator=gen) * 3
    out["rms_norm"] = kernels.rms_norm(heads.view(-1, 32), torch.rand(32, generator=gen) + 0.5, 1e-6, None)
    segments = segments_from_slots([1, 0, -1, 2, 2, 2, 2, 2, 0])
    lora_x = torch.randn(9, 100, generator=gen)
    t = kernels.lora_shrink(lora_x, torch.randn(3, 72, 100, generator=gen) * 0.1, *segments)
    y = torch.randn(9, 120, generator=gen)
    for rank, outputs, r_offset in ((8, 37, 0), (64, 83, 8)):
        b = torch.randn(3, outputs, rank, generator=gen) * 0.05
        kernels.lora_expand(t, b, *segments, torch.tensor([0.5, 1.0, 2.0]), y, r_offset, 120 - outputs)
    out["lora_shrink"], out["lora_expand"] = t, y
    return out


@pytest.mark.parametrize(("arch", "isa"), [("x86-64-v3", "avx2"), ("x86-64", "scalar")])
def test_every_instruction_set_path_computes_what_this_one_does(arch: str, isa: str, tmp_path: Path) -> None:
    if not native._cpu_has("avx2", "fma") and arch == "x86-64-v3":
        pytest.skip("this CPU has no AVX2")
    path = tmp_path / "outputs.pt"
    env = {**os.environ, "TANDEM_KERNEL_ARCH": arch}
    script = _CHILD.format(root=str(REPO_ROOT), out=str(path))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=REPO_ROOT, timeout=900)
    theirs, ours = torch.load(path), compute()
    assert bytes(theirs["isa"].tolist()).decode() == isa
    for name, value in ours.items():
        if name.startswith("qmatmul"):
            assert torch.equal(theirs[name], value), name
        elif name != "isa":
            torch.testing.assert_close(theirs[name], value, atol=2e-6, rtol=2e-5, msg=name)


def test_a_build_in_the_cache_loads_with_no_compiler_and_no_ninja(tmp_path: Path) -> None:
    """What the worker image does: it ships the compiled module alone, without sources' build files, a
    compiler or ninja on PATH, and the kernels load from it."""
    import shutil

    name = native._build_name(native._flags())
    native.load()
    cache = tmp_path / "cache"
    (cache / name).mkdir(parents=True)
    shutil.copy2(native._cache_root() / name / f"{name}.so", cache / name)
    code = "from kernels import native; print(native.load().isa())"
    env = {**os.environ, "TANDEM_KERNEL_CACHE": str(cache), "PATH": str(tmp_path / "empty")}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == native.load().isa()
    assert sorted(path.name for path in (cache / name).iterdir()) == [f"{name}.so"]   # nothing was built


def test_a_start_killed_while_it_compiles_does_not_stop_the_next_from_building(tmp_path: Path) -> None:
    """A first start killed during its kernel build (Ctrl-C, the OOM killer) leaves torch's build lock
    file behind; the next start builds the kernels all the same instead of waiting for it forever."""
    cache = tmp_path / "cache"
    torch_lock = cache / native._build_name(native._flags()) / "lock"
    env = {**os.environ, "TANDEM_KERNEL_CACHE": str(cache)}
    code = "from kernels import native; print(native.load().isa())"
    first = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not torch_lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert torch_lock.exists()        # what the killed build left behind
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == native.load().isa()
    assert not torch_lock.exists()
