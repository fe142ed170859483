from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.catalog.engine_settings import EngineSettingsError
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


def _wanted(tier: ModelTier) -> dict[str, int]:
    """Replicas `tier` wants per pool: none when disabled (its engines drain and stop)."""
    if not tier.enabled:
        return {"standard": 0, "large": 0}
    try:
        large = tier.settings.large_pool_replicas  # an isolated pool for requests past the large-image threshold
    except EngineSettingsError:
        large = 0
    return {"standard": tier.replicas, "large": large}


def tier_replicas_sync() -> int:
    """Make each tier's engines what its desired replicas say: the control is the count on the
    tier. Missing replicas of an enabled tier are launched (a fully stopped instance of the
    tier is launched again before a new one is made); the surplus (a count lowered, a tier
    disabled) is drained, least useful first. Returns how many instances changed."""
    changed = 0
    # External engines are registered by URL, one row each, by an operator: never made or drained here.
    for tier_id in ModelTier.objects.exclude(engine_kind=ModelTier.EngineKind.EXTERNAL).values_list("pk", flat=True):
        with transaction.atomic():
            # Under the tier's lock, as an operator's action changes its count and its instances
            # together (instance_action): never the count before the action and the instances after.
            tier = ModelTier.objects.select_for_update().filter(pk=tier_id).first()
            if tier is not None:
                changed += _tier_sync(tier)
    return changed


def _tier_sync(tier: ModelTier) -> int:
    changed = 0
    A = EngineInstance.Actual
    wanted_running = EngineInstance.Desired.RUNNING
    instances = list(tier.instances.all())
    for pool, replicas in _wanted(tier).items():
        mine = [i for i in instances if i.pool == pool]
        running = [i for i in mine if i.desired_state == wanted_running]
        spare = sorted((i for i in mine if i.desired_state != wanted_running and i.pid is None
                        and i.actual_state in (A.STOPPED, A.FAILED)), key=lambda i: i.pk)
        for _ in range(replicas - len(running)):
            if spare:
                instance = spare.pop(0)
                _relaunch(instance, reason=f"{tier.name} wants {replicas} {pool} replica(s)")
            else:
                EngineInstance.objects.create(tier=tier, pool=pool)
            changed += 1
        # Least useful first: not serving, then unhealthy, then the newest.
        surplus = sorted(running, key=lambda i: (i.actual_state == A.RUNNING, i.healthy, -i.pk))
        for instance in surplus[: max(0, len(running) - replicas)]:
            instance.drain = True
            instance.save(update_fields=["drain"])
            why = "tier disabled" if not tier.enabled else f"{tier.name} wants {replicas} {pool} replica(s)"
            instance_set_desired(instance=instance, desired=EngineInstance.Desired.STOPPED,
                                 reason=f"drain: {why}")
            changed += 1
    return changed


def _relaunch(instance: EngineInstance, *, reason: str) -> None:
    """Launch `instance` again from scratch: no backoff, and placed afresh when no process of it
    holds its GPUs (which may have gone to another engine meanwhile)."""
    fields = {"restart_count": 0, "next_start_at": None, "drain": False, "drain_started_at": None}
    if instance.actual_state == EngineInstance.Actual.FAILED:
        fields["actual_state"] = EngineInstance.Actual.PENDING
    if instance.pid is None:
        instance.gpus.clear()
        fields.update(node=None, port=None)
    EngineInstance.objects.filter(pk=instance.pk).update(**fields)
    instance.refresh_from_db()
    instance_set_desired(instance=instance, desired=EngineInstance.Desired.RUNNING, reason=reason)


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
        tier = instance.serving_tier()  # a candidate may need what the proposed change asks
        need = tier.gpus_per_replica
        if tier.runs_on_cpu:
            need = 0  # vLLM's CPU build: host memory and cores, no GPU
        elif tier.engine_kind in (ModelTier.EngineKind.VLLM, ModelTier.EngineKind.SGLANG):
            need = max(need, tier.settings.tensor_parallel_size)
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


def tier_engines_replace(*, tier: ModelTier, candidate: EngineInstance | None, reason: str) -> None:
    """After a change of what `tier`'s engines run: its candidate, an engine already running the
    tier as changed, becomes one of its replicas when it still runs; every engine that ran the
    tier as it was drains, and the replicas sync launches the tier's replacements."""
    promoted = None
    if candidate is not None and EngineInstance.objects.filter(
            pk=candidate.pk, pool="candidate", desired_state=EngineInstance.Desired.RUNNING).update(
            pool="standard", overrides={}):
        promoted = candidate.pk
        EngineEvent.objects.create(instance_id=promoted, from_state=candidate.actual_state,
                                   to_state=candidate.actual_state, reason=f"now a replica: {reason}")
    for instance in (tier.instances.filter(desired_state=EngineInstance.Desired.RUNNING)
                     .exclude(pool="candidate").exclude(pk=promoted)):
        instance.drain = True
        instance.save(update_fields=["drain"])
        instance_set_desired(instance=instance, desired=EngineInstance.Desired.STOPPED,
                             reason=f"drain, to be replaced: {reason}")


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


