"""The engine on a GPU against HF transformers `generate` on the same GPU: decode tokens/s at batch 1 and 64,
and time to first token (one prompt's prefill and first token), as ratios from one run.

    python benchmarks/gpu_bench.py                                  # bundled SmolLM2, cuda, bfloat16
    python benchmarks/gpu_bench.py --model-path /models/Qwen2-0.5B-Instruct --batch-sizes 1 64 128
    python benchmarks/gpu_bench.py --disable-cuda-graph             # the engine's eager decode, for comparison
    python benchmarks/gpu_bench.py --device cpu --dtype float32 --batch-sizes 1 2 --prompt-len 16 --output-len 8

Tandem: an `Engine` in this process (no gRPC, no KV transfer), as a decode worker runs it: the device's
default attention and sampling backends (FlashInfer where installed) and CUDA-graph decode unless
--disable-cuda-graph. Decode tokens/s counts the steps after every request of the batch has its first
token, until each has --output-len. TTFT is the wall time from adding one prompt to its first token.
Peer: the same checkpoint in transformers (a GGUF dequantized by transformers' own loader), the same
dtype, `generate` greedy with a fixed number of new tokens; its decode tokens/s is
batch x (output_len - 1) over the time of generating output_len tokens less that of generating one.
Prompts are random token ids of --prompt-len (no tokenizer needed), the same for both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402
from launcher.defaults import default_model_path  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab_size, (batch, prompt_len), generator=gen).tolist()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], Any], device: str, repeats: int) -> float:
    """Median wall seconds of `run()` over `repeats` runs, the device synchronized around each."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------- Tandem


def tandem_engine(args: argparse.Namespace) -> Engine:
    max_batch = max(args.batch_sizes)
    config = EngineConfig(
        dtype=args.dtype,
        device=args.device,
        max_running_requests=max_batch,
        max_total_tokens=max_batch * (args.prompt_len + args.output_len + 16),
        max_prefill_tokens=max(8192, args.prompt_len),
        cuda_graph_batch_sizes=() if args.disable_cuda_graph else None,
    )
    return Engine(open_checkpoint(args.model_path), config, progress=False)


def _add(engine: Engine, batch: list[list[int]], max_new_tokens: int, tag: str) -> None:
    sampling = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(Request(f"{tag}-{i}", list(prompt), sampling))


def tandem_ttft(engine: Engine, args: argparse.Namespace, vocab_size: int) -> float:
    seeds = iter(range(1, 10**9))

    def first_token() -> None:   # a new prompt each time: no prefix cache hit, no request id reused
        seed = next(seeds)
        _add(engine, prompts(1, args.prompt_len, vocab_size, seed=seed), 1, f"ttft{seed}")
        while engine.has_work:
            engine.step()

    first_token()   # warm-up: lazy initialisation, kernel compiles
    return median_seconds(first_token, args.device, args.repeats)


def tandem_decode(engine: Engine, batch: int, args: argparse.Namespace, vocab_size: int) -> float:
    """Decode tokens/s of `batch` requests, from all having their first token until all have output_len."""
    _add(engine, prompts(batch, args.prompt_len, vocab_size), args.output_len, f"decode{batch}")
    produced = 0
    while produced < batch:   # prefill steps (however the scheduler splits them) until every first token
        produced += sum(out.token_id is not None for out in engine.step())
    synchronize(args.device)
    start, tokens = time.perf_counter(), 0
    while engine.has_work:
        tokens += sum(out.token_id is not None for out in engine.step())
    synchronize(args.device)
    return tokens / (time.perf_counter() - start)


# ---------------------------------------------------------------- HF transformers


def hf_model(args: argparse.Namespace) -> Any:
    path = Path(args.model_path)
    if path.suffix == ".gguf":
        from tests.hf_oracle import load_hf_gguf

        model = load_hf_gguf(path).to(DTYPES[args.dtype])
    else:
        from tests.hf_oracle import load_hf_dir

        model = load_hf_dir(path, DTYPES[args.dtype])
    return model.to(args.device)


def hf_generate(model: Any, batch: list[list[int]], num_tokens: int, device: str) -> None:
    input_ids = torch.tensor(batch, device=device)
    with torch.inference_mode():
        model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=num_tokens,
                       min_new_tokens=num_tokens, do_sample=False, pad_token_id=0)


def hf_ttft(model: Any, args: argparse.Namespace, vocab_size: int) -> float:
    batch = prompts(1, args.prompt_len, vocab_size)
    hf_generate(model, batch, 1, args.device)   # warm-up
    return median_seconds(lambda: hf_generate(model, batch, 1, args.device), args.device, args.repeats)


def hf_decode(model: Any, batch_size: int, args: argparse.Namespace, vocab_size: int) -> float:
    batch = prompts(batch_size, args.prompt_len, vocab_size)
    hf_generate(model, batch, 2, args.device)   # warm-up
    one = median_seconds(lambda: hf_generate(model, batch, 1, args.device), args.device, args.repeats)
    full = median_seconds(lambda: hf_generate(model, batch, args.output_len, args.device), args.device, 1)
    return batch_size * (args.output_len - 1) / max(full - one, 1e-9)


# ---------------------------------------------------------------- the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="HF directory or GGUF file (default: the bundled SmolLM2)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="TTFT and single-token runs per median")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="Tandem decodes eagerly")
    parser.add_argument("--no-peer", action="store_true", help="skip HF transformers")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    args.model_path = args.model_path or default_model_path()
    if args.output_len < 2 or min(args.batch_sizes) < 1:
        parser.error("--output-len must be >= 2 and batch sizes >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_flush_denormal(True)
    engine = tandem_engine(args)
    vocab_size = engine.model_config.vocab_size
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device,
        "model": args.model_path,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "cuda_graphs": engine.runner.decode_graphs is not None,
        "tandem": {"ttft_s": tandem_ttft(engine, args, vocab_size)},
    }
    report["tandem"]["decode_tokens_per_s"] = {b: tandem_decode(engine, b, args, vocab_size) for b in args.batch_sizes}
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    if not args.no_peer:
        model = hf_model(args)
        peer = {"ttft_s": hf_ttft(model, args, vocab_size),
                "decode_tokens_per_s": {b: hf_decode(model, b, args, vocab_size) for b in args.batch_sizes}}
        report["hf_transformers"] = peer
        report["ratio_tandem_over_hf"] = {
            "ttft (lower is better)": report["tandem"]["ttft_s"] / peer["ttft_s"],
            **{f"decode tokens/s at batch {b}": report["tandem"]["decode_tokens_per_s"][b]
               / peer["decode_tokens_per_s"][b] for b in args.batch_sizes},
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
