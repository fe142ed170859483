"""Routing rules: what `auto` means for a request, read from the request itself (the task it
names, its images, its prompt, what it asks for) before anything is decoded, and why.

A rule's conditions are read from the request as it came: a picture's size from its header
alone (a picture given by URL has none before it is fetched, so a condition on pixels or image
tokens does not hold for it), its image tokens as the rule's own tier would count them under
the policy the rule sends it at, its prompt's text tokens as the gateway estimates them. The
first rule that holds decides; the tenant's model `auto` resolves as before when none does.
See docs/operators/routing.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from controlplane.gateway.prepare import TierSpec
from controlplane.gateway.validation import image_parts, image_url_place
from controlplane.imaging.errors import ImageError
from controlplane.imaging.intake import image_source_bytes
from controlplane.imaging.policy import DecodedDataURL, PolicyViolation, picture_size, sent_sizes
from controlplane.imaging.tokens import count_image_tokens
from controlplane.textcount import prompt_text_tokens

TASK_HEADER = "x-task"
RANGES = ("images", "source_pixels", "image_tokens", "prompt_tokens", "max_tokens")


@dataclass(frozen=True)
class Sending:
    """A tier as a rule sends to it: at a detail, or under a pixel cap, within its policy."""

    tier_id: int
    detail: str = ""
    pixel_cap: int | None = None

    def spec(self, tier: TierSpec) -> TierSpec:
        """`tier` with its policy narrowed as this sends to it: a cap lowers both detail
        levels' caps, and a detail makes every image's cap that level's, whatever it asked."""
        policy = tier.policy
        if policy is None or (not self.detail and self.pixel_cap is None):
            return tier
        high, low = policy.max_pixels, policy.low_detail_max_pixels
        if self.detail == "low":
            high = low
        elif self.detail == "high":
            low = high
        if self.pixel_cap is not None:
            high, low = min(high, self.pixel_cap), min(low, self.pixel_cap)
        return dataclasses.replace(tier, policy=dataclasses.replace(
            policy, max_pixels=max(high, policy.min_pixels), low_detail_max_pixels=max(low, policy.min_pixels)))

    def describe(self, name: str) -> str:
        how = [self.detail and f"detail {self.detail}", self.pixel_cap and f"at most {self.pixel_cap:,} px"]
        return name + "".join(f", {part}" for part in how if part)


@dataclass(frozen=True)
class Cascade:
    to: Sending
    confidence: str = "mean"  # or "min": which token probability is held to the threshold
    threshold: float = 0.5
    on_length: bool = True
    on_refusal: bool = True
    streams: bool = True  # streamed requests cascade too (answered once decided)


@dataclass(frozen=True)
class Rule:
    id: int
    label: str  # "rule 3 (receipts), tenant acme": what decided, as the request log keeps it
    send: Sending
    tasks: frozenset[str] = frozenset()
    ranges: dict = field(default_factory=dict)  # name in RANGES -> (least or None, most or None)
    detail: str = ""  # every image asks for it ("auto" when none asked)
    tools: str = ""  # "with" or "without"
    cascade: Cascade | None = None

    @classmethod
    def of(cls, row, scope: str) -> Rule:
        """The rule a RoutingRule row is (tenants/models.py)."""
        ranges = {name: (getattr(row, f"min_{name}"), getattr(row, f"max_{name}")) for name in RANGES}
        cascade = None if row.escalate_to_id is None else Cascade(
            to=Sending(row.escalate_to_id, row.escalate_detail, row.escalate_pixel_cap), confidence=row.confidence,
            threshold=row.threshold, on_length=row.escalate_on_length, on_refusal=row.escalate_on_refusal,
            streams=row.cascade_streams)
        return cls(id=row.pk, label=f"{row}, {scope}", send=Sending(row.tier_id, row.send_detail, row.pixel_cap),
                   tasks=frozenset(filter(None, row.tasks.split(","))),
                   ranges={name: bounds for name, bounds in ranges.items() if bounds != (None, None)},
                   detail=row.detail, tools=row.tools, cascade=cascade)

    @property
    def looks_at_pictures(self) -> bool:
        return "source_pixels" in self.ranges or "image_tokens" in self.ranges


