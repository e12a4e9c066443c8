"""Multi-turn chat with and without the decode workers' prefix cache (issue 27), each on fresh workers.

    python benchmarks/multi_turn.py --conversations 4 --turns 3          # a smoke run: 1.5 min on 2 CPU cores
    python benchmarks/multi_turn.py                                      # 16 chats x 4 turns
    python benchmarks/multi_turn.py --conversations 32 --turns 6 --json multi_turn.json   # the issue's size

The defaults are smaller than issue 27's 32 x 6 so that a run fits a shared 2-core machine (the smoke
run serves about 1.6 s per turn per phase at 4 chats at once; 32 x 6 has 3x the turns of 16 x 4, with
longer prompts); give the issue's size as flags where the cores allow.

The workload (seeded, so both phases get the same one): --conversations chats of --turns turns each,
all opening with one shared --system-tokens system prompt. Turn 1's prompt is the system prompt and a
user message of 16 to 48 random token ids; turn k+1's is turn k's prompt, turn k's output ids and a new
user message. Each turn is one greedy /generate of token ids, exactly --max-new-tokens out (eos
ignored). --concurrency chats run at once; a chat's turns run in order.

Three phases, each on its own fresh cluster of --prefill-workers + --decode-workers processes (the
bundled SmolLM2, the workers' default model) and one gateway with `--router-policy prefix_aware
--local-prefill-threshold --threshold`: "before" starts the decode workers with
--disable-decode-prefix-cache and no disk tier (every handoff sends the whole prompt's KV: the system
as it was), "after" without it and with a shared --kv-disk-cache-dir (decode keeps what it served, so a
next turn needs only its new tokens' KV, or none when the gateway prefills it on the decode worker),
"restarted" on new workers over the disk tier "after" filled (the same workload again: its prompts'
pages come back from disk instead of being computed). With --shared-tier store, "after" and "restarted"
share one `tandem kv-store` (started once, so it outlives the workers) instead of the directory.

Reports, per phase: median and p90 time to first token (the gateway's `tandem_timings.first_token_ms`)
of turn 1 and of turns >= 2; the median KV bytes sent per turn >= 2 (0 for a turn prefilled on its
decode worker); how many turns went local and disaggregated; the sum of `decode_cached_tokens` where the
gateway reports it. Then the ratios after / before (issue 27's targets: TTFT of turns >= 2 at most
0.3x, KV bytes per turn at most 0.2x), the share of the cacheable prompt tokens (full pages of prompts
an earlier phase computed) served from a cache (target after the restart: at least 0.8), and how many
turns' output ids differ between the phases (greedy output must not change: 0). A markdown table on
stdout; --json writes the figures and every turn's record.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster_runs import generate_reply, kv_store, median, percentile, start_cluster

from tests.e2e.cluster_stack import assert_no_pages_held

PHASES = ("before", "after", "restarted")
PHASE_DECODE_FLAGS = {"before": ["--disable-decode-prefix-cache"], "after": [], "restarted": []}
PAGE_SIZE = 16


@dataclass(frozen=True, slots=True)
class Workload:
    """The shared system prompt and each chat's user messages (token ids), fixed by the seed."""

    system_ids: list[int]
    user_ids: list[list[list[int]]]  # [conversation][turn]


@dataclass(frozen=True, slots=True)
class Turn:
    """One answered turn: what the gateway reported about it and the ids it generated."""

    conversation: int
    turn: int  # from 1
    prompt_len: int
    output_ids: list[int]
    ttft_ms: float
    kv_bytes: int
    prefill_path: str
    cached_tokens: int
    decode_cached_tokens: int | None  # None where this gateway does not report it
    client_seconds: float


def workload(num_conversations: int, num_turns: int, system_tokens: int, seed: int) -> Workload:
    rng = random.Random(seed)
    system_ids = [rng.randrange(100, 40000) for _ in range(system_tokens)]
    user_ids = [
        [[rng.randrange(100, 40000) for _ in range(rng.randrange(16, 49))] for _ in range(num_turns)]
        for _ in range(num_conversations)
    ]
    return Workload(system_ids, user_ids)


