"""Quality gates: a resolution policy's change measured before it goes live.

An operator who saves a policy used by a gated tier does not change it: a check starts. For
each gated tier using the policy, the items of its gate set are sent to one of the
tier's engines twice, as the policy in force makes them and as the proposed one would (the
gateway's own image code, `resolution.under_policy`), and scored. The check passes when no
tier loses more accuracy than its gate's tolerance; the change is then applied from the
check. A blocked change is applied only by an operator's override, with a reason. Both are
audited with the policy, the figures included.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from django.db import transaction
from django.db.models import Value
from django.db.models.functions import Concat
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.benchmarks import loadgen, resolution
from controlplane.benchmarks.models import GateCheck, QualityGate
from controlplane.catalog.models import ModelTier, ResolutionPolicy
from controlplane.fleet.selectors import routable_instances
from controlplane.imaging.tokens import image_grid

log = logging.getLogger(__name__)

# The fields of a policy a check compares and applies (what the policy editor edits).
POLICY_FIELDS = ResolutionPolicy.BOUNDS
CONCURRENCY = 2
POLL_S = 0.5


class GateError(Exception):
    """A check cannot go ahead, or a decision cannot be taken; the message says why."""


def policy_fields(policy: ResolutionPolicy) -> dict:
    return {name: getattr(policy, name) for name in POLICY_FIELDS}


def gated_tiers(policy: ResolutionPolicy) -> list[ModelTier]:
    """The tiers using `policy` whose changes are gated."""
    return list(ModelTier.objects.filter(resolution_policy=policy, quality_gate__isnull=False)
                .select_related("quality_gate__eval_set").order_by("name"))


def check_start(*, policy: ResolutionPolicy, proposed: ResolutionPolicy, user=None, note: str = "") -> GateCheck:
    """Start measuring `proposed` (an unsaved copy of `policy`, validated) on every gated tier
    that uses `policy`. The policy itself is left as it is; `note`, if any, says in the check's
    log where the change came from."""
    from controlplane.benchmarks.tasks import gate_check_run

    if not gated_tiers(policy):
        raise GateError(f"no gated tier uses the policy {policy.name}")
    check = GateCheck.objects.create(policy=policy, current=policy_fields(policy), proposed=policy_fields(proposed),
                                     requested_by=user)
    if note:
        _log(check, note)
    transaction.on_commit(lambda: gate_check_run.delay(check.pk))
    return check


def check_execute(*, check_id: int) -> None:
    """Measure a check (in a worker). Its row says how it went, whatever happens."""
    check = GateCheck.objects.select_related("policy").get(pk=check_id)
    if check.state != GateCheck.State.RUNNING:
        return
    tiers = gated_tiers(check.policy)
    results = {}
    try:
        if not tiers:
            raise GateError("no gated tier uses the policy any more")
        for n, tier in enumerate(tiers):
            results[tier.name] = _measure_tier(check, tier, done=n / len(tiers), share=1 / len(tiers))
            GateCheck.objects.filter(pk=check.pk).update(results=results)
    except GateError as exc:
        _finish(check, GateCheck.State.FAILED, str(exc), results)
        return
    except Exception as exc:  # the row says so rather than staying "measuring"
        log.exception("quality check %s failed", check.pk)
        _finish(check, GateCheck.State.FAILED, f"failed: {type(exc).__name__}: {exc}", results)
        return
    blocked = [name for name, figures in results.items() if not figures["passed"]]
    if blocked:
        _finish(check, GateCheck.State.BLOCKED, f"blocked: {', '.join(blocked)} lose more than their tolerance",
                results)
    else:
        _finish(check, GateCheck.State.PASSED, "passed on every gated tier", results)


def _measure_tier(check: GateCheck, tier: ModelTier, *, done: float, share: float) -> dict:
    from controlplane.benchmarks.services import set_items, token_estimator

    gate: QualityGate = tier.quality_gate
    items = set_items(gate.eval_set)
    if not items:
        raise GateError(f"{tier.name}: the gate set {gate.eval_set.name} has no items")
    instances = routable_instances(tier_id=tier.pk)
    if not instances or not instances[0].base_url:
        raise GateError(f"{tier.name}: no healthy engine to measure on")
    instance = instances[0]
    grid = image_grid(tier.family)
    policies = {"current": ResolutionPolicy(**check.current).as_policy(grid=grid),
                "proposed": ResolutionPolicy(**check.proposed).as_policy(grid=grid)}
    stages = resolution.variant_specs(items, [resolution.under_policy(p) for p in policies.values()],
                                      max_tokens=gate.max_tokens, estimate_tokens=token_estimator(tier))
    target = loadgen.Target(url=f"{instance.base_url}/v1/chat/completions", model=tier.name,
                            api_key=instance.api_key)
    _log(check, f"{tier.name}: {len(items)} items of {gate.eval_set.name}, on instance {instance.pk}")

    samples = _run_load(check, target, stages, done=done, share=share)
    specs = {spec.index: spec for stage in stages for spec in stage}
    figures = {name: resolution.set_figures(stage_samples, specs) for name, stage_samples in zip(policies, samples, strict=True)}
    current, proposed = figures["current"], figures["proposed"]
    drop = None if current["accuracy"] is None or proposed["accuracy"] is None \
        else round(100 * (current["accuracy"] - proposed["accuracy"]), 2)
    passed = drop is not None and drop <= gate.tolerance_points + 1e-9
    _log(check, f"{tier.name}: {_pct(current['accuracy'])} now, {_pct(proposed['accuracy'])} proposed"
                f" ({'no figure' if drop is None else f'{drop:+.1f} points lost'}; tolerance "
                f"{gate.tolerance_points:g})")
    return {"items": len(items), "tolerance_points": gate.tolerance_points, "current": current,
            "proposed": proposed, "drop_points": drop, "passed": passed}


def _run_load(check: GateCheck, target: loadgen.Target, stages: list, *, done: float, share: float) -> list:
    """The stages' requests on an event loop in a thread of its own; this thread keeps the
    database (the ORM is not called from inside an event loop): progress, and a discard."""
    shared = {"progress": 0.0, "stop": False}

    async def on_tick(progress: float) -> bool:
        shared["progress"] = progress
        return shared["stop"]

    def load():
        try:
            shared["samples"], _ = asyncio.run(loadgen.run_fixed(target, stages, concurrency=CONCURRENCY,
                                                                 on_tick=on_tick, tick_s=0.2))
        except BaseException as exc:  # handed to this thread, which reports it
            shared["error"] = exc

    thread = threading.Thread(target=load, name=f"gate-check-{check.pk}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(POLL_S)
        GateCheck.objects.filter(pk=check.pk).update(progress=round(done + share * shared["progress"], 4))
        if GateCheck.objects.filter(pk=check.pk, state=GateCheck.State.DISCARDED).exists():
            shared["stop"] = True
    if "error" in shared:
        raise shared["error"]
    if shared["stop"]:
        raise GateError("discarded while it was measured")
    return shared["samples"]


def _pct(value) -> str:
    return "no answer" if value is None else f"{value:.1%}"


@transaction.atomic
def check_apply(*, check: GateCheck, user, override_reason: str = "") -> ResolutionPolicy:
    """Apply a measured change: a passed one as it is, a blocked one only with a reason."""
    check = GateCheck.objects.select_for_update().select_related("policy").get(pk=check.pk)
    if check.state == GateCheck.State.BLOCKED:
        if not override_reason.strip():
            raise GateError("the change was blocked: applying it anyway needs a reason")
    elif check.state != GateCheck.State.PASSED:
        raise GateError(f"a check that is {check.get_state_display()} cannot be applied")
    policy = ResolutionPolicy.objects.select_for_update().get(pk=check.policy_id)
    before = policy_fields(policy)
    if before != check.current:
        raise GateError("the policy changed after this check began: check the change again")
    for name, value in check.proposed.items():
        setattr(policy, name, value)
    policy.full_clean()
    policy.save()
    overridden = check.state == GateCheck.State.BLOCKED
    drops = ", ".join(f"{tier} {figures['drop_points']:+.1f} points" for tier, figures in check.results.items()
                      if figures.get("drop_points") is not None)
    note = f"quality check {check.pk} {'blocked, overridden: ' + override_reason.strip() if overridden else 'passed'}"
    audit_record(actor=user.get_username(), action=AuditEntry.Action.CHANGED, obj=policy,
                 before={**before, "quality_check": None},
                 after={**policy_fields(policy), "quality_check": f"{note} ({drops or 'no figures'})"})
    GateCheck.objects.filter(pk=check.pk).update(
        state=GateCheck.State.OVERRIDDEN if overridden else GateCheck.State.APPLIED, decided_by=user,
        decided_at=timezone.now(), override_reason=override_reason.strip())
    return policy


def check_discard(*, check: GateCheck, user) -> None:
    """Drop a change not yet applied (a running check stops at its next tick)."""
    GateCheck.objects.filter(pk=check.pk).exclude(state__in=GateCheck.DECIDED).update(
        state=GateCheck.State.DISCARDED, decided_by=user, decided_at=timezone.now())


def _log(check: GateCheck, line: str) -> None:
    stamp = timezone.now().strftime("%H:%M:%S")
    GateCheck.objects.filter(pk=check.pk).update(log=Concat("log", Value(f"{stamp} {line}\n")))


def _finish(check: GateCheck, state: str, line: str, results: dict) -> None:
    _log(check, line)
    # A check discarded while it ran stays discarded.
    GateCheck.objects.filter(pk=check.pk, state=GateCheck.State.RUNNING).update(
        state=state, results=results, finished_at=timezone.now(), progress=1.0)
