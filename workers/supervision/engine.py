"""One engine on this node: launch it, stop it, drain it, and move its row through its states."""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import connection
from django.utils import timezone

from controlplane.catalog.tokenizers import tier_tokenizer_publish
from controlplane.fleet.models import EngineInstance, Node
from controlplane.fleet.services import instance_transition
from controlplane.imaging.tokens import processor_options
from workers.engines import process
from workers.engines.launch import LaunchSpec, build_command
from workers.supervision import compat
from workers.supervision.liveness import assess, observe

if TYPE_CHECKING:
    from controlplane.catalog.models import ModelTier

log = logging.getLogger(__name__)
A = EngineInstance.Actual
BACKOFF_BASE, BACKOFF_CAP, HEALTHY_RESET = 10, 300, dt.timedelta(minutes=10)
CRASH_LOOP_AFTER = 3  # restarts without 10 healthy minutes in between
HUNG_RESTART_AFTER = dt.timedelta(seconds=60)  # out of rotation this long: restart it
DRAIN_GRACE = dt.timedelta(seconds=3)  # gateways' instance caches (2 s) must forget it first
STARTUP_GRACE = {"simulator": dt.timedelta(seconds=30), "vllm": dt.timedelta(minutes=15),
                 "sglang": dt.timedelta(minutes=15)}
# Engines that load the model on this node, whose tokenizer the gateway can then count with.
LOADS_THE_MODEL = ("vllm", "sglang")
LOG_TAIL_BYTES = 4096


def restart_delay(restarts: int) -> int:
    """Seconds to wait before restart number `restarts` (1-based): 10 s doubling to 300 s."""
    return min(BACKOFF_CAP, BACKOFF_BASE * 2 ** max(0, restarts - 1))


def deployment_id() -> str:
    """Which control plane this is, from the database it runs on.

    Engines are tagged with it, so that two deployments (or test runs) on one machine never
    take each other's engines for orphans.
    """
    db = connection.settings_dict
    key = f"{db['ENGINE']}|{db.get('HOST')}|{db.get('PORT')}|{db['NAME']}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def engine_marker(instance: EngineInstance) -> str:
    """Tags the engine's environment so a reused pid is never mistaken for the engine."""
    return f"{deployment_id()}/{settings.NODE_NAME}/{instance.pk}"


def launch_spec(instance: EngineInstance, port: int, tier: ModelTier | None = None) -> LaunchSpec:
    """How `instance` starts: as `tier` runs it (its serving tier, read when not given)."""
    return tier_launch_spec(
        tier or instance.serving_tier(), port=port, gpu_indices=tuple(instance.gpus.values_list("index", flat=True)),
        api_key=instance.api_key, transformers_version=instance.node.transformers_version if instance.node else "")


def tier_launch_spec(tier: ModelTier, *, port: int, gpu_indices: tuple[int, ...] = (), api_key: str | None = None,
                     transformers_version: str = "") -> LaunchSpec:
    """How an engine of `tier` is started (also what the tier page previews, before saving)."""
    policy = tier.resolution_policy
    vision = tier.kind == tier.Kind.VISION and policy is not None
    engine = tier.settings
    return LaunchSpec(
        engine_kind=tier.engine_kind,
        model_id=tier.model_id,
        served_model_name=tier.name,
        family=tier.family,
        host="0.0.0.0" if settings.NODE_ADDRESS not in ("127.0.0.1", "localhost") else "127.0.0.1",
        port=port,
        gpu_indices=gpu_indices,
        settings=engine,
        images_per_prompt=policy.max_images_per_request if vision else None,
        processor_kwargs=processor_options(tier.family, min_pixels=policy.min_pixels,
                                           max_pixels=policy.max_pixels) if vision else {},
        max_input_pixels=policy.max_input_pixels if vision else None,
        allowed_media_domains=engine.allowed_media_domains,
        api_key=api_key,
        vllm_python=settings.VLLM_PYTHON,
        sglang_python=settings.SGLANG_PYTHON,
        transformers_version=transformers_version,
    )


