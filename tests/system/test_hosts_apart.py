"""Hosts apart: a control-plane host (web, worker, beat, PostgreSQL and Redis), two engine hosts
each with its node agent and an engine of the text tier, and a second gateway host, each in a
network namespace of its own with its own address. Under steady load the tests cut an engine host
from Redis, cut the second gateway from PostgreSQL, and put a slow, lossy link between that
gateway and an engine host; each compares what the clients got with what was metered."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest
from celery import Celery

from tests.system import hosts as network
from tests.system.faults import Load, PostgresServer, metered_as_answered
from tests.system.harness import RedisServer, free_port, system_env, wait_for

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("hosts")]
TIER = "text"
CUT_S = 60
HEALTH_FRESH_S = 30  # an engine's health older than this takes it out of routing


@dataclass
class Site:
    """The running system, as the checks of tests/system/faults.py read it."""

    net: network.Network
    env: dict
    var_dir: Path
    database: PostgresServer
    redis: RedisServer
    port: int
    secret: str = ""
    tenant: str = "hosts"
    log_path: Path = None
    agents: dict = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{self.net.control}:{self.port}"

    @property
    def second_gateway(self) -> str:
        return f"http://{self.net.hosts['gw2']}:{self.port}"

    def manage(self, *args: str) -> str:
        return subprocess.run([sys.executable, "manage.py", *args], cwd=network.ROOT, env=self.env, check=True,
                              capture_output=True, text=True, timeout=300).stdout

    def log(self, name: str):
        return open(self.var_dir / f"{name}.log", "wb")

    def engines(self) -> dict[str, tuple[int, str, int]]:
        """Per host, its engine of the tier: (instance id, address, port)."""
        with psycopg.connect(**self.database.connection) as conn:
            rows = conn.execute(
                "SELECT n.name, i.id, n.address, i.port FROM fleet_engineinstance i JOIN fleet_node n "
                "ON n.id = i.node_id JOIN catalog_modeltier t ON t.id = i.tier_id WHERE t.name = %s "
                "AND i.actual_state = 'running' AND i.healthy", (TIER,)).fetchall()
        return {name: (pk, address, port) for name, pk, address, port in rows}

    def routable(self, host: str) -> bool:
        """Its engine is one the gateways route to: running, healthy, its health fresh."""
        with psycopg.connect(**self.database.connection) as conn:
            return conn.execute(
                "SELECT count(*) FROM fleet_engineinstance i JOIN fleet_node n ON n.id = i.node_id "
                "WHERE n.name = %s AND i.actual_state = 'running' AND i.healthy AND i.desired_state = 'running' "
                "AND i.last_health_at > now() - make_interval(secs => %s)", (host, HEALTH_FRESH_S)).fetchone()[0] == 1

    def served(self, host: str) -> float:
        """Requests the host's engine has finished, from its own metrics."""
        _, address, port = self.engines()[host]
        text = httpx.get(f"http://{address}:{port}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if reason := network.available():
        pytest.skip(reason)
    tag = f"h{os.getpid() % 100_000}"
    net = network.Network(tag=tag, subnet=f"10.213.{random.randrange(1, 250)}")
    var_dir = tmp_path_factory.mktemp("hosts")
    running = None
    try:
        net.up(["eng1", "eng2", "gw2"])
        redis_server = RedisServer(host=net.control)
        redis_server.start()
        database = PostgresServer(listen=f"127.0.0.1,{net.control}")
        database.create()
        env = system_env(var_dir=var_dir, extra={
            "DATABASE_URL": f"postgres://postgres@{net.control}:{database.port}/chaos",
            "REDIS_URL": redis_server.url,
            "ALLOWED_HOSTS": f"127.0.0.1,localhost,{net.control},{net.hosts['gw2']}",
            "NODE_NAME": "control",
            "GATEWAY_HEARTBEAT_S": "1",
            "GATEWAY_JOURNAL_STALE_S": "3",
            "REDIS_TIMEOUT_S": "1",
            "SHUTDOWN_DELAY_S": "0",
            "SHUTDOWN_GRACE_S": "5",
        })
        running = Site(net=net, env=env, var_dir=var_dir, database=database, redis=redis_server, port=free_port())
        running.manage("migrate", "--noinput")
        running.manage("seed_demo")
        running.manage("shell", "-c", _SETUP)
        running.secret = running.manage("create_api_key", "--tenant", running.tenant).strip()
        _start(running)
        yield running
    finally:
        net.down()
        if running is not None:
            running.redis.process.kill()
            running.database.remove()


# One tier, the text one, at no replicas until both engine hosts are up (so that its two
# engines land one on each); a tenant with room for the whole run.
_SETUP = """
from controlplane.catalog.models import ModelTier
from controlplane.tenants.models import Quota, Tenant
ModelTier.objects.exclude(name="text").update(enabled=False)
ModelTier.objects.filter(name="text").update(replicas=0)
tenant, _ = Tenant.objects.get_or_create(name="hosts")
Quota.objects.update_or_create(tenant=tenant, defaults={"period": "day", "total_tokens": 10**9})
"""


def _start(site: Site) -> None:
    python, net = sys.executable, site.net
    celery = [python, "-m", "celery", "-A", "controlplane"]
    worker = [*celery, "worker", "--pool", "threads", "--concurrency", "4", "--loglevel", "WARNING",
              "--without-gossip", "--without-mingle"]
    serving = [python, "-m", "controlplane.serving", "--port", str(site.port), "--log-level", "warning"]
    site.log_path = site.var_dir / "web.log"
    net.start(None, [*serving, "--host", net.control], env=site.env, log=site.log("web"))
    net.start(None, [*worker, "-Q", "default", "-n", "control@hosts"], env=site.env, log=site.log("worker"))
    net.start(None, [*celery, "beat", "--loglevel", "WARNING", "--pidfile", ""], env=site.env, log=site.log("beat"))
    for host in ("eng1", "eng2"):
        env = {**site.env, "NODE_NAME": host, "NODE_ADDRESS": net.hosts[host], "ENGINE_PORT_BASE": "8100",
               "VAR_DIR": str(site.var_dir / host)}
        site.agents[host] = net.start(host, [*worker, "-Q", f"node.{host}", "-n", f"agent@{host}"], env=env,
                                      log=site.log(host))
    net.start("gw2", [*serving, "--host", net.hosts["gw2"]], env=site.env, log=site.log("gw2"))

    def nodes_live():
        with psycopg.connect(**site.database.connection) as conn:
            return conn.execute("SELECT count(*) FROM fleet_node WHERE name IN ('eng1', 'eng2') "
                                "AND last_seen_at > now() - interval '20 seconds'").fetchone()[0] == 2

    wait_for(nodes_live, timeout=90, interval=0.5, what="both engine hosts' agents")
    with psycopg.connect(**site.database.connection, autocommit=True) as conn:
        conn.execute("UPDATE catalog_modeltier SET replicas = 2 WHERE name = %s", (TIER,))
    wait_for(lambda: set(site.engines()) == {"eng1", "eng2"}, timeout=120, interval=0.5,
             what="an engine serving on each engine host")
    for url in (site.base_url, site.second_gateway):
        wait_for(lambda url=url: _answers(url, site.secret), timeout=60, interval=0.5, what=f"{url} answering")


def _answers(base_url: str, secret: str) -> bool:
    response = httpx.post(f"{base_url}/v1/chat/completions", timeout=10, headers={"Authorization": f"Bearer {secret}"},
                          json={"model": TIER, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]})
    return response.status_code == 200


