import datetime as dt

from django.db import models
from django.utils import timezone

from controlplane.fleet.models import EngineInstance

# A health result older than this means the node agent stopped watching: route elsewhere...
HEALTH_FRESH_SECONDS = 30
# ...unless no engine anywhere was checked lately: then supervision as a whole has stopped
# (the broker that reaches the node agents is unreachable), not the engines, and those last
# found healthy stay routable for this long. (A dead engine then fails fast on connect.)
SUPERVISION_GRACE_SECONDS = 900


FAILING = ("unhealthy", "stopped", "crashed", "crashloop", "failed")


def failing_instance_ids(*, tier_id: int) -> set[int]:
    """Instances of a tier that supervision found hung, dead or gone: what is still waiting on
    one of them will get no answer. (A draining engine is not failing: it finishes its work.)"""
    return set(EngineInstance.objects.filter(tier_id=tier_id, actual_state__in=FAILING).values_list("id", flat=True))


def routable_instances(*, tier_id: int):
    """Instances the gateway may send work to: running, healthy, recently checked, not draining."""
    now = timezone.now()
    fresh = now - dt.timedelta(seconds=HEALTH_FRESH_SECONDS)
    latest = EngineInstance.objects.aggregate(latest=models.Max("last_health_at"))["latest"]
    if latest is not None and latest < fresh:
        fresh = now - dt.timedelta(seconds=SUPERVISION_GRACE_SECONDS)
    return list(
        EngineInstance.objects.filter(
            tier_id=tier_id,
            desired_state=EngineInstance.Desired.RUNNING,
            actual_state=EngineInstance.Actual.RUNNING,
            healthy=True,
            last_health_at__gte=fresh,
        ).filter(
            # launched here (a node and a port) or registered by URL (external)
            models.Q(port__isnull=False, node__isnull=False) | ~models.Q(external_url=""),
        ).select_related("node")
    )
