"""Quality gates: a change to what a gated tier serves, measured before it goes live.

An operator who saves a policy used by a gated tier does not change it: a check starts. For
each gated tier using the policy, the items of its gate set are sent to one of the
tier's engines twice, as the policy in force makes them and as the proposed one would (the
gateway's own image code, `resolution.under_policy`), and scored.

An operator who changes a gated tier's model, engine, engine settings or policy does not change
it either: the check starts a candidate engine that runs the tier as the change would make it
(an instance in the `candidate` pool, which the gateway never routes to), waits for it to
serve, and sends the gate set to an engine serving the tier now and to the candidate.

A check passes when no tier loses more accuracy than its gate's tolerance; the change is then
applied from the check (a tier's candidate becomes one of its replicas; the others are replaced).
A blocked change is applied only by an operator's override, with a reason. Both are audited with
what changed, the figures included.

A check's requests go straight to the engines, never through the gateway, and so are metered
nowhere (the check's log says so): the gateway would remake the proposed policy's images under
the policy in force, and it never routes to a candidate engine. Both sides are sent the same way,
so that only the change differs between them.
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
from controlplane.audit.services import audit_record, field_values
from controlplane.benchmarks import loadgen, resolution
from controlplane.benchmarks.models import GateCheck, QualityGate
from controlplane.benchmarks.services import set_items, token_estimator
from controlplane.catalog.changes import AUDITED as TIER_FIELDS
from controlplane.catalog.changes import tier_save
from controlplane.catalog.models import ModelTier, ResolutionPolicy
from controlplane.catalog.tokenizers import tier_tokenizer_publish
from controlplane.fleet.models import EngineInstance
from controlplane.fleet.selectors import routable_instances
from controlplane.fleet.services import instance_set_desired, tier_engines_replace
from controlplane.imaging.tokens import image_grid

log = logging.getLogger(__name__)

# The fields of a policy a check compares and applies (what the policy editor edits).
POLICY_FIELDS = ResolutionPolicy.BOUNDS
# A tier's fields whose change is measured on a candidate engine: what its engines run and how
# images reach them. Engine settings that only say how many engines run are not among them.
TIER_GATED = ("model_id", "family", "engine_kind", "engine_settings", "resolution_policy_id")
UNGATED_SETTINGS = ("large_pool_replicas",)
CONCURRENCY = 2
POLL_S = 0.5
CANDIDATE_START_S = 20 * 60  # a large model takes minutes to load; vLLM's own start-up allows 15
RECHECK_S = 5.0  # how soon a check looks again at a candidate that is starting


class GateError(Exception):
    """A check cannot go ahead, or a decision cannot be taken; the message says why."""


def policy_fields(policy: ResolutionPolicy) -> dict:
    return {name: getattr(policy, name) for name in POLICY_FIELDS}


def gated_tiers(policy: ResolutionPolicy) -> list[ModelTier]:
    """The tiers using `policy` whose changes are gated."""
    return list(ModelTier.objects.filter(resolution_policy=policy, quality_gate__isnull=False)
                .select_related("quality_gate__eval_set").order_by("name"))


def tier_fields(tier: ModelTier) -> dict:
    return field_values(tier, TIER_FIELDS)


def _gated_part(fields: dict) -> dict:
    part = {name: fields[name] for name in TIER_GATED}
    part["engine_settings"] = {k: v for k, v in (part["engine_settings"] or {}).items() if k not in UNGATED_SETTINGS}
    return part


def tier_change_gated(tier: ModelTier, proposed: ModelTier) -> bool:
    """Whether saving `proposed` (an unsaved, validated copy of the saved `tier`) must be measured
    first: the tier is gated and serving, and the change touches what its engines run."""
    if tier.pk is None or not tier.enabled or not QualityGate.objects.filter(tier=tier).exists():
        return False
    return _gated_part(tier_fields(tier)) != _gated_part(tier_fields(proposed))


def tier_check_start(*, tier: ModelTier, proposed: ModelTier, user=None) -> GateCheck:
    """Start measuring `proposed` (an unsaved, validated copy of `tier`, the tier as saved) on a
    candidate engine against the tier's engines. The tier itself is left as it is."""
    # The tasks module imports this one: imported here, where a task is enqueued.
    from controlplane.benchmarks.tasks import gate_check_run

    check = GateCheck.objects.create(tier=tier, current=tier_fields(tier),
                                     proposed=tier_fields(proposed), requested_by=user)
    transaction.on_commit(lambda: gate_check_run.delay(check.pk))
    return check