def _reaches(site: Site, host: str, port: int) -> bool:
    """Whether `host` can open a connection to the control-plane host's `port` within 2 s."""
    script = (f"import socket; socket.create_connection(({site.net.control!r}, {port}), timeout=2)")
    return subprocess.run(["ip", "netns", "exec", site.net.namespace(host), sys.executable, "-c", script],
                          capture_output=True, timeout=30).returncode == 0


def _agent_answers(site: Site, host: str) -> bool:
    """The host's agent takes work from the broker again: it answers a ping sent through it."""
    app = Celery(broker=site.redis.url, set_as_current=False)
    try:
        return bool(app.control.ping(destination=[f"agent@{host}"], timeout=2))
    finally:
        app.close()


def test_an_engine_host_cut_from_redis_keeps_serving_stays_routable_and_resumes(site):
    """Its agent gets no supervision passes and no work through the broker for a minute. Its
    engine keeps serving and stays in routing (the agent supervises on its own clock); once the
    link is back, the agent takes work from the broker again by itself."""
    assert _agent_answers(site, "eng1")
    with Load(site) as load:
        time.sleep(2)
        with site.net.cut("eng1", site.redis.port):
            assert not _reaches(site, "eng1", site.redis.port)
            assert _reaches(site, "eng1", site.database.port)  # cut from Redis alone
            before = site.served("eng1")
            ends = time.monotonic() + CUT_S
            while time.monotonic() < ends:
                assert site.routable("eng1") and site.routable("eng2")
                time.sleep(2)
            assert site.served("eng1") > before  # and it was sent work meanwhile
            assert not _agent_answers(site, "eng1")
        wait_for(lambda: _agent_answers(site, "eng1"), timeout=90, interval=1, what="eng1's agent back on the broker")
        time.sleep(2)
    assert {engine[0] for engine in site.engines().values()} == set(_instances_of_tier(site))
    metered_as_answered(site, load.answers)


def _instances_of_tier(site: Site) -> list[int]:
    """The tier's instances ever made: none was placed again elsewhere."""
    with psycopg.connect(**site.database.connection) as conn:
        return [row[0] for row in conn.execute(
            "SELECT i.id FROM fleet_engineinstance i JOIN catalog_modeltier t ON t.id = i.tier_id WHERE t.name = %s",
            (TIER,))]


def test_a_gateway_host_cut_from_postgres_serves_from_what_it_knows(site):
    """Its keys, tiers and engines are cached: it goes on answering, past their time in the
    cache, while the database cannot be reached (no refusal: packets vanish)."""
    with Load(site, base_url=site.second_gateway) as load:
        time.sleep(3)
        with site.net.cut("gw2", site.database.port):
            assert not _reaches(site, "gw2", site.database.port)
            started = len(load.answers)
            time.sleep(12)  # several times GATEWAY_KEY_CACHE_SECONDS
            during = [answer for answer in load.answers[started:] if answer.status == 200 and not answer.error]
        time.sleep(4)
    assert len(during) > 10
    metered_as_answered(site, load.answers)


def test_a_slow_lossy_link_between_a_gateway_and_an_engine_host_slows_but_fails_nothing(site):
    """200 ms each way and 5 % of packets lost between the second gateway and one engine host:
    every request still completes, no client waits more than 15 s for its next byte, and every
    record equals what was metered."""
    with site.net.slow("gw2", "eng1", delay_ms=200, loss=0.05):
        before = site.served("eng1")
        with Load(site, base_url=site.second_gateway) as load:
            time.sleep(15)
        assert site.served("eng1") > before  # the slow engine host was still sent work
    assert all(answer.status == 200 and not answer.error for answer in load.answers)
    metered_as_answered(site, load.answers, bound_s=15)

