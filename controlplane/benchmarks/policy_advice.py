"""The advisor on a resolution run: its advice for a quality target on the run's measured
curve, against the tier's resolution policy as it is now, and the change of that policy to
the chosen cap in one step (measured first by a quality check when a tier using the policy
is gated; saved at once and audited otherwise)."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass

from django.core.exceptions import ValidationError
from django.db import transaction

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.benchmarks import advisor, gates, selectors
from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun, GateCheck
from controlplane.catalog.models import ModelTier, ResolutionPolicy
from controlplane.web.money import format_money


class AdviceError(Exception):
    """No advice can be given or applied; the message says why."""


@dataclass(frozen=True)
class RunAdvice:
    run: BenchmarkRun
    tier: ModelTier
    policy: ResolutionPolicy
    advice: advisor.Advice
    stamp: str               # the policy as this advice saw it (a form carries it back)
    shared_with: list[str]   # the other tiers whose images the policy shapes
    gated: list[str]         # the tiers whose quality gate measures a change first
    currency: str
    refusal: str             # why the chosen cap cannot be applied; empty when it can

    @property
    def summary(self) -> str:
        return self.advice.summary(self.currency)

    @property
    def note(self) -> str:
        """Where a change came from, for the audit log and the quality check's log."""
        cap = f"{self.advice.chosen.cap:,} px" if self.advice.chosen else "none"
        return f"from the advisor: run {self.run.pk}, target {self.advice.target}, cap {cap}"


def policy_stamp(policy: ResolutionPolicy) -> str:
    """A short digest of the policy's fields: equal exactly when nothing in it changed."""
    fields = json.dumps(gates.policy_fields(policy), sort_keys=True, default=str)
    return hashlib.sha256(fields.encode()).hexdigest()[:16]


def proposed_policy(policy: ResolutionPolicy, cap: int) -> ResolutionPolicy:
    """An unsaved copy of `policy` capping images at `cap` pixels: 'high' detail at the cap,
    'low' detail lowered to it when it was above."""
    proposed = copy.copy(policy)
    proposed.max_pixels = cap
    proposed.low_detail_max_pixels = min(policy.low_detail_max_pixels, cap)
    return proposed


def run_advice(*, run: BenchmarkRun, target: advisor.Target) -> RunAdvice:
    """The advice for `target` on a succeeded resolution run, against its tier's policy now."""
    if run.profile.kind != BenchmarkProfile.Kind.RESOLUTION or run.state != BenchmarkRun.State.SUCCEEDED:
        raise AdviceError("the advisor reads a resolution sweep that succeeded")
    points = selectors.curve_points(run.results or {})
    if not points:
        raise AdviceError("this sweep has no accuracy on a labelled set at any cap")
    tier = run.profile.tier
    if tier.resolution_policy_id is None:
        raise AdviceError(f"{tier.name} has no resolution policy to change")
    policy = ResolutionPolicy.objects.get(pk=tier.resolution_policy_id)
    advice = advisor.advise(points, target, current_cap=policy.max_pixels)
    sharing = list(policy.tiers.order_by("name").values_list("name", flat=True))
    return RunAdvice(run=run, tier=tier, policy=policy, advice=advice, stamp=policy_stamp(policy),
                     shared_with=[name for name in sharing if name != tier.name],
                     gated=[t.name for t in gates.gated_tiers(policy)], currency=tier.price_plan.currency,
                     refusal=_refusal(advice, policy))


def _refusal(advice: advisor.Advice, policy: ResolutionPolicy) -> str:
    if advice.chosen is None:
        return "no measured cap meets the target"
    if advice.chosen.cap == policy.max_pixels:
        return f"the policy {policy.name} already caps images at {policy.max_pixels:,} px"
    try:
        proposed_policy(policy, advice.chosen.cap).full_clean()
    except ValidationError as exc:
        reasons = "; ".join(f"{name} {message}" for name, messages in exc.message_dict.items()
                            for message in messages)
        return f"the policy {policy.name} cannot cap at {advice.chosen.cap:,} px: {reasons}"
    return ""


def advice_apply(*, run: BenchmarkRun, target: advisor.Target, stamp: str, user) -> GateCheck | ResolutionPolicy:
    """Change the tier's policy to the cap the advice chose. When a tier using the policy is
    gated, a quality check starts instead (the change is applied from it); otherwise the policy
    is saved and the change audited, saying it came from the advisor. Refused when the policy
    changed since the advice was shown (`stamp`)."""
    found = run_advice(run=run, target=target)
    if found.refusal:
        raise AdviceError(found.refusal)
    with transaction.atomic():
        policy = ResolutionPolicy.objects.select_for_update().get(pk=found.policy.pk)
        if policy_stamp(policy) != stamp:
            raise AdviceError(f"the policy {policy.name} changed since this advice was shown: "
                              "read the advice again before applying it")
        proposed = proposed_policy(policy, found.advice.chosen.cap)
        if found.gated:
            return gates.check_start(policy=policy, proposed=proposed, user=user, note=found.note)
        before = gates.policy_fields(policy)
        proposed.save()
        audit_record(actor=user.get_username(), action=AuditEntry.Action.CHANGED, obj=proposed,
                     before={**before, "advisor": None},
                     after={**gates.policy_fields(proposed), "advisor": found.note})
        return proposed


def _figure(point: advisor.Point, currency: str) -> str:
    cost = f", {format_money(point.cost_per_image, currency, each=True)} per image" \
        if point.cost_per_image is not None else ""
    return f"{point.cap:,} px: {point.accuracy:.1%} ({point.low:.1%}–{point.high:.1%}) on {point.items} items{cost}"


def advice_lines(found: RunAdvice) -> list[tuple[str, str]]:
    """The advice in words and figures, a line per fact, for the run page."""
    advice, currency = found.advice, found.currency
    lines = [("Target", str(advice.target)), ("Best cap", _figure(advice.best, currency))]
    chosen = advice.chosen
    if chosen is None:
        lines.append(("Chosen cap", "none: no measured cap meets the target"))
    else:
        lines.append(("Chosen cap", _figure(chosen, currency)))
        lost = 100 * (advice.best.accuracy - chosen.accuracy)
        if chosen.cap == advice.best.cap:
            given_up = "none: it is the best cap"
        elif advice.distinguishable_from_best:
            given_up = f"{lost:.1f} points, outside the set's noise: the two intervals do not overlap"
        else:
            given_up = (f"{lost:.1f} points, within the set's noise: the two intervals overlap, so the set "
                        "cannot tell the two caps apart")
        lines.append(("Accuracy given up", given_up))
    now = f"{found.policy.name} caps images at {found.policy.max_pixels:,} px"
    lines.append(("Policy now", f"{now}; measured {_figure(advice.current, currency)}" if advice.current
                  else f"{now}, a cap this run did not measure"))
    if advice.saving_per_1000 is not None:
        saving = advice.saving_per_1000
        lines.append(("Per 1,000 images", f"saves {format_money(saving, currency, each=True)}" if saving >= 0
                      else f"costs {format_money(-saving, currency, each=True)} more"))
    elif chosen is not None:
        lines.append(("Per 1,000 images", "no figure: the cap in force or the chosen one has no measured cost"))
    return lines
