"""Chaos: a system of its own, on a Redis of its own that the tests kill, restart empty (it
keeps nothing on disk, as on these machines) and pause, under steady load from a tenant with a
quota. Each compares what the clients got with what was metered: every request metered once,
no answer a 500, and the quota counters equal to metered usage afterwards."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import subprocess
import threading
import time
import uuid

import httpx
import psycopg
import pytest
import redis

from tests.system.harness import System, free_port, system_env, wait_for

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("chaos")]
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "test"}


class RedisServer:
    """A redis-server process of the test's own, with no persistence."""

    def __init__(self):
        self.port, self.process = free_port(), None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: redis.Redis.from_url(self.url).ping(), timeout=10, what="the test's Redis")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    server = RedisServer()
    server.start()
    name = f"chaos_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(**PG, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    var_dir = tmp_path_factory.mktemp("chaos")
    env = system_env(var_dir=var_dir, extra={
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{name}",
        "REDIS_URL": server.url,
        "NODE_NAME": f"chaos-{os.getpid()}",
        "ENGINE_PORT_BASE": str(random.randrange(30000, 40000, 100)),
        "GATEWAY_HEARTBEAT_S": "1",
        "GATEWAY_JOURNAL_STALE_S": "3",
        "REDIS_TIMEOUT_S": "1",
    })
    running = System(env=env, var_dir=var_dir, port=free_port())
    try:
        running.start()
        running.wait_for_engines(tiers=("text",))
        running.manage("shell", "-c", "from controlplane.tenants.models import Tenant, Quota; "
                       "t, _ = Tenant.objects.get_or_create(name='chaos'); "
                       "Quota.objects.update_or_create(tenant=t, defaults={'period': 'day', 'total_tokens': 10**9})")
        running.secret = running.manage("create_api_key", "--tenant", "chaos").stdout.strip()
        running.redis, running.database = server, name
        yield running
    finally:
        running.stop()
        server.process.kill()
        with psycopg.connect(**PG, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Load:
    """Clients sending text requests, short and streamed, until stopped; what each got."""

    def __init__(self, system, clients: int = 4):
        self.system, self.answers, self.stopping = system, [], threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(n,)) for n in range(clients)]

    def _client(self, n: int) -> None:
        with httpx.Client(base_url=self.system.base_url, timeout=60,
                          headers={"Authorization": f"Bearer {self.system.secret}"}) as client:
            while not self.stopping.is_set():
                stream = n == 0  # one client streams long answers, which span each outage
                body = {"model": "text", "max_tokens": 300 if stream else 4, "ignore_eos": stream,
                        "stream": stream, "messages": [{"role": "user", "content": f"hello {n}"}]}
                try:
                    with client.stream("POST", "/v1/chat/completions", json=body) as response:
                        text = response.read().decode()
                    self.answers.append((response.status_code, response.headers.get("x-request-id"), stream, text))
                except httpx.HTTPError as exc:
                    self.answers.append((type(exc).__name__, None, stream, ""))

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc):
        self.stopping.set()
        for thread in self.threads:
            thread.join(120)


def _metered_as_answered(system, answers) -> None:
    """Every answer with a request id is metered once, as the client got it; the quota
    counters equal what is metered."""
    statuses = [status for status, *_ in answers]
    assert 500 not in statuses and all(isinstance(s, int) for s in statuses), \
        {s: statuses.count(s) for s in set(statuses)}
    ids = [request_id for _, request_id, _, _ in answers if request_id]
    assert len(ids) == len(set(ids)) == len(answers)

    def metered():
        with psycopg.connect(**{**PG, "dbname": system.database}) as conn:
            rows = conn.execute("SELECT request_id, status, http_status, output_tokens, image_tokens + text_tokens "
                                "+ output_tokens FROM metering_usageevent WHERE request_id = ANY(%s)",
                                (ids,)).fetchall()
        return {row[0]: row[1:] for row in rows} if len(rows) == len(ids) else None

    events = wait_for(metered, timeout=60, interval=1, what="every answered request metered")
    for status, request_id, stream, text in answers:
        recorded_status, http_status, output, _ = events[request_id]
        if status == 200 and not stream:
            assert (recorded_status, output) == ("ok", json.loads(text)["usage"]["completion_tokens"])
        elif status != 200:
            assert (recorded_status, http_status) == ("error", status)
    client = redis.Redis.from_url(system.redis.url)

    def settled():
        return client.hlen("vlmcp:inflight") == 0 and client.xlen("vlmcp:usage") == 0

    wait_for(settled, timeout=30, interval=0.5, what="nothing left in flight or in the usage stream")
    with psycopg.connect(**{**PG, "dbname": system.database}) as conn:
        tenant = conn.execute("SELECT id FROM tenants_tenant WHERE name = 'chaos'").fetchone()[0]
        used = conn.execute(
            "SELECT coalesce(sum(image_tokens + text_tokens + output_tokens), 0) FROM metering_usageevent "
            "WHERE tenant_id = %s AND created_at >= %s AND (status = 'ok' OR (status IN ('aborted', 'interrupted') "
            "AND instance_id IS NOT NULL))",
            (tenant, dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0))).fetchone()[0]
    counter = client.get(f"vlmcp:quota:{tenant}:{dt.datetime.now(dt.UTC):%Y%m%d}:total_tokens")
    assert counter is not None and int(counter) == used


def test_redis_killed_and_restarted_empty_loses_no_usage_and_no_quota(chaos):
    with Load(chaos) as load:
        time.sleep(3)
        chaos.redis.kill()
        time.sleep(3)
        chaos.redis.start()  # empty: no persistence
        time.sleep(6)
    assert any(status == 200 for status, *_ in load.answers)
    _metered_as_answered(chaos, load.answers)


def test_redis_paused_answers_within_bounds_and_loses_no_usage_and_no_quota(chaos):
    with Load(chaos) as load:
        time.sleep(3)
        chaos.redis.pause()
        time.sleep(4)
        chaos.redis.resume()
        time.sleep(5)
    assert any(status == 200 for status, *_ in load.answers)
    _metered_as_answered(chaos, load.answers)
