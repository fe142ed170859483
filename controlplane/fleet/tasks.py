"""Fleet tasks. Thin: ids in, a service call out; limits declared here."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown
from django.conf import settings

from controlplane.fleet.models import Node
from controlplane.fleet.services import instances_place, samples_prune, tier_replicas_sync
from workers.supervision import SupervisionClock, external_reconcile, this_node
from workers.supervision import node_reconcile as reconcile

log = logging.getLogger(__name__)


@shared_task(name="fleet.reconcile", soft_time_limit=30, time_limit=60)
def fleet_reconcile() -> None:
    """Control-plane side: make rows for missing replicas, place them, poke every node."""
    tier_replicas_sync()
    instances_place()
    external_reconcile()
    samples_prune()
    for node in Node.objects.all():
        node_reconcile.apply_async(args=[node.name], queue=node.queue,
                                   expires=settings.FLEET_RECONCILE_SECONDS * 2)


@shared_task(name="fleet.node_reconcile", soft_time_limit=60, time_limit=90)
def node_reconcile(node_name: str) -> int:
    if node_name != settings.NODE_NAME:
        log.warning("node %s received work for node %s; ignoring", settings.NODE_NAME, node_name)
        return 0
    return reconcile(node_name)


@worker_ready.connect
def _register_node(sender=None, **_kwargs):
    """A worker that consumes this node's queue is the node agent: register, reconcile, and keep
    supervising on its own clock when the broker's passes stop coming (see SupervisionClock)."""
    queues = {q.name for q in sender.task_consumer.queues} if sender is not None else set()
    if Node.queue_for(settings.NODE_NAME) not in queues:
        return

    this_node()
    tier_replicas_sync()
    instances_place()
    reconcile(settings.NODE_NAME)
    clock = SupervisionClock(settings.NODE_NAME, settings.FLEET_RECONCILE_SECONDS)
    clock.start()
    worker_shutdown.connect(lambda **_: clock.stop(timeout=10), weak=False)
