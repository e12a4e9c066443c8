"""Prefix-aware routing against round-robin on a shared-prefix workload, same workers, same run.

    python benchmarks/prefix_routing.py                  # 2 prefill + 2 decode workers, 3 rounds
    python benchmarks/prefix_routing.py --rounds 1 --prefixes 8 --questions 8

The workload: --prefixes long "system prompts" (--prefix-tokens each), each followed by --questions
different short questions, sent in a shuffled order (seeded) --concurrency at a time as token ids
(random ids, so lengths are exact), greedy, --max-new-tokens each. Each prefill worker's KV pool
(--prefill-pool-tokens) holds about half of the prefixes, as when a deployment's working set is
larger than one worker's cache. Two gateways over the same workers, one per policy; each round runs
round_robin then prefix_aware, each from empty caches. Reports, per policy: the median and p90 time to
first token (at the gateway, from the HTTP arrival), the prompt tokens served from the prefill workers'
caches, and that count over what one perfectly shared cache of unbounded size would have served (every
page-aligned prefix of an earlier prompt); then the median TTFT ratio prefix_aware / round_robin.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from cluster_runs import closed_loop, fresh, median, percentile, start_cluster, ttft_ms

POLICIES = ("round_robin", "prefix_aware")
PAGE_SIZE = 16


def workload(num_prefixes: int, prefix_tokens: int, num_questions: int, seed: int) -> list[list[int]]:
    """The prompts, shuffled: each prefix followed by a question of 16 to 32 tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(prefix_tokens)] for _ in range(num_prefixes)]
    prompts = [prefix + [rng.randrange(100, 40000) for _ in range(rng.randrange(16, 33))]
               for prefix in prefixes for _ in range(num_questions)]
    rng.shuffle(prompts)
    return prompts


def ideal_cached_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens one unbounded shared cache would serve: for each prompt, the longest page-aligned
    prefix it shares with an earlier one (a worker always computes a prompt's last token)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for ids in prompts:
        pages = [tuple(ids[: (i + 1) * PAGE_SIZE]) for i in range(len(ids) // PAGE_SIZE)]
        hit = 0
        for page in pages[: (len(ids) - 1) // PAGE_SIZE]:
            if page not in seen:
                break
            hit += PAGE_SIZE
        total += hit
        seen.update(pages)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=384)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--prefill-pool-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = workload(args.prefixes, args.prefix_tokens, args.questions, args.seed)
    ideal = ideal_cached_tokens(prompts)
    common = ["--torch-threads", str(args.torch_threads), "--context-length", "2048"]
    gateways = {p: ["--router-policy", p, "--local-prefill-threshold", "0"] for p in POLICIES}
    with tempfile.TemporaryDirectory(prefix="tandem-prefix-routing-") as run_dir:
        cluster = start_cluster(Path(run_dir), 2, 2, common, ["--max-total-tokens", str(args.prefill_pool_tokens)],
                                ["--max-total-tokens", "16384"], gateways)
        try:
            metas: dict[str, list[dict]] = {p: [] for p in POLICIES}
            for round_ in range(args.rounds):
                for policy in POLICIES:
                    fresh(cluster, cluster.gateways[policy])
                    answers = closed_loop(cluster.gateways[policy], prompts, args.concurrency, args.max_new_tokens)
                    metas[policy] += answers
                    cached = sum(m["cached_tokens"] for m in answers)
                    print(f"round {round_ + 1} {policy}: median TTFT {median(ttft_ms(answers)):.0f} ms, "
                          f"cached {cached} of ideal {ideal} tokens", flush=True)
        finally:
            cluster.stop()
    report = {}
    for policy in POLICIES:
        ttft = ttft_ms(metas[policy])
        cached = sum(m["cached_tokens"] for m in metas[policy]) / args.rounds
        report[policy] = {"median_ttft_ms": round(median(ttft), 1), "p90_ttft_ms": round(percentile(ttft, 0.9), 1),
                          "cached_tokens_per_round": round(cached), "ideal_cached_tokens": ideal,
                          "cached_fraction_of_ideal": round(cached / ideal, 3)}
    ratio = report["prefix_aware"]["median_ttft_ms"] / report["round_robin"]["median_ttft_ms"]
    print(json.dumps({"requests_per_round": len(prompts), "prompt_tokens_per_round": sum(map(len, prompts)),
                      **report, "median_ttft_ratio_prefix_aware_over_round_robin": round(ratio, 3)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
