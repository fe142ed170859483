"""The simulator's continuous-batching scheduler, driven directly on a fake clock.

Steps are run by hand (intake, schedule, complete) or by the engine loop with a clock that
advances by exactly each step's duration, so every timing below is exact."""

import asyncio

import pytest

from workers.engines.simulator.metrics import Metrics
from workers.engines.simulator.scheduler import CostModel, Faults, Scheduler, SchedulerConfig
from workers.engines.simulator.sequence import ImageSpan, Sequence

COST = CostModel(prefill_us_per_token=100, encode_us_per_image_token=50, decode_ms_per_token=1,
                 step_overhead_ms=10)
OVERHEAD, PREFILL, ENCODE, DECODE = 0.010, 100e-6, 50e-6, 0.001


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    async def sleep(self, seconds):
        self.now += seconds
        await asyncio.sleep(0)


def make(clock=None, **config):
    clock = clock or FakeClock()
    return Scheduler(SchedulerConfig(**config), COST, Metrics("m"), clock=clock, sleep=clock.sleep)


def seq(prompt, out=3, priority=0, **kw):
    return Sequence(prompt, [f"t{i}" for i in range(out)], "stop", priority, **kw)


def add(scheduler, *seqs):
    """Submit without starting the engine loop (steps are run by hand)."""
    scheduler._task = object()
    for s in seqs:
        scheduler.submit(s)
    return seqs


def step(scheduler):
    scheduler.intake()
    planned = scheduler.schedule()
    scheduler.clock.now += planned.duration
    scheduler.complete(planned)
    return planned


def drain(scheduler, limit=10_000):
    for _ in range(limit):
        if not (scheduler.inbox or scheduler.waiting or scheduler.running or scheduler.aborts):
            return
        step(scheduler)
    raise AssertionError("the scheduler did not drain")


def tokens(s):
    out = []
    while not s.events.empty():
        out.append(s.events.get_nowait())
    return out


def test_chunked_prefill_spreads_a_long_prompt_over_steps_and_ttft_is_exact():
    scheduler = make(max_num_batched_tokens=100)
    (s,) = add(scheduler, seq(250, out=3))
    assert [step(scheduler).chunks[0][1] for _ in range(3)] == [100, 100, 50]
    assert s.output == 1 and s.first_token_at == pytest.approx(3 * OVERHEAD + 250 * PREFILL)
    drain(scheduler)
    assert tokens(s) == [("token", "t0"), ("token", "t1"), ("token", "t2"), ("finish", "stop")]
    assert scheduler.clock() == pytest.approx(5 * OVERHEAD + 250 * PREFILL + 2 * DECODE)
    hist = scheduler.metrics.histograms
    assert hist["vllm:time_to_first_token_seconds"].total == pytest.approx(s.first_token_at)
    assert hist["vllm:inter_token_latency_seconds"].count == 2
    assert scheduler.metrics.counters["vllm:prompt_tokens_total"] == 250
    assert scheduler.metrics.counters["vllm:generation_tokens_total"] == 3
    assert scheduler.metrics.success["stop"] == 1 and scheduler.free_blocks == scheduler.total_blocks


def test_decodes_take_their_token_of_budget_before_prefill_chunks():
    scheduler = make(max_num_batched_tokens=100)
    a, = add(scheduler, seq(20, out=5))
    step(scheduler)  # a's prefill: a now decodes
    b, = add(scheduler, seq(500))
    planned = step(scheduler)
    assert planned.decodes == [a]
    assert planned.chunks == [(b, 99)]
    assert planned.duration == pytest.approx(OVERHEAD + 99 * PREFILL + DECODE)


def test_an_image_is_encoded_in_the_step_whose_chunk_reaches_it_and_once_per_bytes():
    scheduler = make(max_num_batched_tokens=64)
    image = lambda: [ImageSpan(start=100, tokens=50, digest="d1")]  # noqa: E731
    first, = add(scheduler, seq(200, images=image()))
    durations = [step(scheduler).duration for _ in range(4)]  # chunks 64,64,64,8
    assert durations == pytest.approx([OVERHEAD + 64 * PREFILL, OVERHEAD + 64 * PREFILL + 50 * ENCODE,
                                       OVERHEAD + 64 * PREFILL, OVERHEAD + 8 * PREFILL])
    second, = add(scheduler, seq(200, images=image()))  # the same image bytes again
    drain(scheduler)
    assert (first.cached_tokens, second.cached_tokens) == (0, 0)  # encoder hits are not prefix hits
    assert (first.encoder_hit_tokens, second.encoder_hit_tokens) == (0, 50)


