"""A resolution sweep: the same images, scaled down to each pixel cap, asked the same
questions; tokens, latency, cost and (for labelled items) each task type's headline metric,
with its 95 % interval, and the cost of a right answer, per cap.

Pure Python (Pillow for scaling): no Django, no Celery. The client scales each image
itself, so the sweep works through the gateway (whose policy never scales up) and directly
against an engine alike.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

from PIL import Image

from controlplane import intervals
from controlplane.benchmarks import scoring, stats
from controlplane.benchmarks.loadgen import Sample
from controlplane.benchmarks.workload import IMAGE, RequestSpec, data_url
from controlplane.gateway.rules import token_probability
from controlplane.imaging.policy import Policy, fit_within, normalise_tiles
from controlplane.metering.rating import Rates

DESCRIBE = "Describe this image."


@dataclass(frozen=True)
class Item:
    key: str
    data: bytes
    width: int
    height: int
    content_type: str = "image/jpeg"
    question: str = DESCRIBE
    task_type: str = ""  # empty: no label, so tokens, latency and cost only
    answers: tuple[str, ...] = ()


def scaled(item: Item, cap: int) -> tuple[bytes, int, int, str]:
    """The item's image within `cap` pixels (aspect kept, never enlarged)."""
    width, height = fit_within(item.width, item.height, max_pixels=cap, max_long_edge=1 << 30)
    if (width, height) == (item.width, item.height):
        return item.data, width, height, item.content_type
    with Image.open(io.BytesIO(item.data)) as image:
        image.load()
        resized = image.convert("RGBA" if image.mode in ("RGBA", "LA", "P") else "RGB").resize(
            (width, height), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    if item.content_type == "image/png":
        resized.save(buffer, "PNG")
        return buffer.getvalue(), width, height, "image/png"
    resized.convert("RGB").save(buffer, "JPEG", quality=90)
    return buffer.getvalue(), width, height, "image/jpeg"


# What an item's image becomes before the model sees it: one or more (data, width, height,
# content type), as the gateway would send them.
Variant = Callable[[Item], list[tuple[bytes, int, int, str]]]


def capped(cap: int) -> Variant:
    """The item's image within `cap` pixels, scaled by the client (a resolution sweep)."""
    return lambda item: [scaled(item, cap)]


def under_policy(policy: Policy, detail: str | None = None) -> Variant:
    """The item's image as the gateway's policy makes it (its tiles, for a long one): the
    gateway's own code, so that a policy can be judged before it serves anyone."""
    def sent(item: Item) -> list[tuple[bytes, int, int, str]]:
        return [(image.data, image.width, image.height, image.mime)
                for image in normalise_tiles(item.data, policy, detail=detail)]
    return sent


def sweep_specs(items: list[Item], caps: list[int], *, max_tokens: int,
                estimate_tokens: Callable[[int, int], int]) -> list[list[RequestSpec]]:
    """One stage per cap; request indexes run on across stages so each is unique."""
    return variant_specs(items, [capped(cap) for cap in caps], max_tokens=max_tokens,
                         estimate_tokens=estimate_tokens)


def variant_specs(items: list[Item], variants: list[Variant], *, max_tokens: int,
                  estimate_tokens: Callable[[int, int], int]) -> list[list[RequestSpec]]:
    """One stage per variant, each item's images as that variant makes them."""
    stages, index = [], 0
    for variant in variants:
        specs = []
        for item in items:
            images = variant(item)
            content = [{"type": "image_url", "image_url": {"url": data_url(data, content_type)}}
                       for data, _, _, content_type in images]
            content.append({"type": "text", "text": item.question})
            sizes = [(width, height) for _, width, height, _ in images]
            specs.append(RequestSpec(
                index=index, klass=IMAGE, images=len(images), image_pixels=sum(w * h for w, h in sizes),
                image_tokens=sum(estimate_tokens(w, h) for w, h in sizes), sizes=sizes,
                # Its tokens' log-probabilities too: any two caps of a sweep are then weighed as
                # a cascade's attempts (cascade_curve.py).
                body={"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                      "temperature": 0, "logprobs": True},
                meta={"item": item.key, "task_type": item.task_type, "answers": list(item.answers)}))
            index += 1
        stages.append(specs)
    return stages


def cap_summary(samples: list[Sample], specs: dict[int, RequestSpec], *, cap: int, rates: Rates | None) -> dict:
    """One cap's figures. Per task type: its headline metric with a 95 % interval (and POPE's
    figures for presence); an unanswered question is a wrong answer. The cost of a right
    answer is what the cap's requests cost over the right answers they got (graded scores
    count their part)."""
    ok = [s for s in samples if s.ok]
    by_task: dict[str, list[dict]] = {}
    answers = []
    for sample in samples:
        meta = specs[sample.index].meta
        task = meta.get("task_type")
        if not task:
            continue
        if sample.ok:
            result = scoring.score(sample.text, meta["answers"], task)
        else:
            result = scoring.unanswered(meta["answers"], task)
        by_task.setdefault(task, []).append(result)
        answers.append([cap, meta["item"], task, sample.text[:300], round(result["score"], 4),
                        result.get("answered", ""), _confidence(sample),
                        str(stats.request_cost(sample, rates)) if rates is not None and sample.ok else None])
    right = sum(r["score"] for results in by_task.values() for r in results)
    cost_per_right = None
    if rates is not None and by_task and right > 0:
        spent = sum((stats.request_cost(s, rates) for s in ok), Decimal("0"))
        cost_per_right = str((spent / Decimal(str(right))).quantize(Decimal("0.000001")))
    return {
        "cap": cap,
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "mean_image_tokens": round(sum(s.image_tokens for s in ok) / len(ok), 1) if ok else None,
        "mean_output_tokens": round(sum(s.output_tokens for s in ok) / len(ok), 1) if ok else None,
        "ttft": stats.distribution([s.ttft for s in ok if s.ttft is not None]),
        "e2e": stats.distribution([s.e2e for s in ok if s.e2e is not None]),
        "cost_per_image": stats.cost_per_image(ok, rates) if rates is not None else None,
        "cost_per_right_answer": cost_per_right,
        "tasks": {task: scoring.summarise(task, results) for task, results in sorted(by_task.items())},
        "overall": _set_figures([r["score"] for results in by_task.values() for r in results], samples)
        if by_task else None,
        "answers": answers,
    }


def _confidence(sample: Sample) -> float | None:
    """The answer's mean token probability (as a cascade judges it), when its logprobs came back."""
    found = token_probability(sample.logprobs) if sample.ok else None
    return None if found is None else round(found, 6)


def task_line(task: str, figures: dict) -> str:
    """A task's headline for a log line: "read ANLS 0.82 [0.75, 0.88]"."""
    name = scoring.METRIC_NAMES.get(figures.get("metric", "anls"), "")
    value = scoring.headline(figures)
    interval = figures.get("interval")
    text = f"{task} {name} {value:.2f}" if value is not None else f"{task} {name} -"
    return text + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def set_figures(samples: list, specs: dict) -> dict:
    """The mean of the items' headline scores, with its 95 % interval, and the mean image
    tokens: one figure for the whole set, each item counted once."""
    scores = []
    for sample in samples:
        meta = specs[sample.index].meta
        if not meta.get("task_type"):
            continue
        result = scoring.score(sample.text, meta["answers"], meta["task_type"]) if sample.ok \
            else scoring.unanswered(meta["answers"], meta["task_type"])
        scores.append(result["score"])
    return _set_figures(scores, samples)


def _set_figures(scores: list[float], samples: list) -> dict:
    ok = [s for s in samples if s.ok]
    interval = intervals.mean_interval(scores)
    return {"accuracy": round(sum(scores) / len(scores), 4) if scores else None,
            "interval": None if interval is None else [round(interval[0], 4), round(interval[1], 4)],
            "answered": len(ok), "items": len(samples),
            "mean_image_tokens": round(sum(s.image_tokens for s in ok) / len(ok), 1) if ok else None}
