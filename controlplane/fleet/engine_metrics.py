"""Reading an engine's /metrics (Prometheus text format, vLLM's or SGLang's metric names).

Pure Python: no Django, no Celery. `parse` reads the exposition format; `snapshot` keeps the
figures the control plane uses, summed over an engine's label sets (a data-parallel vLLM
exposes one series per engine index), under the same names whichever engine exposed them:
SGLANG_NAMES says which of SGLang's metrics stands for each.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class MetricsError(ValueError):
    pass


def _value(text: str) -> float:
    if text in ("+Inf", "Inf"):
        return math.inf
    if text == "-Inf":
        return -math.inf
    try:
        return float(text)
    except ValueError:
        raise MetricsError(f"not a number: {text!r}") from None


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Metric name -> [(labels, value)] for every sample line."""
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise MetricsError(f"unreadable metrics line: {line[:120]!r}")
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\")
                  for k, v in _LABEL.findall(match.group("labels") or "")}
        series.setdefault(match.group("name"), []).append((labels, _value(match.group("value"))))
    return series


def _total(series, *names: str) -> float | None:
    for name in names:  # the first name present wins: newer vLLM names first
        if name in series:
            return sum(v for _, v in series[name])
    return None


@dataclass(frozen=True)
class Histogram:
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count)
    total: float
    count: float

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile q (what Prometheus would report)."""
        if not self.count:
            return None
        rank = q * self.count
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                return bound
        return math.inf

    def since(self, earlier: Histogram | None) -> Histogram:
        """The observations made after `earlier` (counters only grow, unless the engine restarted)."""
        if earlier is None or earlier.count > self.count:
            return self
        previous = dict(earlier.buckets)
        return Histogram(tuple((b, c - previous.get(b, 0.0)) for b, c in self.buckets),
                         self.total - earlier.total, self.count - earlier.count)

    def as_json(self) -> dict:
        return {"buckets": [[b if math.isfinite(b) else "+Inf", c] for b, c in self.buckets],
                "sum": self.total, "count": self.count}

    @classmethod
    def from_json(cls, data: dict | None) -> Histogram | None:
        if not data:
            return None
        return cls(tuple((math.inf if b == "+Inf" else float(b), float(c)) for b, c in data["buckets"]),
                   float(data["sum"]), float(data["count"]))


def _histogram(series, *names: str) -> Histogram | None:
    for name in names:
        buckets: dict[float, float] = {}
        for labels, value in series.get(f"{name}_bucket", ()):
            if "le" in labels:
                bound = _value(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
        if buckets:
            return Histogram(tuple(sorted(buckets.items())), _total(series, f"{name}_sum") or 0.0,
                             _total(series, f"{name}_count") or 0.0)
    return None


@dataclass(frozen=True)
class Snapshot:
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0  # 0..1
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    mm_cache_queries: float = 0.0
    mm_cache_hits: float = 0.0
    preemptions: float = 0.0
    requests_finished: float = 0.0
    ttft: Histogram | None = None
    e2e: Histogram | None = None
    kv_capacity_tokens: float = 0.0  # the KV cache's size in tokens, as the engine allocated it

    @property
    def progress(self) -> float:
        """A number that grows whenever the engine does any work."""
        return self.prompt_tokens + self.generation_tokens + self.requests_finished


# Snapshot field -> SGLang's metric (sglang/srt/observability/metrics_collector.py, checked
# against the package by the tests). SGLang keeps no counter of prefix-cache lookups: its
# cached prompt tokens over its prompt tokens are the hit rate vLLM's two counters give.
SGLANG_NAMES = {
    "running": "sglang:num_running_reqs",
    "waiting": "sglang:num_queue_reqs",
    "kv_cache_usage": "sglang:token_usage",
    "prompt_tokens": "sglang:prompt_tokens_total",
    "generation_tokens": "sglang:generation_tokens_total",
    "prefix_cache_queries": "sglang:prompt_tokens_total",
    "prefix_cache_hits": "sglang:cached_tokens_total",
    "preemptions": "sglang:num_retracted_requests_total",
    "requests_finished": "sglang:num_requests_total",
    "ttft": "sglang:time_to_first_token_seconds",
    "e2e": "sglang:e2e_request_latency_seconds",
}


def snapshot(text: str) -> Snapshot:
    series = parse(text)
    if any(name.startswith("sglang:") for name in series):
        return _sglang_snapshot(series)
    return Snapshot(
        running=_total(series, "vllm:num_requests_running") or 0.0,
        waiting=_total(series, "vllm:num_requests_waiting") or 0.0,
        kv_cache_usage=_total(series, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc") or 0.0,
        prompt_tokens=_total(series, "vllm:prompt_tokens_total") or 0.0,
        generation_tokens=_total(series, "vllm:generation_tokens_total") or 0.0,
        prefix_cache_queries=_total(series, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total") or 0.0,
        prefix_cache_hits=_total(series, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total") or 0.0,
        mm_cache_queries=_total(series, "vllm:mm_cache_queries_total") or 0.0,
        mm_cache_hits=_total(series, "vllm:mm_cache_hits_total") or 0.0,
        preemptions=_total(series, "vllm:num_preemptions_total") or 0.0,
        requests_finished=_total(series, "vllm:request_success_total") or 0.0,
        ttft=_histogram(series, "vllm:time_to_first_token_seconds"),
        e2e=_histogram(series, "vllm:e2e_request_latency_seconds"),
        kv_capacity_tokens=_vllm_kv_capacity(series),
    )


def _vllm_kv_capacity(series) -> float:
    """Blocks times tokens a block, from the labels of vLLM's cache_config_info (summed over a
    data-parallel engine's ranks, each with a cache of its own)."""
    total = 0.0
    for labels, _ in series.get("vllm:cache_config_info", ()):
        try:
            total += int(labels.get("num_gpu_blocks") or 0) * int(labels.get("block_size") or 0)
        except ValueError:
            continue  # "None" before the cache is allocated
    return total


def _sglang_snapshot(series) -> Snapshot:
    histograms = ("ttft", "e2e")
    return Snapshot(
        **{field: _total(series, name) or 0.0 for field, name in SGLANG_NAMES.items() if field not in histograms},
        **{field: _histogram(series, SGLANG_NAMES[field]) for field in histograms},
    )
