"""The C++ kernels alone, at the bundled model's shapes: CPU milliseconds of the quantized matmul and
of the paged attention, and the rates they reach.

    python benchmarks/kernels.py                  # both, one thread
    python benchmarks/kernels.py --threads 2 --only attention
    python benchmarks/kernels.py --only matmul --model-path qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

matmul: x [M, K] times the 120 projections of SmolLM2-135M's 30 layers (random Q4_1 weights, each its
own tensor so that every call reads memory as a decode step does) and, at M <= 16, its Q8_0 LM
head; M = 1, 16 and 256 (decode at batch 1 and 16, a 256-token prefill). attention: decode of 16
sequences of 300 tokens (9 query heads on 3 KV heads of 64) over 30 layers of a paged pool in
float32 and in bfloat16. With --model-path (a GGUF file), the matmul runs instead over the file's own
packed tensors, by role (every layer's `ffn_down` in turn, and so on) at M = 1, 2 and 16: what a decode
step reads. Each figure is the best of --repeats runs of the process's CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import native  # noqa: E402
from kernels.attention import AttentionMetadata  # noqa: E402

LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 30, 576, 1536, 49152
PROJECTIONS = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))


def best_of(repeats: int, run: Callable[[], None]) -> float:
    """The fastest of `repeats` runs, in CPU seconds (after one warm-up run)."""
    run()
    times = []
    for _ in range(repeats):
        started = time.process_time()
        run()
        times.append(time.process_time() - started)
    return min(times)


def bench_matmul(repeats: int) -> None:
    from kernels.packing import pack
    from kernels.quant import QuantFormat, quantize

    gen = torch.Generator().manual_seed(0)
    weights = [
        pack(quantize(torch.randn(n, k, generator=gen) * 0.05, QuantFormat.Q4_1))
        for _ in range(LAYERS)
        for n, k in PROJECTIONS
    ]
    head = pack(quantize(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05, QuantFormat.Q8_0))
    qmatmul = native.load().qmatmul
    for m in (1, 16, 256):
        inputs = {k: torch.randn(m, k, generator=gen) for k in (HIDDEN, INTERMEDIATE)}
        todo = [*weights, head] if m <= 16 else weights

        def run(todo: list = todo, inputs: dict = inputs) -> None:
            for w in todo:
                qmatmul(inputs[w.shape[1]], w.data, w.shape[0], w.bits, 32767)

        seconds = best_of(repeats, run)
        macs = m * sum(w.shape[0] * w.shape[1] for w in todo)
        weight_bytes = sum(w.num_bytes for w in todo)
        print(
            f"matmul M={m:3d}: {seconds * 1000:7.2f} ms, {macs / seconds / 1e9:5.1f} GMAC/s, "
            f"{weight_bytes / seconds / 1e9:5.1f} GB/s of weights",
            flush=True,
        )


def bench_file_matmul(path: Path, repeats: int) -> None:
    """Every quantized 2-D tensor of the GGUF file at `path`, packed as the engine packs it, grouped by
    role (the name without its layer number), each group's tensors multiplied in turn. The embedding
    table counts only where it is also the LM head."""
    import re

    import gguf
    import numpy as np

    from kernels.packing import pack_gguf_blocks
    from kernels.quant import QuantFormat
    from kernels.quant_linear import INT16_QMAX

    roles: dict[str, list] = {}
    tensors = gguf.GGUFReader(path).tensors
    untied = any(tensor.name == "output.weight" for tensor in tensors)
    for tensor in tensors:
        if tensor.tensor_type.name not in QuantFormat.__members__ or len(tensor.shape) != 2:
            continue
        if untied and tensor.name == "token_embd.weight":
            continue  # a lookup, not a matmul, where the file has its own LM head
        cols, rows = int(tensor.shape[0]), int(tensor.shape[1])
        fmt = QuantFormat[tensor.tensor_type.name]
        packed = pack_gguf_blocks(np.ascontiguousarray(tensor.data).view(np.uint8), fmt, rows, cols)
        roles.setdefault(re.sub(r"^blk\.\d+\.", "", tensor.name), []).append(packed)
    qmatmul = native.load().qmatmul
    gen = torch.Generator().manual_seed(0)
    for m in (1, 2, 16):
        for role, todo in roles.items():
            inputs = {w.shape[1]: torch.randn(m, w.shape[1], generator=gen) for w in todo}

            def run(todo: list = todo, inputs: dict = inputs) -> None:
                for w in todo:
                    qmatmul(inputs[w.shape[1]], w.data, w.table, INT16_QMAX)

            seconds = best_of(repeats, run)
            weight_bytes = sum(w.num_bytes for w in todo)
            formats = ",".join(sorted({f.name for w in todo for f in w.formats}))
            print(
                f"matmul M={m:2d} {role:22s} x{len(todo):2d} ({formats}): {seconds * 1000:7.2f} ms, "
                f"{weight_bytes / seconds / 1e9:5.1f} GB/s of weights",
                flush=True,
            )


def bench_attention(repeats: int) -> None:
    heads, kv_heads, head_dim, page_size, batch, context = 9, 3, 64, 16, 16, 300
    per_seq = -(-context // page_size)
    gen = torch.Generator().manual_seed(1)
    pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    meta = AttentionMetadata.build(pages, [1] * batch, [context] * batch, page_size)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    attend = native.load().paged_attention
    table = (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, head_dim**-0.5)
    for dtype in (torch.float32, torch.bfloat16):
        shape = (batch * per_seq, LAYERS, 2, page_size, kv_heads, head_dim)
        pool = torch.randn(shape, generator=gen).to(dtype)

        def run(pool: torch.Tensor = pool) -> None:
            for layer in range(LAYERS):
                attend(q, pool[:, layer], *table)

        seconds = best_of(repeats, run)
        kv_bytes = batch * context * LAYERS * 2 * kv_heads * head_dim * pool.element_size()
        name = str(dtype).removeprefix("torch.")
        print(
            f"attention, {name} pool, {batch} x {context} tokens x {LAYERS} layers: "
            f"{seconds * 1000:6.2f} ms, {kv_bytes / seconds / 1e9:5.1f} GB/s of KV",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["matmul", "attention"])
    parser.add_argument("--model-path", type=Path, help="a GGUF file: the matmul over its own tensors")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = native.load()
    isa = module.isa() if hasattr(module, "isa") else "this CPU (an older build)"
    print(f"kernels built for {isa}, {args.threads} thread(s)")
    if args.only != "attention":
        if args.model_path:
            bench_file_matmul(args.model_path.expanduser(), args.repeats)
        else:
            bench_matmul(args.repeats)
    if args.only != "matmul":
        bench_attention(args.repeats)


if __name__ == "__main__":
    main()