@transaction.atomic
def tier_replicas_set(*, tier: ModelTier, pool: str = "standard", replicas: int, actor: str) -> None:
    """Set how many replicas `tier` wants in `pool` (the sync launches or drains to match),
    recorded with who set it."""
    tier = ModelTier.objects.select_for_update().get(pk=tier.pk)
    before = {"replicas": tier.replicas, "large_pool_replicas": tier.settings.large_pool_replicas}
    if pool == "large":
        tier.engine_settings = {**tier.engine_settings, "large_pool_replicas": replicas}
    else:
        tier.replicas = replicas
    tier.save()
    audit_record(actor=actor, action=AuditEntry.Action.CHANGED, obj=tier, before=before,
                 after={"replicas": tier.replicas, "large_pool_replicas": tier.settings.large_pool_replicas})


class FleetActionRefused(Exception):
    """An action that cannot be done as asked; the message says why."""


def external_engine_register(*, tier: ModelTier, url: str, actor: str, served_model_name: str = "") -> EngineInstance:
    """An engine started elsewhere, registered by its URL and the model name it serves under
    (empty: the tier's name): it joins rotation once healthy. FleetActionRefused when the URL is
    not one the control plane may call."""
    try:
        URLValidator(schemes=["http", "https"])(url)
    except ValidationError:
        raise FleetActionRefused(f"{url!r} is not an http(s) URL") from None
    served_model_name = served_model_name.strip()
    if len(served_model_name) > 200 or any(c.isspace() or not c.isprintable() for c in served_model_name):
        raise FleetActionRefused("the served model name is at most 200 characters, without spaces")
    instance = EngineInstance(tier=tier, external_url=url, served_model_name=served_model_name)
    refused = instance.external_url_refusal()
    if refused:
        raise FleetActionRefused(refused)
    instance.save()
    EngineEvent.objects.create(instance=instance, from_state="pending", to_state="pending",
                               reason=f"registered at {url} serving {instance.model_name} by {actor}")
    return instance


@transaction.atomic
def instance_action(*, instance: EngineInstance, action: str, user, replace: bool = False) -> str:
    """What an operator asks of an instance from the fleet page, done exactly as said, and what
    it did (for the page to show):

    - drain: no new work, stopped once its requests finish; stop: stopped now. Either lowers the
      tier's desired replicas by one, unless `replace`, when a replacement is launched instead;
    - launch: a stopped instance runs again, raising the desired replicas by one; a failed one
      that is still wanted starts again at once, without its backoff.
    """
    who = getattr(user, "username", "") or "system"
    before = {"desired_state": instance.desired_state, "drain": instance.drain}
    done = _instance_action(instance, action, who, replace)
    instance.refresh_from_db()
    audit_record(actor=who, action=AuditEntry.Action.CHANGED, obj=instance, before=before,
                 after={"desired_state": instance.desired_state, "drain": instance.drain})
    return done


def _instance_action(instance: EngineInstance, action: str, who: str, replace: bool) -> str:
    tier = instance.tier
    external = tier.engine_kind == ModelTier.EngineKind.EXTERNAL
    wanted = instance.desired_state == EngineInstance.Desired.RUNNING
    if action == "launch":
        if not tier.enabled:
            raise FleetActionRefused(f"{tier.name} is disabled: enable the tier first")
        if external:
            instance_set_desired(instance=instance, desired=EngineInstance.Desired.RUNNING,
                                 reason=f"back in rotation, by {who}")
            return f"{instance} is back in rotation."
        if not wanted:
            _count_change(tier, instance.pool, +1, who)
        _relaunch(instance, reason=f"launched by {who}")
        return f"{instance} launched; {_wants(tier, instance.pool)}."
    if action in ("stop", "drain"):
        if not wanted:
            raise FleetActionRefused(f"{instance} is already stopping or stopped")
        instance.drain = action == "drain"
        instance.save(update_fields=["drain"])
        if not external and not replace:
            _count_change(tier, instance.pool, -1, who)
        instance_set_desired(instance=instance, desired=EngineInstance.Desired.STOPPED,
                             reason=f"{action} requested by {who}" + (", with a replacement" if replace else ""))
        if external:
            return f"{instance} is out of rotation."
        done = "draining" if action == "drain" else "stopping"
        return f"{instance} is {done}; " + ("a replacement is launched." if replace else f"{_wants(tier, instance.pool)}.")
    raise ValueError(f"unknown action {action!r}")


def _count_change(tier: ModelTier, pool: str, by: int, who: str) -> None:
    tier.refresh_from_db()
    current = tier.settings.large_pool_replicas if pool == "large" else tier.replicas
    tier_replicas_set(tier=tier, pool=pool, replicas=max(0, current + by), actor=who)
    tier.refresh_from_db()


def _wants(tier: ModelTier, pool: str) -> str:
    count = tier.settings.large_pool_replicas if pool == "large" else tier.replicas
    return f"{tier.name} now wants {count} {'large-image ' if pool == 'large' else ''}replica{'s' * (count != 1)}"