# Engines launched in the same pass (checks run in parallel) must not pick the same port: a
# port is not bound until its engine starts listening, so choosing and recording it happen
# under one lock, and ports handed out recently stay taken while their engines start.
_port_lock = threading.Lock()
_recently_given: dict[int, float] = {}


def _free_port(node: Node, instance: EngineInstance) -> int:
    taken = set(
        EngineInstance.objects.filter(node=node).exclude(pk=instance.pk)
        .exclude(port__isnull=True).values_list("port", flat=True)
    )
    now = time.monotonic()
    for port, given in list(_recently_given.items()):
        if now - given > 120:
            del _recently_given[port]
    port = settings.ENGINE_PORT_BASE
    while port in taken or port in _recently_given or not process.port_is_free(port):
        port += 1
    _recently_given[port] = now
    return port


def engine_launch(instance: EngineInstance, node: Node) -> None:
    tier = instance.serving_tier()  # a candidate runs the tier as a proposed change makes it
    refusal = compat.launch_refusal(tier, node)
    if refusal:
        instance_transition(instance=instance, to_state=A.FAILED, reason=refusal)
        return
    with _port_lock:
        port = _free_port(node, instance)
    try:
        spec = launch_spec(instance, port, tier)
        argv, env = build_command(spec)
    except ValueError as exc:
        instance_transition(instance=instance, to_state=A.FAILED, reason=f"cannot launch: {exc}")
        return
    if tier.engine_kind == "sglang":
        refusal = compat.sglang_refusal(argv, env)
        if refusal:
            instance_transition(instance=instance, to_state=A.FAILED, reason=f"cannot launch: {refusal}")
            return
    if tier.engine_kind in LOADS_THE_MODEL and not instance.overrides:
        # The model is on this node: its tokenizer lets the gateway count prompts exactly.
        tier_tokenizer_publish(tier=instance.tier, source=f"node {node.name}")
    log_path = Path(settings.ENGINE_LOG_DIR) / f"instance-{instance.pk}.log"
    pid = process.spawn(argv, env, log_path=log_path, instance_id=engine_marker(instance),
                        cwd=str(settings.BASE_DIR), nice=spec.nice)
    instance_transition(
        instance=instance, to_state=A.STARTING, reason=f"launched pid {pid} on port {port}",
        pid=pid, port=port, command=argv, log_path=str(log_path), started_at=timezone.now(),
        healthy=False, next_start_at=None, probe_failures=0, last_progress_at=None,
    )


def engine_stop(instance: EngineInstance, reason: str) -> None:
    if instance.pid and process.is_alive(instance.pid, instance_id=engine_marker(instance)):
        process.terminate(instance.pid)
    process.stop_marked(engine_marker(instance))  # children that outlived their leader
    instance_transition(instance=instance, to_state=A.STOPPED, reason=reason, pid=None,
                        healthy=False, drain=False, drain_started_at=None)


def _log_tail(instance: EngineInstance) -> str:
    try:
        with open(instance.log_path, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - LOG_TAIL_BYTES))
            return handle.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return instance.log_tail


def _crashed(instance: EngineInstance, now: dt.datetime, why: str) -> None:
    process.stop_marked(engine_marker(instance))  # its children would hold the GPU on
    restarts = instance.restart_count + 1
    delay = restart_delay(restarts)
    state = A.CRASH_LOOP if restarts >= CRASH_LOOP_AFTER else A.CRASHED
    instance_transition(
        instance=instance, to_state=state, reason=f"{why}; restart {restarts} in {delay}s",
        pid=None, healthy=False, restart_count=restarts, next_start_at=now + dt.timedelta(seconds=delay),
        log_tail=_log_tail(instance),
    )