def run_conversation(url: str, work: Workload, conversation: int, max_new_tokens: int) -> list[Turn]:
    """The chat's turns in order, each prompt the previous prompt + its output + the next user message."""
    turns: list[Turn] = []
    history = list(work.system_ids)
    for index, user_ids in enumerate(work.user_ids[conversation]):
        prompt = history + user_ids
        try:
            answer = generate_reply(url, prompt, max_new_tokens)
        except Exception as exc:
            raise RuntimeError(f"conversation {conversation} turn {index + 1}: {exc}") from exc
        meta = answer["meta_info"]
        timings = meta.get("tandem_timings")
        if timings is None or len(answer["output_ids"]) != max_new_tokens:
            raise RuntimeError(
                f"conversation {conversation} turn {index + 1}: {len(answer['output_ids'])} "
                f"output ids of {max_new_tokens}, timings {timings}"
            )
        decode_cached = timings.get("decode_cached_tokens", meta.get("decode_cached_tokens"))
        turns.append(
            Turn(
                conversation,
                index + 1,
                len(prompt),
                answer["output_ids"],
                timings["first_token_ms"],
                timings["kv_bytes"],
                timings["prefill_path"],
                meta["cached_tokens"],
                decode_cached,
                meta["client_seconds"],
            )
        )
        history = prompt + answer["output_ids"]
    return turns


def run_phase(
    phase: str, args: argparse.Namespace, work: Workload, run_dir: Path, store: str | None
) -> tuple[list[Turn], float]:
    """Every chat through a fresh cluster for `phase`; the turns (by conversation, then turn) and the
    seconds the chats took. `store`: the `tandem kv-store` the workers share after "before" (--shared-tier store)."""
    context_len = max(2048, args.system_tokens + args.turns * (48 + args.max_new_tokens) + 64)
    common = [
        "--torch-threads",
        str(args.torch_threads),
        "--context-length",
        str(context_len),
        "--max-total-tokens",
        str(args.pool_tokens),
    ]
    if phase != "before":  # "restarted" starts new workers over the tier "after" filled
        common += ["--kv-store", store] if store else ["--kv-disk-cache-dir", str(run_dir / "kv-disk")]
    gateway = ["--router-policy", "prefix_aware", "--local-prefill-threshold", str(args.threshold)]
    phase_dir = run_dir / phase
    phase_dir.mkdir()
    started = time.perf_counter()
    cluster = start_cluster(
        phase_dir,
        args.prefill_workers,
        args.decode_workers,
        common,
        [],
        [*PHASE_DECODE_FLAGS[phase], *args.decode_flag],
        {phase: gateway},
    )
    print(f"{phase}: cluster ready in {time.perf_counter() - started:.0f} s", flush=True)
    try:
        url = cluster.gateways[phase]
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            chats = list(
                pool.map(lambda c: run_conversation(url, work, c, args.max_new_tokens), range(args.conversations))
            )
        seconds = time.perf_counter() - started
        assert_no_pages_held(cluster.services.worker_ports, within_s=30)
    except BaseException:
        print(f"{phase} failed; the processes' logs:\n{cluster.services.logs()}", file=sys.stderr)
        raise
    finally:
        cluster.stop()
    print(f"{phase}: {args.conversations} chats x {args.turns} turns in {seconds:.0f} s", flush=True)
    return [turn for chat in chats for turn in chat], seconds


