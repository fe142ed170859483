"""A cascade's threshold, chosen from evidence: from one evaluation of the cheap attempt (its
answers' token probability and score per item) and one of the strong (its score per item),
what each threshold would give, accuracy against cost, without running the cascade at each.

At threshold t an item keeps the cheap answer when its probability is at least t, else pays
for both attempts and gets the strong answer. Cost is what was billed per request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from controlplane import intervals

ALWAYS = math.inf  # a threshold no answer meets, however sure: every request escalated


@dataclass(frozen=True)
class Item:
    confidence: float | None  # the cheap answer's token probability (None: unknown, escalated)
    cheap_score: float
    cheap_cost: Decimal
    strong_score: float
    strong_cost: Decimal
    cut_short: bool = False  # the cheap answer stopped at max_tokens (escalated on length)


@dataclass(frozen=True)
class Point:
    threshold: float
    accuracy: float
    interval: tuple[float, float] | None
    cost_per_1000: Decimal
    escalated: float  # the share of requests that paid for both attempts

    @property
    def always(self) -> bool:
        return self.threshold == ALWAYS


def point(items: Sequence[Item], threshold: float, *, on_length: bool = True) -> Point:
    scores, cost, escalated = [], Decimal(0), 0
    for item in items:
        escalate = item.confidence is None or item.confidence < threshold or (on_length and item.cut_short)
        if escalate:
            escalated += 1
            scores.append(item.strong_score)
            cost += item.cheap_cost + item.strong_cost
        else:
            scores.append(item.cheap_score)
            cost += item.cheap_cost
    n = len(items)
    return Point(threshold=threshold, accuracy=sum(scores) / n, interval=intervals.mean_interval(scores),
                 cost_per_1000=cost * 1000 / n, escalated=escalated / n)


def curve(items: Sequence[Item], thresholds: Sequence[float] | None = None, *, on_length: bool = True) -> list[Point]:
    """A point per threshold: by default 0 (never escalate on probability), each item's own
    probability (where the curve changes) and ALWAYS (every request escalated, however sure)."""
    if thresholds is None:
        thresholds = sorted({0.0, ALWAYS, *(i.confidence for i in items if i.confidence is not None)})
    return [point(items, t, on_length=on_length) for t in thresholds]


def cheapest_within(points: Sequence[Point], accuracy: float) -> Point | None:
    """The cheapest point whose accuracy is at least `accuracy`."""
    meeting = [p for p in points if p.accuracy >= accuracy]
    return min(meeting, key=lambda p: (p.cost_per_1000, -p.accuracy)) if meeting else None


def run_items(results: dict, cheap_cap: int, strong_cap: int) -> list[Item]:
    """The items of a resolution sweep's run asked at both caps, each with what it got and cost
    at each; those without a probability or a cost at either are left out."""
    answers = {(row[0], row[1]): row for cap in results.get("caps") or [] for row in cap.get("answers") or []
               if len(row) >= 8}
    found = []
    for (cap, key), cheap in answers.items():
        strong = answers.get((strong_cap, key))
        if cap != cheap_cap or strong is None or None in (cheap[6], cheap[7], strong[7]):
            continue
        found.append(Item(confidence=cheap[6], cheap_score=cheap[4], cheap_cost=Decimal(cheap[7]),
                          strong_score=strong[4], strong_cost=Decimal(strong[7])))
    return found


def weighed_caps(results: dict) -> list[int]:
    """The caps of a run whose answers carry a probability and a cost, smallest first."""
    return sorted({cap["cap"] for cap in results.get("caps") or []
                   if any(len(row) >= 8 and row[6] is not None and row[7] is not None
                          for row in cap.get("answers") or [])})
