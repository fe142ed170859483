"""Prometheus text exposition with vLLM's metric names, or SGLang's (`render(api="sglang")`)."""

from __future__ import annotations

import bisect
from collections import defaultdict

# vLLM's own bucket boundaries (vllm/v1/metrics/loggers.py, the same from 0.10 to 0.33), so
# that dashboards and quantiles read the simulator exactly as they read vLLM.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = TTFT_BUCKETS


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.total += value
        self.count += 1


FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # all exported, as vLLM's


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.kv_blocks, self.block_size = 0, 16  # the KV pool, as the scheduler sizes it
        self.counters: dict[str, float] = defaultdict(float)
        self.success: dict[str, int] = defaultdict(int)
        self.histograms = {
            "vllm:time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "vllm:inter_token_latency_seconds": Histogram(TOKEN_LATENCY_BUCKETS),
            "vllm:e2e_request_latency_seconds": Histogram(REQUEST_BUCKETS),
            "vllm:request_queue_time_seconds": Histogram(REQUEST_BUCKETS),
            "vllm:request_prefill_time_seconds": Histogram(REQUEST_BUCKETS),
            "vllm:request_decode_time_seconds": Histogram(REQUEST_BUCKETS),
        }
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        # Image requests between arrival and first token, now and at most since start: what the
        # gateway's prefill slots bound, seen from the engine (the simulator's own gauges).
        self.image_prefills = 0
        self.image_prefills_peak = 0

    def _labels(self, **extra: str) -> str:
        # In vLLM's order (prometheus_client sorts them): engine, finished_reason/le, model_name.
        labels = {"engine": "0", "model_name": self.model_name, **extra}
        return ",".join(f'{name}="{labels[name]}"' for name in sorted(labels))

    def render(self, api: str = "vllm") -> str:
        if api == "sglang":
            return self._render_sglang()
        lines, labels = [], self._labels()
        gauges = {
            "vllm:num_requests_running": self.running,
            "vllm:num_requests_waiting": self.waiting,
            "vllm:kv_cache_usage_perc": self.kv_usage,
            "sim:image_prefills": self.image_prefills,
            "sim:image_prefills_peak": self.image_prefills_peak,
        }
        for name, value in gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(value)}"]
        # vLLM's cache configuration as an info gauge: its values are labels (among them).
        lines += ["# TYPE vllm:cache_config_info gauge",
                  f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0",'
                  f'num_gpu_blocks="{self.kv_blocks}"}} 1.0']
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                     "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                     "vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total",
                     "vllm:num_preemptions_total"):
            lines += [f"# TYPE {name} counter", f"{name}{{{labels}}} {float(self.counters[name])}"]
        lines.append("# TYPE vllm:request_success_total counter")
        for reason in FINISHED_REASONS:
            lines.append(f"vllm:request_success_total{{{self._labels(finished_reason=reason)}}} "
                         f"{float(self.success[reason])}")
        for name, hist in self.histograms.items():
            lines += _histogram_lines(name, hist, labels, lambda bound: self._labels(le=bound))
        return "\n".join(lines) + "\n"

    def _render_sglang(self) -> str:
        """The same figures under SGLang's names and labels (its metrics_collector.py): the
        scheduler's gauges, the tokenizer manager's counters and histograms."""
        labels = f'engine_type="unified",model_name="{self.model_name}",pp_rank="0",tp_rank="0"'
        plain = f'model_name="{self.model_name}"'
        counters = self.counters
        lines = []
        for name, value in (("sglang:num_running_reqs", self.running), ("sglang:num_queue_reqs", self.waiting),
                            ("sglang:token_usage", self.kv_usage),
                            ("sglang:cache_hit_rate", counters["vllm:prefix_cache_hits_total"]
                             / (counters["vllm:prefix_cache_queries_total"] or 1.0))):
            lines += [f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(value)}"]
        for name, value in (("sglang:prompt_tokens_total", counters["vllm:prompt_tokens_total"]),
                            ("sglang:generation_tokens_total", counters["vllm:generation_tokens_total"]),
                            ("sglang:num_requests_total", float(sum(self.success.values()))),
                            ("sglang:num_retracted_requests_total", counters["vllm:num_preemptions_total"])):
            lines += [f"# TYPE {name} counter", f'{name}{{is_streaming="false",{plain}}} {float(value)}']
        lines += ["# TYPE sglang:cached_tokens_total counter",
                  f'sglang:cached_tokens_total{{cache_source="device",{plain}}} '
                  f'{float(counters["vllm:prefix_cache_hits_total"])}']
        for name, ours in (("sglang:time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
                           ("sglang:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds")):
            lines += _histogram_lines(name, self.histograms[ours], plain,
                                      lambda bound: f'le="{bound}",{plain}')
        return "\n".join(lines) + "\n"


def _histogram_lines(name: str, hist: Histogram, labels: str, bucket_labels) -> list[str]:
    """A histogram's exposition: cumulative buckets (labelled by `bucket_labels(bound)`), sum
    and count."""
    lines, cumulative = [f"# TYPE {name} histogram"], 0
    for bound, count in zip(hist.buckets, hist.counts, strict=True):
        cumulative += count
        lines.append(f"{name}_bucket{{{bucket_labels(str(bound))}}} {float(cumulative)}")
    lines.append(f"{name}_bucket{{{bucket_labels('+Inf')}}} {float(hist.count)}")
    lines.append(f"{name}_sum{{{labels}}} {hist.total}")
    lines.append(f"{name}_count{{{labels}}} {float(hist.count)}")
    return lines
