from __future__ import annotations

import math

import pytest

from controlplane.fleet.engine_metrics import Histogram, MetricsError, parse, snapshot

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 7.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.42
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 123456.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 7890.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 10.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 5.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 9.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 2.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0
"""


def test_a_vllm_scrape_is_read_and_summed_over_engines():
    snap = snapshot(VLLM_TEXT)
    assert (snap.running, snap.waiting) == (5.0, 7.0)
    assert snap.kv_cache_usage == 0.42  # older vLLM's name is understood too
    assert (snap.prompt_tokens, snap.generation_tokens, snap.requests_finished) == (123456.0, 7890.0, 15.0)
    assert snap.ttft.count == 10 and snap.ttft.total == 2.5
    assert snap.ttft.quantile(0.5) == 0.5 and snap.ttft.quantile(0.3) == 0.1
    assert snap.ttft.quantile(0.99) == math.inf


def test_the_simulators_own_scrape_reads_back():
    from workers.engines.simulator.metrics import Metrics

    metrics = Metrics("vlm")
    metrics.running, metrics.waiting, metrics.kv_usage = 2, 1, 0.25
    metrics.counters["vllm:generation_tokens_total"] = 99
    metrics.histograms["vllm:e2e_request_latency_seconds"].observe(0.3)
    snap = snapshot(metrics.render())
    assert (snap.running, snap.waiting, snap.kv_cache_usage, snap.generation_tokens) == (2, 1, 0.25, 99)
    assert snap.e2e.count == 1


# As an SGLang server exposes them: the scheduler's gauges per rank, the tokenizer manager's
# counters split by streaming, cached tokens by where the cache was.
SGLANG_TEXT = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 6.0
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.31
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.5
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{is_streaming="false",model_name="m"} 1000.0
sglang:prompt_tokens_total{is_streaming="true",model_name="m"} 600.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{is_streaming="false",model_name="m"} 300.0
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",model_name="m"} 700.0
sglang:cached_tokens_total{cache_source="host",model_name="m"} 100.0
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{is_streaming="false",model_name="m"} 12.0
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 2.0
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{is_streaming="false",le="0.1",model_name="m"} 3.0
sglang:time_to_first_token_seconds_bucket{is_streaming="true",le="0.1",model_name="m"} 1.0
sglang:time_to_first_token_seconds_bucket{is_streaming="false",le="+Inf",model_name="m"} 8.0
sglang:time_to_first_token_seconds_bucket{is_streaming="true",le="+Inf",model_name="m"} 4.0
sglang:time_to_first_token_seconds_sum{is_streaming="false",model_name="m"} 2.0
sglang:time_to_first_token_seconds_sum{is_streaming="true",model_name="m"} 1.0
sglang:time_to_first_token_seconds_count{is_streaming="false",model_name="m"} 8.0
sglang:time_to_first_token_seconds_count{is_streaming="true",model_name="m"} 4.0
"""


def test_an_sglang_scrape_is_read_under_the_same_names():
    snap = snapshot(SGLANG_TEXT)
    assert (snap.running, snap.waiting, snap.kv_cache_usage) == (4.0, 6.0, 0.31)
    assert (snap.prompt_tokens, snap.generation_tokens, snap.requests_finished) == (1600.0, 300.0, 12.0)
    # the hit rate as vLLM's counters give it: cached prompt tokens over prompt tokens
    assert snap.prefix_cache_hits / snap.prefix_cache_queries == 800 / 1600
    assert snap.preemptions == 2.0 and snap.mm_cache_queries == 0.0  # SGLang has no such cache
    assert (snap.ttft.count, snap.ttft.total) == (12.0, 3.0)
    assert snap.ttft.quantile(0.3) == 0.1 and snap.ttft.quantile(0.5) == math.inf


def test_the_simulator_reads_the_same_in_either_engines_names():
    from workers.engines.simulator.metrics import Metrics

    metrics = Metrics("vlm")
    metrics.running, metrics.waiting, metrics.kv_usage = 2, 1, 0.25
    for name, value in (("vllm:prompt_tokens_total", 500), ("vllm:generation_tokens_total", 99),
                        ("vllm:prefix_cache_queries_total", 500), ("vllm:prefix_cache_hits_total", 128),
                        ("vllm:num_preemptions_total", 3)):
        metrics.counters[name] = value
    metrics.success["stop"] = 4
    metrics.histograms["vllm:time_to_first_token_seconds"].observe(0.03)
    metrics.histograms["vllm:e2e_request_latency_seconds"].observe(0.3)
    as_vllm, as_sglang = snapshot(metrics.render("vllm")), snapshot(metrics.render("sglang"))
    assert as_sglang == as_vllm
    assert "sglang:num_running_reqs" in parse(metrics.render("sglang"))


def test_labels_with_escapes_and_timestamps_parse():
    series = parse('x{a="say \\"hi\\"",b="c\\\\d"} 1.5 1700000000000\n')
    assert series["x"] == [({"a": 'say "hi"', "b": "c\\d"}, 1.5)]


def test_garbage_is_an_error_not_a_zero():
    with pytest.raises(MetricsError):
        snapshot("this is not prometheus\n")


def test_histogram_deltas_and_restarts():
    later = Histogram(((0.1, 6.0), (math.inf, 10.0)), 3.0, 10.0)
    earlier = Histogram(((0.1, 2.0), (math.inf, 4.0)), 1.0, 4.0)
    delta = later.since(earlier)
    assert delta.buckets == ((0.1, 4.0), (math.inf, 6.0)) and delta.count == 6
    assert later.since(Histogram(((0.1, 50.0), (math.inf, 60.0)), 9.0, 60.0)) is later  # engine restarted
    assert Histogram.from_json(later.as_json()) == later
