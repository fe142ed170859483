import datetime as dt
from collections import defaultdict
from dataclasses import dataclass

from django.db import models
from django.utils import timezone

from controlplane.fleet.engine_metrics import Histogram
from controlplane.fleet.models import EngineInstance, EngineMetricSample, Node

# A health result older than this means the node agent stopped watching: route elsewhere...
HEALTH_FRESH_SECONDS = 30
# ...unless no engine anywhere was checked lately: then supervision as a whole has stopped
# (the broker that reaches the node agents is unreachable), not the engines, and those last
# found healthy stay routable for this long. (A dead engine then fails fast on connect.)
SUPERVISION_GRACE_SECONDS = 900


FAILING = ("unhealthy", "stopped", "crashed", "crashloop", "failed")


def failing_instance_ids(*, tier_id: int) -> set[int]:
    """Instances of a tier that supervision found hung, dead or gone: what is still waiting on
    one of them will get no answer. (A draining engine is not failing: it finishes its work.)"""
    return set(EngineInstance.objects.filter(tier_id=tier_id, actual_state__in=FAILING).values_list("id", flat=True))


def _routable(now: dt.datetime | None = None):
    """Instances the gateway may send work to: running, healthy, recently checked, not draining,
    and not a candidate (an engine started only to measure a proposed change)."""
    now = now or timezone.now()
    fresh = now - dt.timedelta(seconds=HEALTH_FRESH_SECONDS)
    latest = EngineInstance.objects.aggregate(latest=models.Max("last_health_at"))["latest"]
    if latest is not None and latest < fresh:
        fresh = now - dt.timedelta(seconds=SUPERVISION_GRACE_SECONDS)
    return EngineInstance.objects.filter(
        desired_state=EngineInstance.Desired.RUNNING,
        actual_state=EngineInstance.Actual.RUNNING,
        healthy=True,
        last_health_at__gte=fresh,
    ).filter(
        # launched here (a node and a port) or registered by URL (external)
        models.Q(port__isnull=False, node__isnull=False) | ~models.Q(external_url=""),
    ).exclude(pool="candidate")


def routable_instances(*, tier_id: int, now: dt.datetime | None = None):
    """The tier's instances the gateway may send work to (see _routable)."""
    return list(_routable(now).filter(tier_id=tier_id).select_related("node"))


def routable_counts(*, now: dt.datetime | None = None) -> dict[int, int]:
    """How many instances each tier may send work to now, in one query (tiers with none left out)."""
    return dict(_routable(now).order_by().values("tier_id").annotate(n=models.Count("id")).values_list("tier_id", "n"))


# vLLM takes this share of each of its GPUs' memory when the tier does not say.
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class EnginePoint:
    at: dt.datetime  # the bucket's start
    running: float  # mean over the bucket's scrapes
    waiting: float  # the queue: requests the engine has accepted but not yet scheduled
    kv_cache_usage: float  # 0-1
    tokens_per_s: float | None  # prompt and generated, from the counters' growth
    ttft_p50: float | None  # seconds, the engine's own histogram over the bucket
    ttft_p95: float | None
    prefix_hit_rate: float | None = None  # 0-1: prompt tokens its prefix cache served, of those it looked up
    mm_hit_rate: float | None = None  # 0-1: images its multimodal cache held, of those it looked up


def engine_series(*, since: dt.datetime, until: dt.datetime, bucket: dt.timedelta,
                  tier_ids: list[int] | None = None) -> dict[int, list[EnginePoint]]:
    """Per engine instance, its scrapes summarised per bucket, oldest first."""
    samples = EngineMetricSample.objects.filter(at__gte=since, at__lt=until).order_by("instance_id", "at").only(
        "instance_id", "at", "running", "waiting", "kv_cache_usage", "prompt_tokens", "generation_tokens", "ttft",
        "prefix_cache_queries", "prefix_cache_hits", "mm_cache_queries", "mm_cache_hits")
    if tier_ids is not None:
        samples = samples.filter(instance__tier_id__in=tier_ids)
    grouped: dict[tuple[int, int], list] = defaultdict(list)
    for sample in samples.iterator():
        grouped[(sample.instance_id, (sample.at - since) // bucket)].append(sample)
    series: dict[int, list[EnginePoint]] = defaultdict(list)
    previous: dict[int, object] = {}
    for (instance_id, index), rows in sorted(grouped.items(), key=lambda item: item[0]):
        before = previous.get(instance_id)
        first, last = before or rows[0], rows[-1]
        tokens = (last.prompt_tokens + last.generation_tokens) - (first.prompt_tokens + first.generation_tokens)
        elapsed = (last.at - first.at).total_seconds()
        # Counters restart with the engine: a fall is a restart, not negative work.
        rate = tokens / elapsed if elapsed > 0 and tokens >= 0 else None
        ttft = Histogram.from_json(last.ttft)
        window = ttft.since(Histogram.from_json(before.ttft) if before else None) if ttft else None
        series[instance_id].append(EnginePoint(
            since + index * bucket, _mean(r.running for r in rows), _mean(r.waiting for r in rows),
            _mean(r.kv_cache_usage for r in rows), rate, _finite(window.quantile(0.5)) if window else None,
            _finite(window.quantile(0.95)) if window else None,
            _growth_share(first, last, "prefix_cache_hits", "prefix_cache_queries"),
            _growth_share(first, last, "mm_cache_hits", "mm_cache_queries")))
        previous[instance_id] = last
    return dict(series)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _finite(value: float | None) -> float | None:
    return value if value is not None and value != float("inf") else None


@dataclass(frozen=True)
class NodeSummary:
    node: Node
    engines: dict[str, int]  # actual state: how many
    gpus: list[dict]  # index, model, memory_mib, reserved_mib (what its running engines hold)


def node_summaries() -> list[NodeSummary]:
    """Each node's engines by state, and each GPU's memory with the share its engines hold
    (vLLM reserves its memory fraction of every GPU it runs on when it starts)."""
    nodes = Node.objects.prefetch_related("gpus", "instances__gpus", "instances__tier").order_by("name")
    summaries = []
    for node in nodes:
        engines: dict[str, int] = defaultdict(int)
        reserved: dict[int, float] = defaultdict(float)
        for instance in node.instances.all():
            engines[instance.actual_state] += 1
            if instance.actual_state not in ("running", "starting", "draining", "unhealthy"):
                continue
            share = instance.tier.settings.gpu_memory_utilization or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
            for gpu in instance.gpus.all():
                reserved[gpu.pk] += share * gpu.memory_mib
        summaries.append(NodeSummary(node, dict(engines), [
            {"index": gpu.index, "model": gpu.model, "memory_mib": gpu.memory_mib,
             "reserved_mib": round(min(reserved[gpu.pk], gpu.memory_mib))} for gpu in node.gpus.all()]))
    return summaries


def _growth_share(first, last, part: str, whole: str) -> float | None:
    """What share of a counter's growth over a bucket another counter's growth is (hits of
    queries); None with nothing looked up, or across a restart (the counters fell)."""
    grew = getattr(last, whole) - getattr(first, whole)
    hits = getattr(last, part) - getattr(first, part)
    return hits / grew if grew > 0 and hits >= 0 else None
