"""A benchmark stage's figures from its samples. Pure functions: no Django, no I/O.

Latencies are reported in milliseconds. Goodput counts the requests that succeeded and met
both SLOs (time to first token, and time per output token after the first), per second of
the stage, as serving papers define it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

from controlplane.benchmarks.loadgen import Sample
from controlplane.benchmarks.workload import CLASSES
from controlplane.metering.rating import Rates, Usage, price

QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
METRICS = ("ttft", "itl", "tpot", "e2e")


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    if not 0 <= q <= 1:
        raise ValueError("q must lie between 0 and 1")
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: list[float]) -> dict:
    """p50, p90, p99 and mean in milliseconds, from values in seconds."""
    out = {name: _ms(percentile(values, q)) for name, q in QUANTILES}
    out["mean"] = _ms(sum(values) / len(values)) if values else None
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def meets_slo(sample: Sample, slo: Slo) -> bool:
    if not sample.ok or sample.ttft is None or sample.ttft * 1000 > slo.ttft_ms:
        return False
    tpot = sample.tpot
    return tpot is None or tpot * 1000 <= slo.tpot_ms


def request_cost(sample: Sample, rates: Rates) -> Decimal:
    text = max(0, sample.prompt_tokens - sample.image_tokens)
    return price(Usage(text_tokens=text, image_tokens=sample.image_tokens,
                       output_tokens=sample.output_tokens, images=sample.images), rates)


def image_cost(sample: Sample, rates: Rates) -> Decimal:
    """What the images of a request cost on their own: image tokens and per-image fees."""
    return price(Usage(image_tokens=sample.image_tokens, images=sample.images), rates)


def class_summary(samples: list[Sample], slo: Slo, duration_s: float) -> dict:
    ok = [s for s in samples if s.ok]
    summary = {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "ttft": distribution([s.ttft for s in ok if s.ttft is not None]),
        "itl": distribution([gap for s in ok for gap in s.itl]),
        "tpot": distribution([s.tpot for s in ok if s.tpot is not None]),
        "e2e": distribution([s.e2e for s in ok if s.e2e is not None]),
        "mean_prompt_tokens": _mean([s.prompt_tokens for s in ok]),
        "mean_image_tokens": _mean([s.image_tokens for s in ok]),
        "mean_output_tokens": _mean([s.output_tokens for s in ok]),
        "slo_attained": sum(meets_slo(s, slo) for s in samples),
    }
    summary["goodput_per_s"] = round(summary["slo_attained"] / duration_s, 4) if duration_s > 0 else 0.0
    return summary


def _mean(values: list[int]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def stage_summary(samples: list[Sample], *, duration_s: float, slo: Slo, rates: Rates | None = None,
                  level: float | None = None) -> dict:
    """Everything a results table shows for one stage (one load level)."""
    ok = [s for s in samples if s.ok]
    per_s = (lambda n: round(n / duration_s, 4)) if duration_s > 0 else (lambda n: 0.0)
    everything = class_summary(samples, slo, duration_s)
    summary = {
        "level": level,
        "duration_s": round(duration_s, 3),
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "error_examples": sorted({s.error for s in samples if s.error})[:5],
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "output_tokens_per_s": per_s(sum(s.output_tokens for s in ok)),
            "image_tokens_per_s": per_s(sum(s.image_tokens for s in ok)),
        },
        "goodput": {
            "requests_per_s": per_s(everything["slo_attained"]),
            "share": round(everything["slo_attained"] / len(samples), 4) if samples else None,
        },
        "all": everything,
        "classes": {
            klass: class_summary(of_class, slo, duration_s)
            for klass in CLASSES if (of_class := [s for s in samples if s.klass == klass])
        },
    }
    if rates is not None:
        summary["cost"] = cost_summary(ok, rates)
    return summary


def cost_per_image(ok: list[Sample], rates: Rates) -> str | None:
    """What an image cost on average (image tokens and fees), None without images."""
    with_images = [s for s in ok if s.images]
    images = sum(s.images for s in with_images)
    if not images:
        return None
    return str((sum(image_cost(s, rates) for s in with_images) / images).quantize(Decimal("0.000001")))


def cost_summary(ok: list[Sample], rates: Rates) -> dict:
    per_class = {}
    for klass in CLASSES:
        of_class = [s for s in ok if s.klass == klass]
        if of_class:
            per_class[klass] = str((sum(request_cost(s, rates) for s in of_class) / len(of_class))
                                   .quantize(Decimal("0.000001")))
    return {
        "per_image": cost_per_image(ok, rates),
        "per_request": per_class,
        "total": str(sum((request_cost(s, rates) for s in ok), Decimal("0"))),
    }


def sample_row(sample: Sample) -> list:
    """A compact row for the stored results: [stage, class, start, ok, ttft, tpot, e2e, out, img]."""
    def r(v):
        return None if v is None else round(v, 5)
    return [sample.stage, sample.klass, r(sample.started), sample.ok, r(sample.ttft), r(sample.tpot),
            r(sample.e2e), sample.output_tokens, sample.image_tokens]
