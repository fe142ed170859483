import datetime as dt

from django.db import models
from django.utils import timezone

from controlplane.fleet.models import EngineInstance

# A health result older than this means the node agent stopped watching: route elsewhere.
HEALTH_FRESH_SECONDS = 30


FAILING = ("unhealthy", "stopped", "crashed", "crashloop", "failed")


def failing_instance_ids(*, tier_id: int) -> set[int]:
    """Instances of a tier that supervision found hung, dead or gone: what is still waiting on
    one of them will get no answer. (A draining engine is not failing: it finishes its work.)"""
    return set(EngineInstance.objects.filter(tier_id=tier_id, actual_state__in=FAILING).values_list("id", flat=True))


def routable_instances(*, tier_id: int):
    """Instances the gateway may send work to: running, healthy, recently checked, not draining."""
    fresh = timezone.now() - dt.timedelta(seconds=HEALTH_FRESH_SECONDS)
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