def check_start(*, policy: ResolutionPolicy, proposed: ResolutionPolicy, user=None, note: str = "") -> GateCheck:
    """Start measuring `proposed` (an unsaved copy of `policy`, validated) on every gated tier
    that uses `policy`. The policy itself is left as it is; `note`, if any, says in the check's
    log where the change came from."""
    # The tasks module imports this one: imported here, where a task is enqueued.
    from controlplane.benchmarks.tasks import gate_check_run

    if not gated_tiers(policy):
        raise GateError(f"no gated tier uses the policy {policy.name}")
    check = GateCheck.objects.create(policy=policy, current=policy_fields(policy), proposed=policy_fields(proposed),
                                     requested_by=user)
    if note:
        _log(check, note)
    transaction.on_commit(lambda: gate_check_run.delay(check.pk))
    return check


def check_execute(*, check_id: int) -> float | None:
    """Measure a check (in a worker). Its row says how it went, whatever happens. Returns in
    how many seconds to look again when it waits for its candidate engine to start."""
    check = GateCheck.objects.select_related("policy", "tier").get(pk=check_id)
    if check.state != GateCheck.State.RUNNING:
        return None
    results = {}
    try:
        if check.tier_id:
            candidate = _candidate(check)
            if not _candidate_ready(check, candidate):
                return RECHECK_S
            results[check.tier.name] = _measure_candidate(check, candidate)
        else:
            tiers = gated_tiers(check.policy)
            if not tiers:
                raise GateError("no gated tier uses the policy any more")
            for n, tier in enumerate(tiers):
                results[tier.name] = _measure_policy(check, tier, done=n / len(tiers), share=1 / len(tiers))
                GateCheck.objects.filter(pk=check.pk).update(results=results)
    except GateError as exc:
        _candidate_stop(check, "its check could not measure it")
        _finish(check, GateCheck.State.FAILED, str(exc), results)
        return None
    except Exception as exc:  # the row says so rather than staying "measuring"
        log.exception("quality check %s failed", check.pk)
        _candidate_stop(check, "its check failed")
        _finish(check, GateCheck.State.FAILED, f"failed: {type(exc).__name__}: {exc}", results)
        return None
    blocked = [name for name, figures in results.items() if not figures["passed"]]
    if blocked:
        _finish(check, GateCheck.State.BLOCKED, f"blocked: {', '.join(blocked)} lose more than their tolerance",
                results)
    else:
        _finish(check, GateCheck.State.PASSED, "passed on every gated tier", results)
    return None


def _candidate(check: GateCheck) -> EngineInstance:
    """The check's candidate engine, started on the first pass: the tier with the proposed
    fields that concern its engines. The node agents place and launch it as any instance."""
    if check.candidate_id:
        return EngineInstance.objects.get(pk=check.candidate_id)
    overrides = {name: check.proposed[name] for name in TIER_GATED if check.proposed[name] != check.current[name]}
    candidate = EngineInstance.objects.create(tier=check.tier, pool="candidate", overrides=overrides)
    GateCheck.objects.filter(pk=check.pk).update(candidate=candidate)
    check.candidate = candidate
    if not GateCheck.objects.filter(pk=check.pk, state=GateCheck.State.RUNNING).exists():
        _candidate_stop(check, "the change was discarded")  # while the candidate was being made
    _log(check, f"candidate engine {candidate} started with the proposed {', '.join(overrides)}; "
                f"it serves no one")
    return candidate


