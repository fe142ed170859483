from __future__ import annotations

import math

import pytest

from workers.engines.metrics import Histogram, MetricsError, parse, snapshot

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