def summary(turns: list[Turn], seconds: float) -> dict:
    first = [t for t in turns if t.turn == 1]
    later = [t for t in turns if t.turn >= 2]
    reported = [t.decode_cached_tokens for t in turns if t.decode_cached_tokens is not None]
    return {
        "seconds": round(seconds, 1),
        "turn1_ttft_ms": {
            "median": median([t.ttft_ms for t in first]),
            "p90": percentile([t.ttft_ms for t in first], 0.9),
            "n": len(first),
        },
        "later_ttft_ms": {
            "median": median([t.ttft_ms for t in later]),
            "p90": percentile([t.ttft_ms for t in later], 0.9),
            "n": len(later),
        },
        "later_median_kv_bytes": median([t.kv_bytes for t in later]),
        "local_turns": sum(t.prefill_path == "local" for t in turns),
        "disaggregated_turns": sum(t.prefill_path == "disaggregated" for t in turns),
        "cached_tokens": sum(t.cached_tokens for t in turns),
        # every full page of every prompt but its last token was computed in an earlier phase
        "cacheable_tokens": sum((t.prompt_len - 1) // PAGE_SIZE * PAGE_SIZE for t in turns),
        "decode_cached_tokens": sum(reported) if reported else None,
        "median_ttft_ms_by_turn": {
            k: median([t.ttft_ms for t in turns if t.turn == k]) for k in sorted({t.turn for t in turns})
        },
    }


def ratio(after: float, before: float) -> float:
    return after / before if before else math.nan


def no_nan(value: object) -> object:
    """`value` with every NaN (a median of nothing, a ratio over 0) as None, so the JSON file is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [no_nan(v) for v in value]
    return value


def report(results: dict[str, dict], turns: dict[str, list[Turn]]) -> dict:
    before, after = results["before"], results["after"]
    differing = sum(b.output_ids != a.output_ids for b, a in zip(turns["before"], turns["after"], strict=True))
    return {
        "later_median_ttft": ratio(after["later_ttft_ms"]["median"], before["later_ttft_ms"]["median"]),
        "later_p90_ttft": ratio(after["later_ttft_ms"]["p90"], before["later_ttft_ms"]["p90"]),
        "turn1_median_ttft": ratio(after["turn1_ttft_ms"]["median"], before["turn1_ttft_ms"]["median"]),
        "later_median_kv_bytes": ratio(after["later_median_kv_bytes"], before["later_median_kv_bytes"]),
        "differing_turns": differing
        + sum(a.output_ids != r.output_ids for a, r in zip(turns["after"], turns["restarted"], strict=True)),
        "restarted_cached_share": results["restarted"]["cached_tokens"]
        / max(1, results["restarted"]["cacheable_tokens"]),
        "after_cached_share": after["cached_tokens"] / max(1, after["cacheable_tokens"]),
    }


def markdown(results: dict[str, dict], ratios: dict, num_turns: int) -> str:
    """The per-phase table, then the ratios and the greedy check."""

    def cell(value: float | None, digits: int = 0) -> str:
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"

    rows = [
        "| phase | turn 1 TTFT ms median / p90 | turns >= 2 TTFT ms median / p90 | KV bytes per turn >= 2 "
        "(median) | local / disaggregated | decode cached tokens | cached / cacheable tokens |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for phase in PHASES:
        r = results[phase]
        rows.append(
            f"| {phase} | {cell(r['turn1_ttft_ms']['median'])} / {cell(r['turn1_ttft_ms']['p90'])} | "
            f"{cell(r['later_ttft_ms']['median'])} / {cell(r['later_ttft_ms']['p90'])} | "
            f"{cell(r['later_median_kv_bytes'])} | {r['local_turns']} / {r['disaggregated_turns']} | "
            f"{cell(r['decode_cached_tokens'])} | {r['cached_tokens']} / {r['cacheable_tokens']} |"
        )
    rows.append("")
    rows.append(
        f"after / before: TTFT of turns >= 2 median **{cell(ratios['later_median_ttft'], 3)}x** "
        f"(target <= 0.3), p90 {cell(ratios['later_p90_ttft'], 3)}x; KV bytes per turn >= 2 "
        f"**{cell(ratios['later_median_kv_bytes'], 3)}x** (target <= 0.2); turn 1 TTFT "
        f"{cell(ratios['turn1_median_ttft'], 3)}x"
    )
    rows.append(
        f"prompt tokens served from a cache over the cacheable ones (full pages of prompts an earlier phase "
        f"computed): after {cell(ratios['after_cached_share'], 3)}, restarted (every worker new, over the shared "
        f"tier) **{cell(ratios['restarted_cached_share'], 3)}** (target >= 0.8)"
    )
    rows.append(f"output ids differing between the phases: {ratios['differing_turns']} of {2 * num_turns} turn pairs")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4, help="chats at once")
    parser.add_argument("--threshold", type=int, default=256, help="the gateway's --local-prefill-threshold")
    parser.add_argument("--prefill-workers", type=int, default=2)
    parser.add_argument("--decode-workers", type=int, default=2)
    parser.add_argument("--pool-tokens", type=int, default=16384, help="each worker's --max-total-tokens")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures and every turn's record here")
    parser.add_argument(
        "--shared-tier",
        choices=["disk", "store"],
        default="disk",
        help='what "after" and "restarted" share: a --kv-disk-cache-dir, or one `tandem kv-store` (--kv-store) '
        "that outlives the workers",
    )
    parser.add_argument(
        "--decode-flag",
        action="append",
        default=[],
        help="one more flag for every phase's decode workers (repeat it; e.g. --decode-flag=--max-decode-slowdown=0)",
    )
    args = parser.parse_args()
    work = workload(args.conversations, args.turns, args.system_tokens, args.seed)
    turns: dict[str, list[Turn]] = {}
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as held:
        run_dir = Path(held.enter_context(tempfile.TemporaryDirectory(prefix="tandem-multi-turn-")))
        store = held.enter_context(kv_store(run_dir)) if args.shared_tier == "store" else None
        for phase in PHASES:
            turns[phase], seconds = run_phase(phase, args, work, run_dir, store)
            results[phase] = summary(turns[phase], seconds)
    ratios = report(results, turns)
    print(markdown(results, ratios, len(turns["before"])))
    if args.json:
        figures = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **results,
            "after_over_before": ratios,
            "turns": {p: [asdict(t) for t in turns[p]] for p in PHASES},
        }
        args.json.write_text(json.dumps(no_nan(figures), indent=1, allow_nan=False))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
