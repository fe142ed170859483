"""Engines started elsewhere (a vLLM in Kubernetes, say), registered by URL: the control
plane health-checks, probes and scrapes them and routes to them, but never launches them."""

from __future__ import annotations

import logging

from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineInstance
from controlplane.fleet.services import instance_transition
from workers.supervision.liveness import assess

log = logging.getLogger(__name__)
A = EngineInstance.Actual


def external_check(instance: EngineInstance, now) -> None:
    if instance.desired_state != EngineInstance.Desired.RUNNING:
        if instance.actual_state != A.STOPPED:
            instance_transition(instance=instance, to_state=A.STOPPED, healthy=False,
                                reason="taken out of rotation (external engines are not stopped by us)")
        return
    fields = {"last_health_at": now}
    refused = instance.external_url_refusal()  # its name may point elsewhere since the last pass
    if refused:
        if instance.actual_state != A.UNHEALTHY or instance.healthy:
            instance_transition(instance=instance, to_state=A.UNHEALTHY, reason=f"{refused}; out of rotation",
                                healthy=False, **fields)
        else:
            EngineInstance.objects.filter(pk=instance.pk).update(**fields)
        return
    verdict = assess(instance, now, fields)
    fields["healthy"] = verdict.healthy
    state = A.RUNNING if verdict.healthy else A.UNHEALTHY
    if instance.actual_state != state:
        reason = "serving: health and probe passed" if verdict.healthy else f"{verdict.reason}; out of rotation"
        instance_transition(instance=instance, to_state=state, reason=reason, **fields)
    else:
        EngineInstance.objects.filter(pk=instance.pk).update(**fields)


def external_reconcile() -> int:
    instances = EngineInstance.objects.filter(
        tier__engine_kind=ModelTier.EngineKind.EXTERNAL).exclude(external_url="").select_related("tier")
    now = timezone.now()
    for instance in instances:
        try:
            external_check(instance, now)
        except Exception:
            log.exception("checking external engine %s failed", instance)
    return len(instances)