def _drain(instance: EngineInstance, alive: bool, now: dt.datetime) -> None:
    """No new work (the gateway skips non-running instances); stop once in-flight work is done."""
    if instance.actual_state != A.DRAINING:
        instance_transition(instance=instance, to_state=A.DRAINING,
                            reason="draining: no new requests; waiting for in-flight ones",
                            drain_started_at=now, healthy=False)
        return
    seen = False
    if alive:  # only look: a probe would itself be in-flight work on a draining engine
        fields = {}
        if observe(instance, now, fields) is not None:
            instance.num_running, instance.num_waiting = fields["num_running"], fields["num_waiting"]
            EngineInstance.objects.filter(pk=instance.pk).update(**fields)
            seen = True
    waited = now - (instance.drain_started_at or now)
    busy = instance.num_running + instance.num_waiting
    timeout = dt.timedelta(seconds=settings.ENGINE_DRAIN_TIMEOUT_S)
    # Idle only as the engine says so now: counters from an older scrape (one taken before
    # its last requests arrived, say) would stop it under them.
    if not alive or (waited >= DRAIN_GRACE and seen and busy == 0):
        engine_stop(instance, f"drained after {waited.seconds}s")
    elif waited >= timeout:
        engine_stop(instance, f"drain timed out after {waited.seconds}s with {busy:g} requests in flight")


def engine_check(instance: EngineInstance, now: dt.datetime) -> None:
    """One supervision step for one instance on this node."""
    desired_running = instance.desired_state == EngineInstance.Desired.RUNNING
    alive = process.is_alive(instance.pid, instance_id=engine_marker(instance))
    if not desired_running:
        if instance.drain and (alive or instance.actual_state == A.DRAINING):
            _drain(instance, alive, now)
        elif alive or instance.actual_state not in (A.STOPPED, A.PENDING, A.FAILED):
            engine_stop(instance, "stopped as requested")
        return
    if not alive:
        if instance.actual_state in (A.STARTING, A.RUNNING, A.UNHEALTHY):
            _crashed(instance, now, f"engine process {instance.pid} exited")
        elif instance.actual_state != A.FAILED and (instance.next_start_at is None or instance.next_start_at <= now):
            engine_launch(instance, instance.node)
        return
    fields = {"last_health_at": now, "log_tail": _log_tail(instance)}
    if process.is_stopped(instance.pid):
        verdict_healthy, reason = False, "engine process is stopped (SIGSTOP)"
    else:
        verdict = assess(instance, now, fields)
        verdict_healthy, reason = verdict.healthy, verdict.reason
    fields["healthy"] = verdict_healthy
    if verdict_healthy:
        if instance.started_at and now - instance.started_at > HEALTHY_RESET:
            fields["restart_count"] = 0
        if instance.actual_state != A.RUNNING:
            instance_transition(instance=instance, to_state=A.RUNNING, reason="serving: health and probe passed",
                                **fields)
            if instance.tier.engine_kind in LOADS_THE_MODEL and not instance.overrides:
                # A model named by its hub id is in the local cache only once vLLM has
                # downloaded it: published now if it was not found at launch.
                tier_tokenizer_publish(tier=instance.tier, source=f"node {instance.node.name}")
        else:
            EngineInstance.objects.filter(pk=instance.pk).update(**fields)
        return
    grace = STARTUP_GRACE.get(instance.serving_tier().engine_kind, dt.timedelta(seconds=30))
    if instance.actual_state == A.STARTING and instance.started_at and now - instance.started_at < grace:
        EngineInstance.objects.filter(pk=instance.pk).update(**fields)
        return
    if instance.actual_state != A.UNHEALTHY:
        instance_transition(instance=instance, to_state=A.UNHEALTHY, reason=f"{reason}; out of rotation",
                            **fields)
        return
    EngineInstance.objects.filter(pk=instance.pk).update(**fields)
    unhealthy_since = instance.events.filter(to_state=A.UNHEALTHY).values_list("created_at", flat=True).first()
    if unhealthy_since and now - unhealthy_since > HUNG_RESTART_AFTER:
        process.terminate(instance.pid, grace=5)
        _crashed(instance, now, f"{reason} for over {HUNG_RESTART_AFTER.seconds}s; killed")