def test_admission_stops_at_max_num_seqs():
    scheduler = make(max_num_seqs=2)
    add(scheduler, *(seq(10) for _ in range(5)))
    step(scheduler)
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 3
    assert scheduler.metrics.running == 2 and scheduler.metrics.waiting == 3


def test_admission_needs_kv_blocks_for_the_whole_prompt_and_is_head_of_line():
    scheduler = make(kv_cache_tokens=64)  # 4 blocks
    big, bigger, small = add(scheduler, seq(40), seq(40), seq(5))  # 3, 3 and 1 blocks
    step(scheduler)
    assert scheduler.running == [big]
    assert scheduler.waiting == [bigger, small]  # small would fit, but waits its turn
    assert scheduler.metrics.kv_usage == pytest.approx(3 / 4)


def test_priority_policy_admits_lower_values_first_and_fcfs_ignores_priority():
    for policy, expected in (("priority", [2, 1, 0]), ("fcfs", [0, 1, 2])):
        scheduler = make(max_num_seqs=1, policy=policy)
        seqs = add(scheduler, seq(10, out=1, priority=5), seq(10, out=1, priority=3),
                   seq(10, out=1, priority=-1))
        order = []
        while len(order) < 3:
            step(scheduler)
            order += [i for i, s in enumerate(seqs) if s.state == "finished" and i not in order]
        assert order == expected, policy


def test_a_sequence_without_kv_room_preempts_the_latest_arrival_which_recomputes():
    scheduler = make(kv_cache_tokens=64)  # 4 blocks
    early, late = add(scheduler, seq(31, out=6), seq(31, out=6))  # 2 blocks each, full
    step(scheduler)  # both prefilled: 32 tokens each, still 2 blocks
    step(scheduler)  # each feeds its first token: 32 of 32 computed, second token out
    assert scheduler.metrics.counters["vllm:num_preemptions_total"] == 0
    step(scheduler)  # the next token needs a third block each: the later arrival yields
    assert scheduler.metrics.counters["vllm:num_preemptions_total"] == 1
    assert late.state == "waiting" and late.num_computed == 0 and late.blocks == 0
    assert scheduler.running == [early]
    drain(scheduler)
    for s in (early, late):
        assert tokens(s) == [("token", f"t{i}") for i in range(6)] + [("finish", "stop")]
    assert scheduler.metrics.counters["vllm:prompt_tokens_total"] == 62  # once per request
    assert scheduler.free_blocks == scheduler.total_blocks and scheduler.metrics.kv_usage == 0


def test_under_priority_the_preempted_sequence_is_the_lowest_priority_one():
    scheduler = make(kv_cache_tokens=64, policy="priority")
    low, high = add(scheduler, seq(31, out=6, priority=9), seq(31, out=6, priority=1))
    for _ in range(3):
        step(scheduler)
    assert low.state == "waiting" and high.state == "running"


def test_the_prefix_cache_reuses_the_leading_whole_blocks_two_prompts_share():
    scheduler = make(enable_prefix_caching=True)
    first, = add(scheduler, seq(60, block_keys=["a", "b", "c"]))  # 3 full blocks, 12 tokens over
    drain(scheduler)
    second, = add(scheduler, seq(70, block_keys=["a", "b", "x", "y"]))
    planned = step(scheduler)
    assert planned.chunks == [(second, 70 - 32)]  # "a" and "b" were computed already
    assert (first.cached_tokens, second.cached_tokens) == (0, 32)
    # What each wrote into full blocks: the first its three, the second its two new ones.
    assert (first.created_cache_tokens, second.created_cache_tokens) == (48, 32)
    counters = scheduler.metrics.counters
    assert counters["vllm:prefix_cache_queries_total"] == 130
    assert counters["vllm:prefix_cache_hits_total"] == 32