def _candidate_ready(check: GateCheck, candidate: EngineInstance) -> bool:
    A = EngineInstance.Actual
    if candidate.desired_state != EngineInstance.Desired.RUNNING:
        raise GateError(f"the candidate engine {candidate} was stopped")
    if candidate.actual_state in (A.FAILED, A.CRASH_LOOP):
        raise GateError(f"the candidate engine {candidate} cannot serve: {candidate.state_reason}")
    if candidate.actual_state == A.RUNNING and candidate.healthy and candidate.base_url:
        return True
    waited = (timezone.now() - check.created_at).total_seconds()
    if waited > CANDIDATE_START_S:
        raise GateError(f"the candidate engine {candidate} did not serve within {CANDIDATE_START_S // 60} "
                        f"minutes (it is {candidate.get_actual_state_display()})")
    GateCheck.objects.filter(pk=check.pk).update(progress=min(0.5, waited / CANDIDATE_START_S))
    return False


def _candidate_stop(check: GateCheck, reason: str) -> None:
    candidate = EngineInstance.objects.filter(pk=check.candidate_id, pool="candidate",
                                              desired_state=EngineInstance.Desired.RUNNING).first()
    if candidate is not None:
        instance_set_desired(instance=candidate, desired=EngineInstance.Desired.STOPPED,
                             reason=f"candidate of quality check {check.pk}: {reason}")


def _measure_policy(check: GateCheck, tier: ModelTier, *, done: float, share: float) -> dict:
    instances = routable_instances(tier_id=tier.pk)
    if not instances or not instances[0].base_url:
        raise GateError(f"{tier.name}: no healthy engine to measure on")
    grid = image_grid(tier.family)
    return _compare(check, tier, {
        "current": (instances[0], tier, ResolutionPolicy(**check.current).as_policy(grid=grid)),
        "proposed": (instances[0], tier, ResolutionPolicy(**check.proposed).as_policy(grid=grid))},
        done=done, share=share)


def _measure_candidate(check: GateCheck, candidate: EngineInstance) -> dict:
    tier = check.tier
    instances = routable_instances(tier_id=tier.pk)
    if not instances or not instances[0].base_url:
        raise GateError(f"{tier.name}: no healthy engine serves it now to measure against")
    proposed = candidate.serving_tier()
    sides = {}
    for name, (instance, as_served) in {"current": (instances[0], tier), "proposed": (candidate, proposed)}.items():
        policy = as_served.image_policy()
        if policy is None:
            raise GateError(f"{tier.name}: the {name} tier has no resolution policy to send images by")
        sides[name] = (instance, as_served, policy)
    return _compare(check, tier, sides, done=0.5, share=0.5)


