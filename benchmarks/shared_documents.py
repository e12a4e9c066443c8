"""Questions over shared long documents, spread over two prefill workers, with and without a KV tier both
workers share (issue 27): how many prompt tokens the prefill workers compute.

    python benchmarks/shared_documents.py                       # 8 documents x 6 questions, both policies
    python benchmarks/shared_documents.py --documents 4 --questions 4 --policies round_robin

The workload (seeded): --documents documents of --document-tokens random token ids, each asked
--questions questions of 16 to 48 ids (the document, then the question), in a shuffled order,
--concurrency at a time, greedy, --max-new-tokens each, as token ids to /generate. Each prefill worker's
pool (--prefill-pool-tokens) holds about half of the documents, as when a deployment's documents
outgrow one worker's cache.

For each router policy (--policies; round_robin spreads every document over both prefill workers, prefix_aware
keeps each on one while its load allows), two phases, each on a fresh cluster of 2 prefill + 2 decode workers
(the bundled SmolLM2): "before" with the prefix cache in each worker's pool alone (today's), "after" with one
--kv-disk-cache-dir all four workers share (or, with --shared-tier store, one `tandem kv-store`), so a
document one prefill worker computed (or evicted) is read back by any of them. Reported per phase: the prompt
tokens the prefill workers computed (prompt tokens less those served from a cache, `meta_info.cached_tokens`),
the median time to first token, and the ratio after / before of the tokens computed (issue 27's target: at
most 0.55x); and whether every answer is the same in both phases.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster_runs import generate_reply, kv_store, median, start_cluster


def workload(num_documents: int, document_tokens: int, num_questions: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    documents = [[rng.randrange(100, 40000) for _ in range(document_tokens)] for _ in range(num_documents)]
    prompts = [
        doc + [rng.randrange(100, 40000) for _ in range(rng.randrange(16, 49))]
        for doc in documents
        for _ in range(num_questions)
    ]
    rng.shuffle(prompts)
    return prompts


def run_phase(
    args: argparse.Namespace, policy: str, shared: list[str], run_dir: Path, prompts: list[list[int]]
) -> dict:
    """One phase on a fresh cluster; `shared`: the workers' flags for the tier they share (none: [])."""
    common = ["--torch-threads", str(args.torch_threads), "--context-length", "2048", *shared]
    gateway = ["--router-policy", policy, "--local-prefill-threshold", "0"]
    cluster = start_cluster(
        run_dir,
        2,
        2,
        common,
        ["--max-total-tokens", str(args.prefill_pool_tokens)],
        ["--max-total-tokens", "16384"],
        {policy: gateway},
    )
    try:
        url = cluster.gateways[policy]
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(lambda ids: generate_reply(url, ids, args.max_new_tokens), prompts))
    finally:
        cluster.stop()
    metas = [a["meta_info"] for a in answers]
    prompt_tokens = sum(map(len, prompts))
    cached = sum(m["cached_tokens"] for m in metas)
    return {
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "computed_tokens": prompt_tokens - cached,
        "median_ttft_ms": round(median([m["tandem_timings"]["first_token_ms"] for m in metas]), 1),
        "outputs": [a["output_ids"] for a in answers],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--document-tokens", type=int, default=512)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--prefill-pool-tokens", type=int, default=2048)
    parser.add_argument("--policies", nargs="+", default=["round_robin", "prefix_aware"])
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shared-tier",
        choices=["disk", "store"],
        default="disk",
        help='what "after" shares: one --kv-disk-cache-dir, or a `tandem kv-store` (--kv-store)',
    )
    args = parser.parse_args()
    prompts = workload(args.documents, args.document_tokens, args.questions, args.seed)
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-shared-documents-") as run_dir:
        for policy in args.policies:
            phases = {}
            for phase in ("before", "after"):
                phase_dir = Path(run_dir) / f"{policy}-{phase}"
                phase_dir.mkdir()
                if phase == "before":
                    phases[phase] = run_phase(args, policy, [], phase_dir, prompts)
                elif args.shared_tier == "disk":
                    phases[phase] = run_phase(
                        args, policy, ["--kv-disk-cache-dir", str(phase_dir / "kv-disk")], phase_dir, prompts
                    )
                else:
                    with kv_store(phase_dir) as address:
                        phases[phase] = run_phase(args, policy, ["--kv-store", address], phase_dir, prompts)
                print(
                    f"{policy} {phase}: computed {phases[phase]['computed_tokens']} of "
                    f"{phases[phase]['prompt_tokens']} prompt tokens, median TTFT "
                    f"{phases[phase]['median_ttft_ms']} ms",
                    flush=True,
                )
            before, after = phases["before"], phases["after"]
            report[policy] = {
                **{f"{p}_{k}": v for p, r in phases.items() for k, v in r.items() if k != "outputs"},
                "computed_after_over_before": round(after["computed_tokens"] / max(1, before["computed_tokens"]), 3),
                "differing_answers": sum(a != b for a, b in zip(before["outputs"], after["outputs"], strict=True)),
            }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