class Facts:
    """What the rules read of one request, each found once and only when a rule asks."""

    def __init__(self, body: dict, headers: dict[str, str] | None = None, *, max_image_bytes: int):
        metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        task = metadata.get("task") or (headers or {}).get(TASK_HEADER) or ""
        self.task = str(task).strip()
        self.parts = image_parts(body["messages"])
        self.images = len(self.parts)
        self.details = frozenset(_detail_asked(part) for part in self.parts)
        self.tools = bool(body.get("tools"))
        self.max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        self._body, self._max_bytes = body, max_image_bytes
        self._prompt_tokens: int | None = None
        self._sizes: list | None = None
        self._sized = False

    @property
    def prompt_tokens(self) -> int:
        if self._prompt_tokens is None:
            self._prompt_tokens = prompt_text_tokens(self._body["messages"])
        return self._prompt_tokens

    def source_sizes(self, tier: TierSpec | None) -> list[tuple[int, int]] | None:
        """Each picture's upright size, from its header; None when one has none to read (given
        by URL, or refused as it will be when it is prepared)."""
        if not self._sized:
            self._sized = True
            self._sizes = self._read_sizes(tier)
        return self._sizes

    def _read_sizes(self, tier: TierSpec | None) -> list[tuple[int, int]] | None:
        sizes = []
        for part in self.parts:
            holder, name = image_url_place(part)
            url = None if holder is None else holder.get(name)
            if not (isinstance(url, DecodedDataURL) or (isinstance(url, str) and url.startswith("data:"))):
                return None
            try:
                data = image_source_bytes(url, max_bytes=self._max_bytes, fetch=None)
                sizes.append(picture_size(data, policy=tier.policy if tier is not None else None))
            except (ImageError, ValueError):
                return None
        return sizes

    def largest_pixels(self, tier: TierSpec | None) -> int | None:
        sizes = self.source_sizes(tier)
        if sizes is None:
            return None
        return max((width * height for width, height in sizes), default=0)

    def image_tokens(self, tier: TierSpec) -> int | None:
        """All the images' tokens as `tier` (a spec as a rule sends to it) would count them."""
        if not self.parts:
            return 0
        sizes = self.source_sizes(tier)
        if sizes is None or tier.policy is None:
            return None
        total = 0
        try:
            for part, (width, height) in zip(self.parts, sizes, strict=True):
                for sent_width, sent_height in sent_sizes(width, height, tier.policy, _detail_sent(part)):
                    total += count_image_tokens(tier.family, sent_width, sent_height, **tier.processor_options)
        except (ImageError, PolicyViolation, ValueError):
            return None
        return total


def _detail_asked(part: dict) -> str:
    holder, _ = image_url_place(part)
    detail = holder.get("detail") if isinstance(holder, dict) and holder is not part else None
    return detail if detail in ("low", "high") else "auto"


def _detail_sent(part: dict) -> str | None:
    detail = _detail_asked(part)
    return None if detail == "auto" else detail


def _within(value: int | None, bounds: tuple[int | None, int | None]) -> bool:
    least, most = bounds
    if value is None:
        return False
    return (least is None or value >= least) and (most is None or value <= most)


def holds(rule: Rule, facts: Facts, tier: TierSpec) -> bool:
    """Whether every condition of `rule` holds for the request `facts` describes, its images
    counted at `tier` (the rule's tier as the rule sends to it)."""
    if rule.tasks and facts.task not in rule.tasks:
        return False
    if rule.tools and (rule.tools == "with") != facts.tools:
        return False
    if rule.detail and (not facts.parts or facts.details != {rule.detail}):
        return False
    for name, bounds in rule.ranges.items():
        if name == "images":
            value = facts.images
        elif name == "source_pixels":
            value = facts.largest_pixels(tier) if facts.parts else None
        elif name == "image_tokens":
            value = facts.image_tokens(tier)
        elif name == "prompt_tokens":
            value = facts.prompt_tokens
        else:
            value = facts.max_tokens if facts.max_tokens is not None else tier.max_output_tokens
        if not _within(value, bounds):
            return False
    return True


@dataclass(frozen=True)
class Decision:
    tier: TierSpec  # as the rule sends to it
    rule: Rule
    escalate_to: TierSpec | None = None


def decide(rules: Iterable[Rule], facts: Facts, tiers_by_id: dict[int, TierSpec]) -> Decision | None:
    """The first of `rules` (those of a key, its tenant and the defaults, in order) that holds,
    among those whose tiers the key may use (`tiers_by_id`) and that take what it sends."""
    for rule in rules:
        tier = tiers_by_id.get(rule.send.tier_id)
        if tier is None or (facts.parts and tier.kind != "vision"):
            continue
        escalate_to = None
        if rule.cascade is not None:
            second = tiers_by_id.get(rule.cascade.to.tier_id)
            if second is None or (facts.parts and second.kind != "vision"):
                continue
            escalate_to = rule.cascade.to.spec(second)
        sent = rule.send.spec(tier)
        if holds(rule, facts, sent):
            return Decision(sent, rule, escalate_to)
    return None


# -- a cascade's first answer ------------------------------------------------------------------

_REFUSAL = re.compile(r"^\s*(i'?m sorry|i am sorry|sorry, i can|i can(?:'|no)t (?:help|assist|answer|do)|"
                      r"i'?m (?:not able|unable) to|i am (?:not able|unable) to)", re.IGNORECASE)


def confidence(choice: dict, how: str) -> float | None:
    """The answer's token probability, the mean of its tokens' log-probabilities (a geometric
    mean) or the least of them; None when the engine gave none."""
    content = ((choice.get("logprobs") or {}).get("content")) or []
    values = [item.get("logprob") for item in content if isinstance(item, dict)]
    values = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
    if not values:
        return None
    return math.exp(min(values) if how == "min" else sum(values) / len(values))


def escalation(answer: dict, cascade: Cascade) -> tuple[str, float | None]:
    """Why a cascade's first answer is not the one sent ("" when it is), and its confidence."""
    choices = answer.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return "no_answer", None
    choice = choices[0]
    sure = confidence(choice, cascade.confidence)
    message = choice.get("message") or {}
    if cascade.on_refusal and (message.get("refusal") or choice.get("finish_reason") == "content_filter"
                               or _REFUSAL.match(message.get("content") or "")):
        return "refusal", sure
    if cascade.on_length and choice.get("finish_reason") == "length":
        return "length", sure
    if sure is None or sure < cascade.threshold:
        return "low_confidence", sure
    return "", sure