def _compare(check: GateCheck, tier: ModelTier, sides: dict, *, done: float, share: float) -> dict:
    """The gate set sent as each side says, (engine, tier as it serves, policy), and scored."""
    gate: QualityGate = tier.quality_gate
    items = set_items(gate.eval_set)
    if not items:
        raise GateError(f"{tier.name}: the gate set {gate.eval_set.name} has no items")
    figures = {}
    for n, (name, (instance, as_served, policy)) in enumerate(sides.items()):
        stages = resolution.variant_specs(items, [resolution.under_policy(policy)], max_tokens=gate.max_tokens,
                                          estimate_tokens=token_estimator(as_served))
        target = loadgen.Target(url=f"{instance.base_url}/v1/chat/completions", model=instance.model_name,
                                api_key=instance.api_key)
        _log(check, f"{tier.name}, {name}: {len(items)} items of {gate.eval_set.name}, on instance {instance.pk} "
                    "(straight to the engine: not metered)")
        samples = _run_load(check, target, stages, done=done + share * n / len(sides), share=share / len(sides))
        specs = {spec.index: spec for spec in stages[0]}
        figures[name] = resolution.set_figures(samples[0], specs)
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
def check_apply(*, check: GateCheck, user, override_reason: str = "") -> ResolutionPolicy | ModelTier:
    """Apply a measured change: a passed one as it is, a blocked one only with a reason. Returns
    what changed, the policy or the tier."""
    check = GateCheck.objects.select_for_update(of=("self",)).select_related("policy", "tier").get(pk=check.pk)
    if check.state == GateCheck.State.BLOCKED:
        if not override_reason.strip():
            raise GateError("the change was blocked: applying it anyway needs a reason")
    elif check.state != GateCheck.State.PASSED:
        raise GateError(f"a check that is {check.get_state_display()} cannot be applied")
    overridden = check.state == GateCheck.State.BLOCKED
    drops = ", ".join(f"{tier} {figures['drop_points']:+.1f} points" for tier, figures in check.results.items()
                      if figures.get("drop_points") is not None)
    note = f"quality check {check.pk} {'blocked, overridden: ' + override_reason.strip() if overridden else 'passed'}"
    note = f"{note} ({drops or 'no figures'})"
    changed = _apply_tier(check, user, note) if check.tier_id else _apply_policy(check, user, note)
    GateCheck.objects.filter(pk=check.pk).update(
        state=GateCheck.State.OVERRIDDEN if overridden else GateCheck.State.APPLIED, decided_by=user,
        decided_at=timezone.now(), override_reason=override_reason.strip())
    return changed


def _apply_policy(check: GateCheck, user, note: str) -> ResolutionPolicy:
    policy = ResolutionPolicy.objects.select_for_update().get(pk=check.policy_id)
    before = policy_fields(policy)
    if before != check.current:
        raise GateError("the policy changed after this check began: check the change again")
    for name, value in check.proposed.items():
        setattr(policy, name, value)
    policy.full_clean()
    policy.save()
    audit_record(actor=user.get_username(), action=AuditEntry.Action.CHANGED, obj=policy,
                 before={**before, "quality_check": None}, after={**policy_fields(policy), "quality_check": note})
    return policy


def _apply_tier(check: GateCheck, user, note: str) -> ModelTier:
    """The tier saved as proposed; the candidate that ran it becomes one of its replicas and
    the engines that ran it as it was are replaced."""
    tier = ModelTier.objects.select_for_update().get(pk=check.tier_id)
    if tier_fields(tier) != check.current:
        raise GateError("the tier changed after this check began: check the change again")
    for name, value in check.proposed.items():
        setattr(tier, name, value)
    tier.full_clean()
    tier = tier_save(tier=tier, actor=user.get_username(), note=note)
    candidate = EngineInstance.objects.filter(pk=check.candidate_id, pool="candidate").first()
    tier_engines_replace(tier=tier, candidate=candidate, reason=f"{tier.name} changed by quality check {check.pk}")
    # The new model's tokenizer, where this host has it; the node agents publish it otherwise.
    tier_tokenizer_publish(tier=tier, source=f"quality check {check.pk}")
    return tier


def check_discard(*, check: GateCheck, user) -> None:
    """Drop a change not yet applied (a running check stops at its next tick; a candidate
    engine is stopped)."""
    discarded = GateCheck.objects.filter(pk=check.pk).exclude(state__in=GateCheck.DECIDED).update(
        state=GateCheck.State.DISCARDED, decided_by=user, decided_at=timezone.now())
    if discarded:
        _candidate_stop(check, "the change was discarded")


def _log(check: GateCheck, line: str) -> None:
    stamp = timezone.now().strftime("%H:%M:%S")
    GateCheck.objects.filter(pk=check.pk).update(log=Concat("log", Value(f"{stamp} {line}\n")))


def _finish(check: GateCheck, state: str, line: str, results: dict) -> None:
    _log(check, line)
    # A check discarded while it ran stays discarded.
    GateCheck.objects.filter(pk=check.pk, state=GateCheck.State.RUNNING).update(
        state=state, results=results, finished_at=timezone.now(), progress=1.0)
