"""Conditional disaggregation against always-disaggregate on a mixed workload, same workers, same run.

    python benchmarks/conditional_disagg.py                       # 2 prefill + 2 decode workers
    python benchmarks/conditional_disagg.py --threshold 32 --rate 1.0 --rounds 1

The workload: --requests prompts, half short (8 to 24 tokens), half long (--long-tokens, +-10%), as
random token ids, arriving in a Poisson process at --rate requests/s (seeded: both configurations get
the same prompts at the same moments, so they serve the same throughput if both keep up), greedy,
--max-new-tokens each. Two gateways over the same workers: `always` (--local-prefill-threshold 0) and
`conditional` (--local-prefill-threshold --threshold: shorter prompts are prefilled by their decode
worker, with no KV transfer). Each round runs both, each from empty caches. Reports, per configuration:
the achieved throughput (requests and output tokens per second over the phase), and the median and
p90 time to first token (at the gateway) over all requests, the short ones and the long ones (and the
mean: with two kinds of prompt, the median of all of them says little).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from statistics import fmean as mean

from cluster_runs import fresh, median, open_loop, percentile, start_cluster, ttft_ms

CONFIGS = ("always", "conditional")


def workload(num_requests: int, long_tokens: int, rate: float, seed: int) -> tuple[list[list[int]], list[float]]:
    """The prompts (short and long alternating at random) and their arrival times in seconds."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_requests):
        length = rng.randrange(8, 25) if rng.random() < 0.5 else rng.randrange(int(0.9 * long_tokens),
                                                                                 int(1.1 * long_tokens) + 1)
        prompts.append([rng.randrange(100, 40000) for _ in range(length)])
    arrivals, at = [], 0.0
    for _ in range(num_requests):
        at += rng.expovariate(rate)
        arrivals.append(at)
    return prompts, arrivals


def summary(metas: list[dict], prompts: list[list[int]], threshold: int, seconds: float, max_new_tokens: int) -> dict:
    short = [m for m, p in zip(metas, prompts) if len(p) < threshold]
    long = [m for m, p in zip(metas, prompts) if len(p) >= threshold]
    local = sum(m["tandem_timings"]["prefill_path"] == "local" for m in metas)
    return {
        "requests_per_s": round(len(metas) / seconds, 3),
        "output_tokens_per_s": round(len(metas) * max_new_tokens / seconds, 1),
        "prefilled_locally": local,
        **{f"{name}_ttft_ms": {"median": round(median(ttft_ms(group)), 1), "mean": round(mean(ttft_ms(group)), 1),
                               "p90": round(percentile(ttft_ms(group), 0.9), 1), "n": len(group)}
           for name, group in (("all", metas), ("short", short), ("long", long))},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--long-tokens", type=int, default=288)
    parser.add_argument("--threshold", type=int, default=64, help="the conditional gateway's --local-prefill-threshold")
    parser.add_argument("--rate", type=float, default=0.8, help="arrivals per second")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts, arrivals = workload(args.requests, args.long_tokens, args.rate, args.seed)
    gateways = {"always": ["--local-prefill-threshold", "0"],
                "conditional": ["--local-prefill-threshold", str(args.threshold)]}
    common = ["--torch-threads", str(args.torch_threads), "--context-length", "2048", "--max-total-tokens", "16384"]
    metas: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    seconds: dict[str, float] = {c: 0.0 for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="tandem-conditional-") as run_dir:
        cluster = start_cluster(Path(run_dir), 2, 2, common, [], [], gateways)
        try:
            for round_ in range(args.rounds):
                for config in CONFIGS:
                    fresh(cluster, cluster.gateways[config])
                    started = time.perf_counter()
                    answers = open_loop(cluster.gateways[config], prompts, arrivals, args.max_new_tokens)
                    seconds[config] += time.perf_counter() - started
                    metas[config] += answers
                    print(f"round {round_ + 1} {config}: median TTFT {median(ttft_ms(answers)):.0f} ms "
                          f"over {time.perf_counter() - started:.1f} s", flush=True)
        finally:
            cluster.stop()
    every = prompts * args.rounds
    report = {c: summary(metas[c], every, args.threshold, seconds[c], args.max_new_tokens) for c in CONFIGS}
    ratios = {f"{group}_{stat}": round(report["conditional"][f"{group}_ttft_ms"][stat]
                                      / report["always"][f"{group}_ttft_ms"][stat], 3)
              for group in ("all", "short", "long") for stat in ("median", "mean")}
    print(json.dumps({"requests_per_round": len(prompts), "offered_rate_per_s": args.rate,
                      "threshold_tokens": args.threshold, **report,
                      "ttft_ratio_conditional_over_always": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
