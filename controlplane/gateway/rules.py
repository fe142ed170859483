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
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from controlplane.gateway.prepare import TierSpec
from controlplane.gateway.validation import image_detail, image_parts, image_url_place
from controlplane.imaging.errors import ImageError
from controlplane.imaging.intake import image_source_bytes
from controlplane.imaging.policy import (
    DecodedDataURL,
    Policy,
    PolicyViolation,
    picture_size,
    sent_sizes,
)
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
        return cls(id=row.pk, label=f"{row}, {scope}, #{row.pk}", send=Sending(row.tier_id, row.send_detail, row.pixel_cap),
                   tasks=frozenset(filter(None, row.tasks.split(","))),
                   ranges={name: bounds for name, bounds in ranges.items() if bounds != (None, None)},
                   detail=row.detail, tools=row.tools, cascade=cascade)

    @property
    def looks_at_pictures(self) -> bool:
        """Whether deciding it, or reserving for its cascade's second attempt, needs the sizes
        of the request's pictures."""
        return "source_pixels" in self.ranges or "image_tokens" in self.ranges or self.cascade is not None


@dataclass(frozen=True)
class SizingLimits:
    """What reading a request's picture headers may cost (the gateway's decode settings)."""

    cpu_seconds: float = 0.5  # all of its pictures'
    max_scans: int = 100
    max_input_pixels: int = Policy().max_input_pixels


class Facts:
    """What the rules read of one request. Its pictures' sizes are read only when asked
    (`size_pictures`, off the event loop, bounded), and only when a rule needs them."""

    def __init__(self, body: dict, headers: dict[str, str] | None = None, *, max_image_bytes: int):
        metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        task = metadata.get("task")
        if not isinstance(task, str):  # validated as a string when given (validation.py)
            task = (headers or {}).get(TASK_HEADER) or ""
        self.task = task.strip().lower()  # rules keep theirs in lower case
        self.parts = image_parts(body["messages"])
        self.images = len(self.parts)
        self.details = frozenset(_detail_asked(part) for part in self.parts)
        self.tools = bool(body.get("tools"))
        self.max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        self._body, self._max_bytes = body, max_image_bytes
        self._prompt_tokens: int | None = None
        self._sizes: list | None = None

    @property
    def prompt_tokens(self) -> int:
        if self._prompt_tokens is None:
            self._prompt_tokens = prompt_text_tokens(self._body["messages"])
        return self._prompt_tokens

    def source_sizes(self) -> list[tuple[int, int]] | None:
        """Each picture's upright size, once read (`size_pictures`); None before, or when one
        has none to read (given by URL, or refused as it will be when it is prepared)."""
        return self._sizes

    def size_pictures(self, limits: SizingLimits) -> float:
        """Read each picture's size from its header, within `limits`; the CPU seconds it took
        (the caller counts them against the key's intake). Run off the event loop."""
        started = time.thread_time()
        try:
            self._sizes = self._read_sizes(limits)
        finally:
            spent = time.thread_time() - started
        return spent

    def _read_sizes(self, limits: SizingLimits) -> list[tuple[int, int]] | None:
        sizes, deadline = [], time.thread_time() + limits.cpu_seconds
        policy = Policy(max_input_pixels=limits.max_input_pixels)
        for part in self.parts:
            holder, name = image_url_place(part)
            url = None if holder is None else holder.get(name)
            if not (isinstance(url, DecodedDataURL) or (isinstance(url, str) and url.startswith("data:"))):
                return None
            left = deadline - time.thread_time()
            if left <= 0:
                return None
            try:
                data = image_source_bytes(url, max_bytes=self._max_bytes, fetch=None)
                sizes.append(picture_size(data, policy=policy, max_scans=limits.max_scans, cpu_seconds=left))
            except (ImageError, ValueError):
                return None
        return sizes

    def largest_pixels(self) -> int | None:
        sizes = self.source_sizes()
        if sizes is None:
            return None
        return max((width * height for width, height in sizes), default=0)

    def image_tokens(self, tier: TierSpec) -> int | None:
        """All the images' tokens as `tier` (a spec as a rule sends to it) would count them."""
        if not self.parts:
            return 0
        sizes = self.source_sizes()
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


def worst_image_tokens(facts: Facts, tier: TierSpec) -> int:
    """The most `tier` can count for the request's images: exactly, from their sizes when they
    were read; else each image as large as the tier's policy lets it be."""
    counted = facts.image_tokens(tier)
    if counted is not None or tier.policy is None:
        return counted or 0
    side = math.isqrt(tier.policy.max_pixels)
    largest = sum(count_image_tokens(tier.family, width, height, **tier.processor_options)
                  for width, height in sent_sizes(side, side, tier.policy))
    return largest * facts.images


def _detail_asked(part: dict) -> str:
    detail = image_detail(part)
    return detail if detail in ("low", "high") else "auto"


def _detail_sent(part: dict) -> str | None:
    detail = image_detail(part)
    return detail if detail in ("low", "high") else None


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
            value = facts.largest_pixels() if facts.parts else None
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


def token_probability(logprobs: list[float], how: str = "mean") -> float | None:
    """An answer's token probability from its tokens' log-probabilities: their mean's (a
    geometric mean of the probabilities), or the least of them; None for none."""
    if not logprobs:
        return None
    return math.exp(min(logprobs) if how == "min" else sum(logprobs) / len(logprobs))


def confidence(choice: dict, how: str) -> float | None:
    """The token probability of an engine's answer (`choice`), or None when it gave none."""
    content = ((choice.get("logprobs") or {}).get("content")) or []
    values = [item.get("logprob") for item in content if isinstance(item, dict)]
    return token_probability([v for v in values if isinstance(v, int | float) and not isinstance(v, bool)
                              and math.isfinite(v)], how)


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
    if sure is None:
        return "no_confidence", None  # the engine gave no log-probabilities
    if sure < cascade.threshold:
        return "low_confidence", sure
    return "", sure
