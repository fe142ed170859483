from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineEvent, EngineInstance, EngineMetricSample, Gpu, Node

NODE_LIVE_SECONDS = 30


def instance_transition(*, instance: EngineInstance, to_state: str, reason: str, **fields) -> None:
    """Move an instance to `to_state`, saving `fields`, and log an event if the state changed."""
    from_state = instance.actual_state
    instance.actual_state = to_state
    instance.state_reason = reason[:255]
    for name, value in fields.items():
        setattr(instance, name, value)
    instance.save()
    if from_state != to_state:
        EngineEvent.objects.create(instance=instance, from_state=from_state, to_state=to_state,
                                   reason=reason[:512])


def node_register(*, name: str, address: str, gpus: list[dict], vllm_version: str = "",
                  transformers_version: str = "") -> Node:
    node, _ = Node.objects.update_or_create(
        name=name,
        defaults={"address": address, "queue": Node.queue_for(name), "vllm_version": vllm_version,
                  "transformers_version": transformers_version, "last_seen_at": timezone.now()},
    )
    seen = set()
    for gpu in gpus:
        Gpu.objects.update_or_create(node=node, index=gpu["index"],
                                     defaults={"model": gpu.get("model", ""),
                                               "memory_mib": gpu.get("memory_mib", 0)})
        seen.add(gpu["index"])
    node.gpus.exclude(index__in=seen).delete()
    return node


def live_nodes(now=None):
    now = now or timezone.now()
    return Node.objects.filter(last_seen_at__gte=now - dt.timedelta(seconds=NODE_LIVE_SECONDS))


def tier_replicas_sync() -> int:
    """Create instance rows until every enabled tier has its replicas. Returns rows created."""
    created = 0
    counts = {
        (tier_id, pool): n for tier_id, pool, n in
        EngineInstance.objects.filter(desired_state=EngineInstance.Desired.RUNNING)
        .values_list("tier_id", "pool").annotate(n=Count("id"))
    }
    # External engines are registered by URL, one row each, by an operator: never created here.
    for tier in ModelTier.objects.filter(enabled=True).exclude(engine_kind=ModelTier.EngineKind.EXTERNAL):
        wanted = {"standard": tier.replicas,
                  # an isolated pool for requests past the large-image threshold
                  "large": tier.settings.large_pool_replicas}
        for pool, replicas in wanted.items():
            for _ in range(replicas - counts.get((tier.pk, pool), 0)):
                EngineInstance.objects.create(tier=tier, pool=pool)
                created += 1
    return created


NODE_LOST_SECONDS = 120


def instances_of_lost_nodes_release(now=None) -> int:
    """Instances on a node unseen for NODE_LOST_SECONDS are placed again elsewhere. If the
    node comes back, its agent finds those engines unowned and stops them as orphans."""
    now = now or timezone.now()
    lost = EngineInstance.objects.filter(
        desired_state=EngineInstance.Desired.RUNNING, node__isnull=False,
        node__last_seen_at__lt=now - dt.timedelta(seconds=NODE_LOST_SECONDS)).select_related("node")
    released = 0
    for instance in lost:
        node = instance.node.name
        instance.gpus.clear()
        reason = f"node {node} not seen for {NODE_LOST_SECONDS}s; placing it again"
        from_state = instance.actual_state
        instance_transition(instance=instance, to_state=EngineInstance.Actual.PENDING, node=None, port=None,
                            pid=None, healthy=False, reason=reason)
        if from_state == EngineInstance.Actual.PENDING:  # no state change, but it must be on record
            EngineEvent.objects.create(instance=instance, from_state=from_state, to_state=from_state, reason=reason)
        released += 1
    return released


