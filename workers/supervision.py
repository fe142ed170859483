"""The node agent: launch, watch and restart the engines placed on this host.

Runs inside the Celery worker that consumes this node's queue. The database row of each
instance is the truth; this code moves it from state to state and logs why.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import logging
import shutil
import subprocess
from pathlib import Path

import httpx
from django.conf import settings
from django.db import connection
from django.utils import timezone

from controlplane.fleet.models import EngineInstance, Node
from controlplane.fleet.services import instance_transition, node_register
from controlplane.imaging.tokens import processor_options
from workers.engines import process
from workers.engines.launch import LaunchSpec, build_command

log = logging.getLogger(__name__)
A = EngineInstance.Actual
BACKOFF_BASE, BACKOFF_CAP, HEALTHY_RESET = 10, 300, dt.timedelta(minutes=10)
STARTUP_GRACE = {"simulator": dt.timedelta(seconds=30), "vllm": dt.timedelta(minutes=15)}


def restart_delay(restarts: int) -> int:
    """Seconds to wait before restart number `restarts` (1-based): 10 s doubling to 300 s."""
    return min(BACKOFF_CAP, BACKOFF_BASE * 2 ** max(0, restarts - 1))


def detect_gpus() -> list[dict]:
    if settings.NODE_GPUS:
        gpus = []
        for item in settings.NODE_GPUS.split(","):
            index, model, memory = (item.split(":") + ["", ""])[:3]
            gpus.append({"index": int(index), "model": model, "memory_mib": int(memory or 0)})
        return gpus
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout
        except (subprocess.SubprocessError, OSError):
            log.warning("nvidia-smi failed; registering no GPUs")
            return []
        return [
            {"index": int(i), "model": name.strip(), "memory_mib": int(float(mem))}
            for i, name, mem in (line.split(",") for line in out.strip().splitlines() if line)
        ]
    return []


def detect_vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return ""


def this_node() -> Node:
    return node_register(name=settings.NODE_NAME, address=settings.NODE_ADDRESS,
                         gpus=detect_gpus(), vllm_version=detect_vllm_version())


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


def _launch_spec(instance: EngineInstance, port: int) -> LaunchSpec:
    tier = instance.tier
    policy = tier.resolution_policy
    vision = tier.kind == tier.Kind.VISION and policy is not None
    return LaunchSpec(
        engine_kind=tier.engine_kind,
        model_id=tier.model_id,
        served_model_name=tier.name,
        family=tier.family,
        host="0.0.0.0" if settings.NODE_ADDRESS not in ("127.0.0.1", "localhost") else "127.0.0.1",
        port=port,
        gpu_indices=tuple(instance.gpus.values_list("index", flat=True)),
        settings=tier.engine_settings or {},
        images_per_prompt=policy.max_images_per_request if vision else None,
        processor_kwargs=processor_options(tier.family, min_pixels=policy.min_pixels,
                                          max_pixels=policy.max_pixels) if vision else {},
        max_input_pixels=policy.max_input_pixels if vision else None,
        allowed_media_domains=tuple((tier.engine_settings or {}).get("allowed_media_domains", ())),
        api_key=instance.api_key,
    )


def _free_port(node: Node, instance: EngineInstance) -> int:
    taken = set(
        EngineInstance.objects.filter(node=node).exclude(pk=instance.pk)
        .exclude(port__isnull=True).values_list("port", flat=True)
    )
    port = settings.ENGINE_PORT_BASE
    while port in taken or not process.port_is_free(port):
        port += 1
    return port


def engine_launch(instance: EngineInstance, node: Node) -> None:
    port = _free_port(node, instance)
    try:
        argv, env = build_command(_launch_spec(instance, port))
    except ValueError as exc:
        instance_transition(instance=instance, to_state=A.FAILED, reason=f"cannot launch: {exc}")
        return
    log_path = Path(settings.ENGINE_LOG_DIR) / f"instance-{instance.pk}.log"
    pid = process.spawn(argv, env, log_path=log_path, instance_id=engine_marker(instance),
                        cwd=str(settings.BASE_DIR))
    instance_transition(
        instance=instance, to_state=A.STARTING, reason=f"launched pid {pid} on port {port}",
        pid=pid, port=port, command=argv, log_path=str(log_path), started_at=timezone.now(),
        healthy=False, next_start_at=None,
    )


def engine_stop(instance: EngineInstance, reason: str) -> None:
    if instance.pid and process.is_alive(instance.pid, instance_id=engine_marker(instance)):
        process.terminate(instance.pid)
    instance_transition(instance=instance, to_state=A.STOPPED, reason=reason, pid=None,
                        healthy=False)


def _health(instance: EngineInstance) -> bool:
    try:
        response = httpx.get(f"{instance.base_url}/health", timeout=settings.ENGINE_HEALTH_TIMEOUT)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def engine_check(instance: EngineInstance, now: dt.datetime) -> None:
    """One supervision step for one instance on this node."""
    desired_running = instance.desired_state == EngineInstance.Desired.RUNNING
    alive = process.is_alive(instance.pid, instance_id=engine_marker(instance))
    if not desired_running:
        if alive or instance.actual_state not in (A.STOPPED, A.PENDING):
            engine_stop(instance, "stopped as requested")
        return
    if not alive:
        if instance.actual_state in (A.STARTING, A.RUNNING, A.UNHEALTHY):
            restarts = instance.restart_count + 1
            delay = restart_delay(restarts)
            instance_transition(
                instance=instance, to_state=A.CRASHED,
                reason=f"engine process {instance.pid} exited; restart {restarts} in {delay}s",
                pid=None, healthy=False, restart_count=restarts,
                next_start_at=now + dt.timedelta(seconds=delay),
            )
            return
        if instance.next_start_at is None or instance.next_start_at <= now:
            if instance.actual_state != A.FAILED:
                engine_launch(instance, instance.node)
        return
    healthy = _health(instance) and not process.is_stopped(instance.pid)
    fields = {"last_health_at": now, "healthy": healthy}
    if healthy:
        if instance.started_at and now - instance.started_at > HEALTHY_RESET:
            fields["restart_count"] = 0
        if instance.actual_state != A.RUNNING:
            instance_transition(instance=instance, to_state=A.RUNNING, reason="health check passed",
                                **fields)
        else:
            EngineInstance.objects.filter(pk=instance.pk).update(**fields)
        return
    grace = STARTUP_GRACE.get(instance.tier.engine_kind, dt.timedelta(seconds=30))
    if instance.actual_state == A.STARTING and instance.started_at and now - instance.started_at < grace:
        EngineInstance.objects.filter(pk=instance.pk).update(**fields)
        return
    if instance.actual_state != A.UNHEALTHY:
        instance_transition(instance=instance, to_state=A.UNHEALTHY,
                            reason="health check failed; out of rotation", **fields)
    else:
        EngineInstance.objects.filter(pk=instance.pk).update(**fields)


def node_reconcile(node_name: str | None = None) -> int:
    """Bring every instance placed on this node to its desired state. Adopts running engines.

    One pass at a time per node: overlapping passes would each relaunch the same crashed
    engine. A pass that finds the lock taken skips; the next beat tick comes soon.
    """
    node = this_node() if node_name is None else Node.objects.get(name=node_name)
    Node.objects.filter(pk=node.pk).update(last_seen_at=timezone.now())
    lock_path = Path(settings.ENGINE_LOG_DIR) / f".reconcile-{node.name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("a reconcile pass for %s is already running; skipping", node.name)
            return 0
        now = timezone.now()
        instances = list(EngineInstance.objects.filter(node=node).select_related(
            "tier", "node", "tier__resolution_policy"))
        for instance in instances:
            try:
                engine_check(instance, now)
            except Exception:
                log.exception("supervising %s failed", instance)
        stop_orphans(node)
        return len(instances)


def stop_orphans(node: Node) -> int:
    """Stop engines this node launched that no instance row owns (any more)."""
    owned = {
        engine_marker(i): i.pid for i in EngineInstance.objects.filter(node=node).exclude(pid=None)
    }
    stopped = 0
    for pid, marker in process.marked_processes(f"{deployment_id()}/{settings.NODE_NAME}/").items():
        if owned.get(marker) != pid:
            log.warning("stopping orphaned engine pid %s (%s)", pid, marker)
            process.terminate(pid, grace=5)
            stopped += 1
    return stopped


def node_stop_all(node_name: str, reason: str) -> int:
    """Stop every engine process of this node (used when a local run shuts down)."""
    stopped = 0
    for instance in EngineInstance.objects.filter(node__name=node_name).select_related("tier", "node"):
        if instance.pid:
            engine_stop(instance, reason)
            stopped += 1
    node = Node.objects.filter(name=node_name).first()
    if node is not None:
        stopped += stop_orphans(node)
    return stopped
