"""Start and stop a whole system (web, worker, beat, engines) as `make run` does."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port nothing is bound to, for a server a test starts, outside the kernel's range of
    ephemeral ports. A port bound to 0 and let go comes from that range, where any outgoing
    connection (to Redis, to PostgreSQL, to an engine) may take it as its own before the
    server binds it: a whole system's web server was once refused its port for a minute. Each
    test worker draws from a range of its own."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = max(worker + 1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    low, high = 10_000, max(10_100, ephemeral)  # below it: ENGINE_PORT_BASE's 8100 and on stay clear
    share = (high - low) // workers
    first = low + worker * share
    for _ in range(200):
        port = random.randrange(first, first + share)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {first} and {first + share}")


def wait_for(check, *, timeout: float, interval: float = 0.2, what: str = "condition"):
    """Poll `check` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # noqa: BLE001 - the condition is still coming up
            last_error = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


class RedisServer:
    """A redis-server process of the test's own, with no persistence."""

    def __init__(self, *, password: str | None = None, unix_socket: str | None = None, host: str = "127.0.0.1"):
        self.port, self.process = free_port(), None
        self.password, self.unix_socket, self.host = password, unix_socket, host

    @property
    def url(self) -> str:
        return f"redis://{f':{self.password}@' if self.password else ''}{self.host}:{self.port}/0"

    def start(self) -> None:
        options = [*(["--requirepass", self.password] if self.password else []),
                   # other hosts (network namespaces of a test) connect to a host other than loopback
                   *(["--protected-mode", "no"] if self.host != "127.0.0.1" else []),
                   *(["--unixsocket", self.unix_socket] if self.unix_socket else [])]
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", *{"127.0.0.1", self.host}, "--save", "", "--appendonly", "no",
             *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: redis.Redis.from_url(self.url).ping(), timeout=10, what="the test's Redis")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)


@dataclass
class System:
    env: dict
    var_dir: Path
    port: int
    process: subprocess.Popen | None = None
    api_key: str = ""
    log_path: Path = field(default=None)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def manage(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, check=check, timeout=300)

    def start(self) -> None:
        self.manage("migrate", "--noinput")
        self.manage("seed_demo")
        self.api_key = (self.var_dir / "demo_api_key").read_text().strip()
        self.log_path = self.var_dir / "system.log"
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "runlocal", "--port", str(self.port)],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_for(self._web_up, timeout=60, what=f"the web server (see {self.log_path})")

    def _web_up(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"system exited early:\n{self.log_path.read_text()[-3000:]}")
        return httpx.get(f"{self.base_url}/login/", timeout=2).status_code == 200

    def wait_for_engines(self, tiers=("text", "vlm-lite", "vlm-flagship"), timeout=90) -> None:
        def ready():
            for tier in tiers:
                response = httpx.post(
                    f"{self.base_url}/v1/chat/completions", timeout=10,
                    headers={"Authorization": f"Bearer {self.api_key}"},
                    json={"model": tier, "max_tokens": 1,
                          "messages": [{"role": "user", "content": "ping"}]},
                )
                if response.status_code != 200:
                    return False
            return True

        wait_for(ready, timeout=timeout, interval=0.5, what=f"engines for {tiers}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)  # what Ctrl-C does
        try:
            self.process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def system_env(*, var_dir: Path, extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "CELERY_BROKER_URL", "USAGE_OUTBOX",
                        "NODE_NAME", "VAR_DIR")}
    env.update({
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "VAR_DIR": str(var_dir),
        "SECRET_KEY": "system-test-secret-" + "s" * 40,
        "DEBUG": "false",
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "FLEET_RECONCILE_SECONDS": "2",
        "ROLLUP_SECONDS": "2",
        "ALERTS_EVALUATE_SECONDS": "2",
        "ALERTS_DELIVER_SECONDS": "1",
        "GATEWAY_KEY_CACHE_SECONDS": "2",
        "ENGINE_PORT_BASE": str(20000 + (os.getpid() * 7) % 20000),
        "PYTHONUNBUFFERED": "1",
        # Every client of these tests comes from 127.0.0.1, a crowd of hundreds included: the
        # caps per address (tested on their own, tests/controlplane/test_serving.py) are off.
        "HTTP_MAX_CONNECTIONS_PER_CLIENT": "0",
        "HTTP_MAX_BODY_READS_PER_CLIENT": "0",
    })
    env.update(extra)
    return env
