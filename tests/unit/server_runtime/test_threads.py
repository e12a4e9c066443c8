"""The decode worker's thread tuner (server_runtime/threads.py) on made-up step times, the defaults that turn
it on, and the bundled model's tokens and logprobs, the same bits when the steps change thread count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from kv_transfer import TransportConfig
from launcher.defaults import default_max_torch_threads, default_torch_threads
from server_runtime.threads import ThreadTuner


class Steps:
    """Runs steps through a tuner with step times from `seconds(threads, rows)`; records the counts set."""

    def __init__(self, low: int, high: int, **settings: int) -> None:
        self.set_calls: list[int] = []
        self.tuner = ThreadTuner(low, high, set_threads=self.set_calls.append, **settings)
        self.ran_on: list[int] = []

    def run(self, count: int, rows: int, seconds) -> None:
        for _ in range(count):
            self.tuner.before_step()
            self.ran_on.append(self.tuner.threads)
            self.tuner.after_step(seconds(self.tuner.threads, rows), rows)


def test_more_threads_win_when_their_steps_are_faster_and_the_choice_holds() -> None:
    steps = Steps(1, 2, hold_steps=8, probe_steps=3)
    steps.run(40, 1, lambda threads, rows: 0.050 if threads == 1 else 0.030)
    assert steps.ran_on[:8] == [1] * 8 and steps.ran_on[8:11] == [2] * 3   # held, then probed
    assert steps.tuner.chosen() == 2 and steps.tuner.switches == 1
    assert steps.set_calls[:2] == [1, 2]
    # a later probe of 1 thread loses, goes back to 2 at once, and the next waits twice as long
    assert steps.ran_on[11:19] == [2] * 8 and steps.ran_on[19:22] == [1] * 3 and steps.ran_on[22:38] == [2] * 16


def test_a_losing_probe_doubles_the_hold() -> None:
    steps = Steps(1, 2, hold_steps=8, probe_steps=3, max_hold_steps=32)
    steps.run(200, 4, lambda threads, rows: 0.020 if threads == 1 else 0.024)
    assert steps.tuner.chosen() == 1 and steps.tuner.switches == 0
    probes = [i for i, (a, b) in enumerate(zip(steps.ran_on, steps.ran_on[1:])) if a == 1 and b == 2]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [16 + 3, 32 + 3, 32 + 3]   # hold 8 -> 16 -> 32 (the ceiling), plus each probe
    assert steps.tuner.hold_steps() == 32


def test_a_probe_across_a_batch_change_gives_no_verdict_and_the_next_waits_longer() -> None:
    steps = Steps(1, 2, hold_steps=8, probe_steps=3)
    steps.run(8, 1, lambda threads, rows: 0.050)
    steps.run(3, 2, lambda threads, rows: 0.001)   # the probe on 2 threads sees another batch: not compared
    assert steps.tuner.chosen() == 1 and steps.tuner.threads == 1 and steps.tuner.hold_steps() == 16


def test_steps_whose_rows_change_every_step_still_get_a_verdict() -> None:
    """Drafts make the rows differ from step to step (1 to 5 at one stream): each probe step is compared
    with the held count's steps of its own rows, so two threads that are faster at every row count win,
    and one thread that is faster at every row count keeps its place."""
    rows_cycle = [1, 5, 3, 5, 2, 4, 5, 1, 3]

    def run(steps: Steps, count: int, seconds) -> None:
        for i in range(count):
            steps.run(1, rows_cycle[i % len(rows_cycle)], seconds)

    faster = Steps(1, 2, hold_steps=27, probe_steps=6)
    run(faster, 33, lambda threads, rows: (0.100 + 0.040 * rows) / (1.6 if threads == 2 else 1.0))
    assert faster.tuner.chosen() == 2 and faster.tuner.switches == 1
    slower = Steps(1, 2, hold_steps=27, probe_steps=6)
    run(slower, 33, lambda threads, rows: (0.100 + 0.040 * rows) * (1.3 if threads == 2 else 1.0))
    assert slower.tuner.chosen() == 1 and slower.tuner.hold_steps() == 54   # a lost probe, not "no verdict"


def test_a_probe_is_matched_to_held_steps_of_nearly_the_same_rows() -> None:
    """At 16 streams with drafts the rows rarely repeat exactly: a probe step of 66 rows is compared with
    held steps of 64 (within 1/16), not with steps of other sizes."""
    steps = Steps(1, 2, hold_steps=8, probe_steps=3)
    steps.run(8, 64, lambda threads, rows: 0.500)
    steps.run(3, 66, lambda threads, rows: 0.300)
    assert steps.tuner.chosen() == 2
    far = Steps(1, 2, hold_steps=8, probe_steps=3)
    far.run(8, 64, lambda threads, rows: 0.500)
    far.run(3, 80, lambda threads, rows: 0.300)   # a quarter more rows: no held steps to compare with
    assert far.tuner.chosen() == 1 and far.tuner.hold_steps() == 16


def test_steps_with_kv_on_its_way_keep_their_own_choice() -> None:
    """With a prefill under way (a reservation waits for its KV), the other core is busy and one thread wins;
    without, two do; each situation learns its own and keeps it while the other runs."""
    applied: list[int] = []
    tuner = ThreadTuner(1, 2, hold_steps=8, probe_steps=3, set_threads=applied.append)
    times = {(False, 1): 0.050, (False, 2): 0.030, (True, 1): 0.060, (True, 2): 0.110}
    for step in range(400):
        waiting = (step // 50) % 2 == 1   # 50 steps alone, 50 with a prefill under way, ...
        tuner.before_step(kv_on_its_way=waiting)
        tuner.after_step(times[waiting, tuner.threads], 4)
    assert (tuner.chosen(False), tuner.chosen(True)) == (2, 1)
    assert applied.count(2) >= 4   # back to two threads each time the prefill ended


def test_a_held_count_that_slows_down_is_probed_at_once() -> None:
    """Two threads won while the machine was quiet; a burst of other work makes them slow, and the next
    window of slow steps (not the next hold) starts a probe, which one thread wins."""
    busy = False
    steps = Steps(1, 2, hold_steps=8, probe_steps=3, max_hold_steps=1024)
    quiet = {1: 0.050, 2: 0.030}
    loaded = {1: 0.055, 2: 0.120}
    steps.run(11, 1, lambda threads, rows: (loaded if busy else quiet)[threads])
    assert steps.tuner.chosen() == 2
    steps.run(300, 1, lambda threads, rows: quiet[threads])   # lost probes of 1 thread: the hold grows
    assert steps.tuner.hold_steps() >= 64
    busy = True
    before = len(steps.ran_on)
    steps.run(3 + 3, 1, lambda threads, rows: loaded[threads])
    assert steps.ran_on[before + 3 :] == [1, 1, 1] and steps.tuner.chosen() == 1


def test_bad_bounds_are_refused() -> None:
    for low, high in ((0, 2), (2, 2), (3, 2)):
        with pytest.raises(ValueError):
            ThreadTuner(low, high)


def test_a_decode_worker_tunes_up_to_the_cores_the_decode_workers_share() -> None:
    cores = default_torch_threads("prefill")
    assert default_max_torch_threads("decode") == cores
    assert default_max_torch_threads("decode", num_prefill=2, num_decode=2) == max(1, cores // 2)
    assert default_max_torch_threads("prefill") == 0


def test_the_bundled_model_gives_the_same_bits_on_any_thread_count_step_by_step(smollm2_path: Path) -> None:
    """The tuner's premise: the default engine (packed weights, fused C++ layers, bfloat16 KV) computes a
    step's tokens and logprobs to the same bits whether each step runs on one thread or alternates (no
    prefix cache, so the second run prefills again)."""
    engine = Engine(open_checkpoint(str(smollm2_path)), EngineConfig(max_total_tokens=1024), progress=False)
    prompts = [[1, *range(100 + 7 * i, 140 + 9 * i)] for i in range(4)]
    before = torch.get_num_threads()

    def generate(threads_per_step) -> list[tuple[str, int | None, float | None, tuple]]:
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, top_logprobs_num=3)
            engine.add_request(Request(f"r{i}", prompt, params))
        outputs, step = [], 0
        while engine.has_work:
            torch.set_num_threads(threads_per_step(step))
            outputs += [(o.request_id, o.token_id, o.logprob, o.top_logprobs) for o in engine.step()]
            step += 1
        return outputs

    try:
        one = generate(lambda step: 1)
        alternating = generate(lambda step: 1 + step % 2)
    finally:
        torch.set_num_threads(before)
    assert len(one) == 4 * 12 and alternating == one


def test_only_a_decode_worker_on_cpu_with_room_above_its_threads_tunes() -> None:
    from server_runtime.config import WorkerConfig
    from server_runtime.worker import thread_tuner

    def config(role: str = "decode", threads: int = 1, most: int = 2, device: str = "cpu") -> WorkerConfig:
        return WorkerConfig(role=role, model_path="m.gguf", host="127.0.0.1", port=0,
                            engine=EngineConfig(device=device), transport=TransportConfig(backend="mooncake"),
                            torch_threads=threads, max_torch_threads=most)

    tuner = thread_tuner(config())
    assert tuner is not None and (tuner.low, tuner.high, tuner.threads) == (1, 2, 1)
    assert thread_tuner(config(role="prefill")) is None
    assert thread_tuner(config(threads=2, most=2)) is None and thread_tuner(config(most=0)) is None
    assert thread_tuner(config(device="cuda")) is None
