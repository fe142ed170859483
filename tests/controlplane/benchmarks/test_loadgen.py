"""The load generator against a real simulator engine: streamed answers, timed."""

from __future__ import annotations

import asyncio
import random

from controlplane.benchmarks import loadgen
from controlplane.benchmarks.workload import Bucket, Mix, Workload


def workload(text_share=0.5):
    return Workload(Mix(text_share=text_share, buckets=(Bucket(448, 448),), prompt_tokens=(16, 16),
                        output_tokens=(12, 12)), seed=5, estimate_tokens=lambda w, h: w * h // 784 + 2)


def target(port):
    return loadgen.Target(url=f"http://127.0.0.1:{port}/v1/chat/completions", model="vlm-lite")


def test_an_open_loop_sends_its_poisson_arrivals_and_times_each_streamed_answer(engine_port):
    counter = iter(range(1000))
    spec = workload()
    stages, stopped = asyncio.run(loadgen.run_sweep(
        target(engine_port), lambda: spec.spec(next(counter)), arrival="open", levels=[20.0],
        duration_s=1.0, seed=9))
    # the arrivals are drawn from the seeded generator: the same count every time
    rng, at, expected = random.Random(9 * 7 + 0), 0.0, 0
    while (at := at + rng.expovariate(20.0)) < 1.0:
        expected += 1
    samples = stages[0]
    assert not stopped and len(samples) == expected
    assert all(s.ok for s in samples), [s.error for s in samples if not s.ok][:3]
    for s in samples:
        assert 0 < s.ttft < s.e2e
        assert s.output_tokens == 12 and len(s.itl) == 11  # every token after the first has a gap
        assert s.prompt_tokens > 0
    images = [s for s in samples if s.klass == "image"]
    assert images and all(s.image_tokens == 258 and s.prompt_tokens > 258 for s in images)


def test_a_closed_loop_keeps_its_workers_busy_and_stops_when_told(engine_port):
    counter = iter(range(10**6))
    spec = workload(text_share=1.0)
    ticks = []

    async def on_tick(progress):
        ticks.append(progress)
        return len(ticks) >= 10  # stop on the tenth tick (2 s: requests of 12 tokens end), long before 30 s

    stages, stopped = asyncio.run(loadgen.run_sweep(
        target(engine_port), lambda: spec.spec(next(counter)), arrival="closed", levels=[3, 3],
        duration_s=30.0, on_tick=on_tick, tick_s=0.2))
    assert stopped and len(stages) == 1  # the second level never started
    assert ticks == sorted(ticks) and ticks[-1] < 0.5
    assert stages[0] and all(s.ok and s.klass == "text" for s in stages[0])


def test_an_unreachable_target_gives_errors_not_exceptions():
    spec = workload()
    counter = iter(range(100))
    stages, _ = asyncio.run(loadgen.run_sweep(
        loadgen.Target(url="http://127.0.0.1:9/v1/chat/completions", model="x"),
        lambda: spec.spec(next(counter)), arrival="closed", levels=[1], duration_s=0.3))
    assert stages[0] and all(not s.ok and "ConnectError" in s.error for s in stages[0])


def test_fixed_stages_send_every_request_once_and_stop_when_told(engine_port):
    spec = workload(text_share=1.0)
    stages = [[spec.spec(n) for n in range(6)], [spec.spec(n) for n in range(6, 12)]]
    done, stopped = asyncio.run(loadgen.run_fixed(target(engine_port), stages, concurrency=3))
    assert not stopped and [sorted(s.index for s in stage) for stage in done] == [list(range(6)), list(range(6, 12))]
    assert all(s.ok and s.text for stage in done for s in stage)

    async def stop_at_once(_progress):
        return True

    many = [[spec.spec(n) for n in range(200)]]
    done, stopped = asyncio.run(loadgen.run_fixed(target(engine_port), many, concurrency=2,
                                                  on_tick=stop_at_once))
    assert stopped and len(done) == 1 and len(done[0]) < 200