def test_the_same_prompt_again_is_cached_but_for_its_last_token():
    scheduler = make(enable_prefix_caching=True)
    for prompt, keys, cached, created in ((50, ["a", "b", "c"], 48, 0),  # 2 tokens past the blocks
                                          (48, ["d", "e", "f"], 32, 16)):  # ends on a block
        first, = add(scheduler, seq(prompt, block_keys=keys))
        drain(scheduler)
        again, = add(scheduler, seq(prompt, block_keys=keys))
        drain(scheduler)
        assert (first.cached_tokens, first.created_cache_tokens) == (0, 48)
        assert (again.cached_tokens, again.created_cache_tokens) == (cached, created)


def test_a_long_prefill_caches_its_blocks_chunk_by_chunk():
    scheduler = make(enable_prefix_caching=True, max_num_batched_tokens=40)
    keys = [f"k{i}" for i in range(6)]
    add(scheduler, seq(100, block_keys=keys))
    step(scheduler)  # 40 tokens computed: two whole blocks
    follower, = add(scheduler, seq(100, block_keys=keys))
    step(scheduler)
    assert follower.cached_tokens == 32


def test_the_block_size_sets_the_kv_blocks_and_the_cache_granularity():
    scheduler = make(enable_prefix_caching=True, block_size=128, kv_cache_tokens=2048)
    assert scheduler.total_blocks == 16
    add(scheduler, seq(1221, block_keys=[f"b{i}" for i in range(9)]))
    drain(scheduler)
    again, = add(scheduler, seq(1221, block_keys=[f"b{i}" for i in range(9)]))
    step(scheduler)
    assert again.cached_tokens == 1152 and again.blocks == 10  # vLLM on CPU: 9 x 128


def test_without_prefix_caching_nothing_is_looked_up():
    scheduler = make()
    add(scheduler, seq(60, block_keys=["a", "b", "c"]))
    drain(scheduler)
    again, = add(scheduler, seq(60, block_keys=["a", "b", "c"]))
    drain(scheduler)
    assert scheduler.metrics.counters["vllm:prefix_cache_queries_total"] == 0
    assert (again.cached_tokens, again.created_cache_tokens) == (0, 0)


def test_an_abort_frees_the_kv_and_counts_as_abort():
    scheduler = make(max_num_batched_tokens=16)
    s, = add(scheduler, seq(100))
    step(scheduler)
    assert scheduler.free_blocks < scheduler.total_blocks
    scheduler.abort(s)
    step(scheduler)
    assert s.state == "finished" and tokens(s) == [("finish", "abort")]
    assert scheduler.free_blocks == scheduler.total_blocks
    assert scheduler.metrics.success["abort"] == 1


def _run(scheduler, seqs, until):
    async def main():
        for s in seqs:
            scheduler.submit(s)
        await until()
        scheduler._task.cancel()
    asyncio.run(main())


def test_the_engine_loop_batches_decodes_of_concurrent_sequences():
    clock = FakeClock()
    scheduler = make(clock)
    seqs = [seq(10, out=20) for _ in range(8)]

    async def all_done():
        for s in seqs:
            while (await s.events.get())[0] != "finish":
                pass

    _run(scheduler, seqs, all_done)
    one_alone = OVERHEAD + 10 * PREFILL + 19 * (OVERHEAD + DECODE)
    assert clock.now == pytest.approx(OVERHEAD + 80 * PREFILL + 19 * (OVERHEAD + 8 * DECODE))
    assert clock.now < 2 * one_alone  # not 8 times
    assert scheduler.metrics.histograms["vllm:e2e_request_latency_seconds"].count == 8


def test_hang_stops_stepping_and_slow_stretches_each_step():
    clock = FakeClock()
    scheduler = make(clock)
    scheduler.set_fault(Faults("hang"))
    hung = seq(10, out=2)

    async def hang_then_slow():
        for _ in range(50):
            await asyncio.sleep(0)
        assert hung.state == "new" and scheduler.steps == 0 and clock.now == 0
        scheduler.set_fault(Faults("slow", factor=4))
        while (await hung.events.get())[0] != "finish":
            pass

    _run(scheduler, [hung], hang_then_slow)
    assert clock.now == pytest.approx(4 * (OVERHEAD + 10 * PREFILL + OVERHEAD + DECODE))
