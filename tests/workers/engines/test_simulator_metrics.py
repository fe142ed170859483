"""The simulator's /metrics: only names a real vLLM exports, in vLLM's label shape."""

from controlplane.fleet.engine_metrics import parse
from workers.engines.simulator.metrics import Metrics

# Read from a vLLM 0.32.0 CPU engine's /metrics (the sample names, _created ones left out).
VLLM_0_32_NAMES = frozenset({
    "vllm:admission_rejections_total", "vllm:cache_config_info",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum", "vllm:engine_sleep_state",
    "vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
    "vllm:estimated_write_bytes_per_gpu_total", "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_count",
    "vllm:inter_token_latency_seconds_sum", "vllm:iteration_tokens_total_bucket",
    "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum", "vllm:kv_cache_usage_perc",
    "vllm:mm_cache_hits_total", "vllm:mm_cache_queries_total", "vllm:num_preemptions_total",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason",
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
    "vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_by_source_total",
    "vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_total",
    "vllm:request_decode_time_seconds_bucket", "vllm:request_decode_time_seconds_count",
    "vllm:request_decode_time_seconds_sum", "vllm:request_generation_tokens_bucket",
    "vllm:request_generation_tokens_count", "vllm:request_generation_tokens_sum",
    "vllm:request_inference_time_seconds_bucket", "vllm:request_inference_time_seconds_count",
    "vllm:request_inference_time_seconds_sum", "vllm:request_max_num_generation_tokens_bucket",
    "vllm:request_max_num_generation_tokens_count", "vllm:request_max_num_generation_tokens_sum",
    "vllm:request_num_preemptions_bucket", "vllm:request_num_preemptions_count",
    "vllm:request_num_preemptions_sum", "vllm:request_params_max_tokens_bucket",
    "vllm:request_params_max_tokens_count", "vllm:request_params_max_tokens_sum",
    "vllm:request_params_n_bucket", "vllm:request_params_n_count", "vllm:request_params_n_sum",
    "vllm:request_prefill_kv_computed_tokens_bucket", "vllm:request_prefill_kv_computed_tokens_count",
    "vllm:request_prefill_kv_computed_tokens_sum", "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_count", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prompt_tokens_bucket", "vllm:request_prompt_tokens_count",
    "vllm:request_prompt_tokens_sum", "vllm:request_queue_time_seconds_bucket",
    "vllm:request_queue_time_seconds_count", "vllm:request_queue_time_seconds_sum",
    "vllm:request_success_total", "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_count", "vllm:request_time_per_output_token_seconds_sum",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
})
# What controlplane/fleet/engine_metrics.py reads from a scrape (under vLLM 0.32's names).
READ_BY_THE_PLATFORM = frozenset({
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
})


def _busy_metrics() -> Metrics:
    metrics = Metrics("vlm-cpu")
    for histogram in metrics.histograms.values():
        histogram.observe(0.2)
    metrics.success["length"] = 3
    return metrics


def test_it_exports_only_names_vllm_0_32_exports_and_all_the_platform_reads():
    names = {name for name in parse(_busy_metrics().render()) if not name.startswith("sim:")}
    assert names <= VLLM_0_32_NAMES, sorted(names - VLLM_0_32_NAMES)
    assert READ_BY_THE_PLATFORM <= names


def test_it_counts_finished_requests_by_each_of_vllms_reasons_with_its_labels():
    lines = [line for line in _busy_metrics().render().splitlines()
             if line.startswith("vllm:request_success_total{")]
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="vlm-cpu"} 3.0' in lines
    reasons = [labels["finished_reason"] for labels, _ in parse("\n".join(lines))["vllm:request_success_total"]]
    assert sorted(reasons) == ["abort", "error", "length", "repetition", "stop"]

