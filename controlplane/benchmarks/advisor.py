"""The policy advisor: from a measured quality–cost curve and a quality target, the smallest
pixel cap that meets the target, and what it saves per 1,000 images at the tier's prices.

Pure: no Django. A curve is the points of one resolution sweep (one per pixel cap), each with
its accuracy on the evaluation set, that accuracy's 95 % interval, and its cost per image.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from controlplane.web.money import format_money

WITHIN = "within"      # within N points of the best cap
AT_LEAST = "at_least"  # at least X % on the set
TARGET_KINDS = {WITHIN: "within N points of the best cap", AT_LEAST: "at least X % on the set"}


@dataclass(frozen=True)
class Point:
    cap: int
    accuracy: float  # 0 to 1
    low: float       # its 95 % interval
    high: float
    items: int
    cost_per_image: Decimal | None = None
    image_tokens: float | None = None


@dataclass(frozen=True)
class Target:
    kind: str
    points: float  # percentage points: the allowed drop (WITHIN) or the floor (AT_LEAST)

    def __post_init__(self):
        if self.kind not in TARGET_KINDS:
            raise ValueError(f"a target is one of {', '.join(TARGET_KINDS)}")
        if not 0 <= self.points <= 100:
            raise ValueError("a target is between 0 and 100 percentage points")

    def floor(self, best: Point) -> float:
        """The accuracy a cap must reach."""
        return best.accuracy - self.points / 100 if self.kind == WITHIN else self.points / 100

    def __str__(self):
        if self.kind == WITHIN:
            return f"within {self.points:g} points of the best cap"
        return f"at least {self.points:g} % on the set"


@dataclass(frozen=True)
class Advice:
    target: Target
    best: Point                  # the most accurate cap (the largest, of those tied)
    chosen: Point | None         # the smallest cap meeting the target; None when none does
    current: Point | None        # the measured point at the policy's cap now, if it was swept
    saving_per_1000: Decimal | None  # at the tier's prices, against the current cap
    # Whether the chosen cap's interval lies wholly below the best's: the loss it accepts is
    # then measured, not noise. When the intervals overlap the set cannot tell them apart.
    distinguishable_from_best: bool

    @property
    def met(self) -> bool:
        return self.chosen is not None

    @property
    def changes_policy(self) -> bool:
        return self.chosen is not None and (self.current is None or self.chosen.cap != self.current.cap)

    def summary(self, currency: str) -> str:
        """The advice in a sentence, its saving in `currency` (the tier's prices')."""
        if self.chosen is None:
            return (f"No cap meets {self.target}: the best, {self.best.cap:,} px, scores "
                    f"{self.best.accuracy:.1%}.")
        line = (f"{self.chosen.cap:,} px is the smallest cap {self.target}: {self.chosen.accuracy:.1%} "
                f"({self.chosen.low:.1%}–{self.chosen.high:.1%}) against {self.best.accuracy:.1%} at "
                f"{self.best.cap:,} px")
        if self.saving_per_1000 is not None and self.current is not None:
            saving = format_money(self.saving_per_1000, currency, each=True)
            line += f"; it saves {saving} per 1,000 images against {self.current.cap:,} px now"
        return line + "."


def advise(points: list[Point], target: Target, *, current_cap: int | None = None) -> Advice:
    """The smallest cap of `points` whose accuracy reaches the target's floor.

    The best cap is the most accurate; of caps equally accurate, the largest (the one an
    operator compares a saving against). A cap meets the target on its measured accuracy;
    `distinguishable_from_best` says whether the loss it accepts is outside the noise of the set.
    """
    if not points:
        raise ValueError("the advisor needs a curve with at least one measured cap")
    ordered = sorted(points, key=lambda p: p.cap)
    best = max(ordered, key=lambda p: (p.accuracy, p.cap))
    floor = target.floor(best)
    chosen = next((p for p in ordered if p.accuracy >= floor - 1e-12), None)
    current = None
    if current_cap is not None:
        current = next((p for p in ordered if p.cap == current_cap), None)
    saving = None
    if chosen is not None and current is not None and chosen.cost_per_image is not None \
            and current.cost_per_image is not None:
        saving = (Decimal(current.cost_per_image) - Decimal(chosen.cost_per_image)) * 1000
    return Advice(target=target, best=best, chosen=chosen, current=current, saving_per_1000=saving,
                  distinguishable_from_best=chosen is not None and chosen.high < best.low)
