"""A benchmark profile drawn from the traffic a tier (or one tenant on it) really served.

A load test covers the real mix only if its mix is read from usage: the share of text
requests, images per request, the source sizes of the images, prompt and output lengths, and
the arrival rate over a window. Benchmark traffic itself is left out, so a profile never
reproduces an earlier benchmark. The window's latest `SAMPLE` events are read (newest first,
along the tier's log index); the rate counts all of them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime

from controlplane.metering.models import UsageEvent, UsageImage

SAMPLE = 20_000
MAX_BUCKETS = 8
SIDE_MIN, SIDE_MAX = 16, 8192  # what a profile's size bucket may hold


class NoTraffic(ValueError):
    pass


@dataclass(frozen=True)
class Observed:
    requests: int  # in the window
    sampled: int  # read for the mix
    seconds: float
    text_share: float
    images_per_request: tuple[int, int]  # 5th and 95th percentiles of image requests
    mean_images: float
    buckets: list[dict]  # {"width", "height", "weight"}: the images' source sizes
    prompt_tokens: tuple[int, int]  # 5th and 95th percentiles of the text tokens
    output_tokens: tuple[int, int]
    rate: float  # requests per second over the window

    def summary(self) -> str:
        low, high = self.images_per_request
        return (f"{self.requests} requests in {self.seconds / 3600:.1f} h ({self.rate:.3g}/s), "
                f"{100 * self.text_share:.0f}% text, {low}–{high} images per image request "
                f"(mean {self.mean_images:.2f}), text tokens {self.prompt_tokens[0]}–{self.prompt_tokens[1]}, "
                f"output tokens {self.output_tokens[0]}–{self.output_tokens[1]}"
                + (f"; {self.sampled} latest read for the mix" if self.sampled < self.requests else ""))

    def sweep(self, multipliers: list[float]) -> list[float]:
        """Open-loop request rates: the observed rate times each multiplier."""
        return [max(0.01, round(self.rate * m, 2)) for m in multipliers]


def _percentiles(values: list[int], low: float = 0.05, high: float = 0.95) -> tuple[int, int]:
    ordered = sorted(values)

    def pick(q: float) -> int:  # the nearest-rank percentile
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return pick(low), pick(high)


def _bounded(width: int, height: int) -> tuple[int, int]:
    """A size a bucket may hold: scaled (aspect kept) into 16..8192 pixels a side."""
    if max(width, height) > SIDE_MAX:
        scale = SIDE_MAX / max(width, height)
    elif min(width, height) < SIDE_MIN:
        scale = SIDE_MIN / max(1, min(width, height))
    else:
        return width, height
    return (min(SIDE_MAX, max(SIDE_MIN, round(width * scale))),
            min(SIDE_MAX, max(SIDE_MIN, round(height * scale))))


def size_buckets(sizes: list[tuple[int, int]], limit: int = MAX_BUCKETS) -> list[dict]:
    """At most `limit` weighted sizes standing for `sizes`.

    When the images come in few sizes, each is a bucket weighted by its count. Otherwise the
    images, ordered by pixels, are cut into `limit` groups of equal count, and each group is
    the size of its median image: the distribution of pixels (what an image costs in tokens
    and KV) is kept, and groups that land on one size merge.
    """
    counts = Counter(_bounded(w, h) for w, h in sizes)
    if len(counts) > limit:
        ordered = sorted((_bounded(w, h) for w, h in sizes), key=lambda s: (s[0] * s[1], s))
        counts = Counter()
        for group in range(limit):
            start, end = group * len(ordered) // limit, (group + 1) * len(ordered) // limit
            if end > start:
                counts[ordered[(start + end - 1) // 2]] += end - start
    return [{"width": w, "height": h, "weight": n}
            for (w, h), n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]


def observe(tier, *, since: datetime, until: datetime, tenant=None, exclude_internal: bool = False) -> Observed:
    """The traffic mix of `tier` (and `tenant`) between `since` and `until`."""
    if until <= since:
        raise ValueError("the window must end after it starts")
    events = UsageEvent.objects.filter(tier=tier, created_at__gte=since, created_at__lt=until)
    if tenant is not None:
        events = events.filter(tenant=tenant)
    if exclude_internal:  # the service's own traffic (benchmarks): not what clients send
        events = events.exclude(tenant__internal=True)
    requests = events.count()
    if not requests:
        raise NoTraffic("no requests in this window")
    rows = list(events.order_by("-created_at", "-id").values_list("id", "image_count", "text_tokens",
                                                                  "output_tokens")[:SAMPLE])
    image_counts = [n for _, n, _, _ in rows if n]
    sizes = list(UsageImage.objects.filter(event_id__in=[pk for pk, n, _, _ in rows if n], tile=0)
                 .values_list("source_width", "source_height"))
    seconds = (until - since).total_seconds()
    return Observed(
        requests=requests, sampled=len(rows), seconds=seconds,
        text_share=round(1 - len(image_counts) / len(rows), 3),
        images_per_request=_percentiles(image_counts) if image_counts else (1, 1),
        mean_images=sum(image_counts) / len(image_counts) if image_counts else 0.0,
        buckets=size_buckets(sizes) if sizes else [],
        prompt_tokens=_percentiles([t for _, _, t, _ in rows]),
        output_tokens=_percentiles([max(1, o) for _, _, _, o in rows]),
        rate=requests / seconds,
    )


def profile_fields(observed: Observed, *, multipliers: list[float], stage_duration_s: float) -> dict:
    """A load profile's fields reproducing `observed`, at each multiple of its rate (the
    profile's own validation bounds the load planned)."""
    fields = {
        "kind": "load", "arrival": "open", "sweep": observed.sweep(multipliers),
        "stage_duration_s": stage_duration_s, "text_share": observed.text_share,
        "images_per_request_min": observed.images_per_request[0],
        "images_per_request_max": observed.images_per_request[1],
        "image_source": "buckets",
        "prompt_tokens_min": observed.prompt_tokens[0], "prompt_tokens_max": observed.prompt_tokens[1],
        "output_tokens_min": observed.output_tokens[0], "output_tokens_max": observed.output_tokens[1],
    }
    if observed.buckets:
        fields["image_buckets"] = observed.buckets
    return fields