@transaction.atomic
def instances_place(now=None) -> int:
    """Give each unplaced instance a live node with enough free GPUs. One GPU, one engine."""
    instances_of_lost_nodes_release(now)
    placed = 0
    nodes = list(live_nodes(now).prefetch_related("gpus"))
    if not nodes:
        return 0
    # A GPU is taken while any engine may still hold it: wanted running, or still alive
    # (starting, serving, draining: a drained engine frees its GPU only once it has stopped).
    A = EngineInstance.Actual
    holding = (Q(instances__desired_state=EngineInstance.Desired.RUNNING) | Q(instances__pid__isnull=False)
               | Q(instances__actual_state__in=[A.STARTING, A.RUNNING, A.UNHEALTHY, A.DRAINING]))
    busy = set(Gpu.objects.filter(holding).values_list("id", flat=True))
    load = dict(
        EngineInstance.objects.filter(node__isnull=False, desired_state=EngineInstance.Desired.RUNNING)
        .values_list("node_id").annotate(n=Count("id"))
    )
    pending = (
        EngineInstance.objects.select_for_update()
        .filter(node__isnull=True, desired_state=EngineInstance.Desired.RUNNING)
        .exclude(tier__engine_kind=ModelTier.EngineKind.EXTERNAL)
        .select_related("tier")
    )
    for instance in pending:
        need = instance.tier.gpus_per_replica
        if instance.tier.runs_on_cpu:
            need = 0  # vLLM's CPU build: host memory and cores, no GPU
        elif instance.tier.engine_kind == ModelTier.EngineKind.VLLM:
            need = max(need, instance.tier.settings.tensor_parallel_size)
        for node in sorted(nodes, key=lambda n: load.get(n.pk, 0)):
            free = [g for g in node.gpus.all() if g.pk not in busy]
            if len(free) < need:
                continue
            chosen = free[:need]
            instance.node = node
            instance.save(update_fields=["node"])
            instance.gpus.set(chosen)
            busy.update(g.pk for g in chosen)
            load[node.pk] = load.get(node.pk, 0) + 1
            EngineEvent.objects.create(
                instance=instance, from_state=instance.actual_state, to_state=instance.actual_state,
                reason=f"placed on {node.name}" + (
                    f" with GPUs {','.join(str(g.index) for g in chosen)}" if chosen else ""),
            )
            placed += 1
            break
    return placed


def instance_set_desired(*, instance: EngineInstance, desired: str, reason: str) -> None:
    instance.desired_state = desired
    instance.save(update_fields=["desired_state"])
    EngineEvent.objects.create(instance=instance, from_state=instance.actual_state,
                               to_state=instance.actual_state, reason=f"desired {desired}: {reason}")


def samples_prune(now=None) -> int:
    """Drop metric samples past their retention."""
    cutoff = (now or timezone.now()) - dt.timedelta(hours=settings.FLEET_METRICS_RETENTION_HOURS)
    deleted, _ = EngineMetricSample.objects.filter(at__lt=cutoff).delete()
    return deleted


def instance_action(*, instance: EngineInstance, action: str, user) -> None:
    """What an operator asks of an instance from the fleet page: launch, stop or drain."""
    who = getattr(user, "username", "system")
    if action == "launch":
        if instance.tier.engine_kind == ModelTier.EngineKind.EXTERNAL:
            instance_set_desired(instance=instance, desired=EngineInstance.Desired.RUNNING,
                                 reason=f"back in rotation, by {who}")
            return
        EngineInstance.objects.filter(pk=instance.pk).update(
            restart_count=0, next_start_at=None, drain=False, drain_started_at=None,
            actual_state=EngineInstance.Actual.PENDING
            if instance.actual_state == EngineInstance.Actual.FAILED else instance.actual_state)
        instance.refresh_from_db()
        if instance.pid is None:
            # No live process holds its GPUs, which may have gone to another engine
            # meanwhile: place it afresh.
            instance.gpus.clear()
            EngineInstance.objects.filter(pk=instance.pk).update(node=None, port=None)
            instance.refresh_from_db()
        instance_set_desired(instance=instance, desired=EngineInstance.Desired.RUNNING, reason=f"launched by {who}")
    elif action in ("stop", "drain"):
        instance.drain = action == "drain"
        instance.save(update_fields=["drain"])
        instance_set_desired(instance=instance, desired=EngineInstance.Desired.STOPPED,
                             reason=f"{'drain' if instance.drain else 'stop'} requested by {who}")
    else:
        raise ValueError(f"unknown action {action!r}")
