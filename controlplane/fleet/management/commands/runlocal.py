"""Run the whole system in the foreground: web (ASGI), a Celery worker that is also this
host's node agent, and beat. Ctrl-C stops all of it, engines included."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from django.conf import settings
from django.contrib.staticfiles.finders import get_finders
from django.core.management import call_command
from django.core.management.base import BaseCommand

from controlplane.fleet.models import Node
from workers.supervision import node_stop_all


def _static_sources() -> str:
    """What the static files are made from: every source file's path, size and time."""
    seen = []
    for finder in get_finders():
        for path, storage in finder.list(["CVS", ".*", "*~"]):
            stat = os.stat(storage.path(path))
            seen.append(f"{path} {stat.st_size} {stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(sorted(seen)).encode()).hexdigest()


class Command(BaseCommand):
    help = "Start web, worker (node agent) and beat; stop everything on Ctrl-C."

    def _collect_static(self) -> None:
        """Hashed, compressed static files for the web process to serve. Locked, and skipped
        when the sources have not changed since the last collection: another server on this
        host may be serving STATIC_ROOT, and collecting rewrites (deletes, then writes) the
        files it serves."""
        root = Path(settings.STATIC_ROOT)
        with open(root / ".collect.lock", "w") as lock:  # beside the files: whoever shares them shares it
            fcntl.flock(lock, fcntl.LOCK_EX)
            marker = root / ".collected-from"
            sources = _static_sources()
            if marker.exists() and marker.read_text() == sources:
                return
            call_command("collectstatic", interactive=False, verbosity=0)
            marker.write_text(sources)

    def add_arguments(self, parser):
        parser.add_argument("--host", default=settings.HOST)
        parser.add_argument("--port", type=int, default=settings.PORT)

    def handle(self, *args, host, port, **options):
        if settings.CELERY_BROKER_URL == "filesystem://":
            # Messages left by an earlier run are stale (their work is re-planned anyway).
            queue_dir = settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"]
            shutil.rmtree(queue_dir, ignore_errors=True)
            os.makedirs(queue_dir, exist_ok=True)
        self._collect_static()
        python = sys.executable
        node_queue = Node.queue_for(settings.NODE_NAME)
        # What benchmark profiles without a URL of their own load-test: this very server.
        reachable = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        os.environ["GATEWAY_PUBLIC_URL"] = f"http://{reachable}:{port}"
        # No load balancer to tell: a web process told to stop stops accepting at once, and its
        # streams end within the time this runner gives its children to stop.
        os.environ.setdefault("SHUTDOWN_DELAY_S", "0")
        os.environ.setdefault("SHUTDOWN_GRACE_S", "10")
        commands = {
            "web": [python, "-m", "controlplane.serving", "--host", host, "--port", str(port),
                    "--log-level", "warning"],
            "worker": [python, "-m", "celery", "-A", "controlplane", "worker", "-Q",
                       f"default,{node_queue}", "--pool", "threads", "--concurrency", "4",
                       "-n", f"agent@{settings.NODE_NAME}", "--loglevel", "WARNING",
                       "--without-gossip", "--without-mingle"],
            "beat": [python, "-m", "celery", "-A", "controlplane", "beat", "--loglevel", "WARNING",
                     "--pidfile", ""],
        }
        children = {name: subprocess.Popen(argv, cwd=settings.BASE_DIR) for name, argv in commands.items()}
        stopping = False

        def stop(*_):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        base = f"http://{host}:{port}"
        self._wait_ready(base, children)
        mode = "embedded (SQLite, file broker)" if settings.EMBEDDED_BROKER else "PostgreSQL/Redis"
        self.stdout.write(
            f"\nControl plane running ({mode}):\n"
            f"  Dashboard   {base}/   (login operator/operator)\n"
            f"  Gateway     {base}/v1   (OpenAI-compatible; key printed above)\n"
            f"  API docs    {base}/api/docs/\n"
            f"  Admin       {base}/admin/\n"
            "Press Ctrl-C to stop.\n"
        )
        exit_code = 0
        restarts: dict[str, list[float]] = {name: [] for name in commands}
        while not stopping:
            for name, child in list(children.items()):
                if child.poll() is None or stopping:
                    continue
                # A crashed child is restarted, as a process supervisor would; a child that
                # keeps crashing stops the whole run rather than spin.
                recent = [t for t in restarts[name] if time.monotonic() - t < 60] + [time.monotonic()]
                restarts[name] = recent
                if len(recent) > 5:
                    self.stderr.write(f"{name} exited {len(recent)} times in a minute; stopping")
                    stopping, exit_code = True, 1
                    break
                self.stderr.write(f"{name} exited with {child.returncode}; restarting it")
                children[name] = subprocess.Popen(commands[name], cwd=settings.BASE_DIR)
            time.sleep(0.5)
        self._shutdown(children)
        sys.exit(exit_code)

    def _wait_ready(self, base, children, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if children["web"].poll() is not None:
                return
            try:
                urllib.request.urlopen(f"{base}/login/", timeout=2)
                return
            except OSError:
                time.sleep(0.3)

    def _shutdown(self, children):
        self.stdout.write("Stopping web, worker and beat…")
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in children.values():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()

        stopped = node_stop_all(settings.NODE_NAME, "local run stopped")
        self.stdout.write(f"Stopped {stopped} engine(s).")
