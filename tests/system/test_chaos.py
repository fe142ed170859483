"""Chaos: a system of its own, on a Redis and a PostgreSQL of its own, under steady load from a
tenant with a quota, while the tests kill Redis and restart it empty (it keeps nothing on disk,
as on these machines), pause Redis, stop PostgreSQL, pause an engine, and kill -9 the gateway,
the worker and beat. Each compares what the clients got with what was metered: every request
metered once, no answer a 500, every answer within a bound, and the quota counters equal to
metered usage afterwards."""

from __future__ import annotations

import datetime as dt
import os
import random
import signal
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.system.faults import HANG_BOUND_S, Load, PostgresServer, metered_as_answered
from tests.system.harness import RedisServer, System, free_port, system_env, wait_for

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("chaos")]


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    server, database = RedisServer(), PostgresServer()
    server.start()
    database.create()
    var_dir = tmp_path_factory.mktemp("chaos")
    env = system_env(var_dir=var_dir, extra={
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:{database.port}/chaos",
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
        running.redis, running.database = server, database
        yield running
    finally:
        running.stop()
        server.process.kill()
        database.remove()


def _children(system) -> dict[str, int]:
    """The pids of the system's web, worker and beat processes (runlocal's children)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != system.process.pid:
            continue
        words = [word.decode() for word in argv]
        name = "web" if "controlplane.serving" in words else next((w for w in ("worker", "beat") if w in words), None)
        if name:
            found[name] = int(stat.parent.name)
    return found


def _engine_pid(system, tier: str) -> int:
    with psycopg.connect(**system.database.connection) as conn:
        row = conn.execute("SELECT i.pid FROM fleet_engineinstance i JOIN catalog_modeltier t ON t.id = i.tier_id "
                           "WHERE t.name = %s AND i.actual_state = 'running' AND i.pid IS NOT NULL", (tier,)).fetchone()
    return row[0]


def _engine_processes(system) -> dict[int, int]:
    """The engine processes of the system's node (pid -> port), whoever knows of them or not."""
    base = int(system.env["ENGINE_PORT_BASE"])
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "workers.engines.simulator" in words and "--port" in words:
            port = int(words[words.index("--port") + 1])
            if base <= port < base + 100:
                found[int(cmdline.parent.name)] = port
    return found


def test_the_node_agent_deployed_under_load_adopts_its_engines_and_restarts_none(chaos):
    """A deploy stops the node agent with SIGTERM (a warm shutdown: its running tasks finish)
    and starts it again: the engines keep serving through it, none is restarted, none is left
    without its instance."""
    before = _engine_processes(chaos)
    served = {_engine_pid(chaos, "text")}
    assert served <= set(before)
    with Load(chaos) as load:
        time.sleep(3)
        worker = _children(chaos)["worker"]
        os.kill(worker, signal.SIGTERM)
        wait_for(lambda: _children(chaos).get("worker") not in (None, worker), timeout=60, interval=0.5,
                 what="the node agent started again")
        restarted = dt.datetime.now(dt.UTC)

        def supervised() -> bool:  # the new agent has been through its engines
            with psycopg.connect(**chaos.database.connection) as conn:
                seen = conn.execute("SELECT last_seen_at FROM fleet_node WHERE name = %s",
                                    (chaos.env["NODE_NAME"],)).fetchone()[0]
            return seen is not None and seen > restarted

        wait_for(supervised, timeout=60, interval=0.5, what="the new node agent's supervision")
        time.sleep(3)
    assert _engine_processes(chaos) == before  # the same processes: none restarted, none added
    assert _engine_pid(chaos, "text") in served
    with psycopg.connect(**chaos.database.connection) as conn:
        known = {row[0] for row in conn.execute(
            "SELECT pid FROM fleet_engineinstance WHERE actual_state = 'running' AND pid IS NOT NULL")}
    assert set(before) <= known  # none orphaned
    assert all(answer.status == 200 and not answer.error for answer in load.answers)
    metered_as_answered(chaos, load.answers)


def test_redis_killed_and_restarted_empty_loses_no_usage_and_no_quota(chaos):
    with Load(chaos) as load:
        time.sleep(3)
        chaos.redis.kill()
        time.sleep(3)
        chaos.redis.start()  # empty: no persistence
        time.sleep(6)
    metered_as_answered(chaos, load.answers)


def test_redis_paused_answers_within_bounds_and_loses_no_usage_and_no_quota(chaos):
    with Load(chaos) as load:
        time.sleep(3)
        chaos.redis.pause()
        time.sleep(4)
        chaos.redis.resume()
        time.sleep(5)
    metered_as_answered(chaos, load.answers)


def test_postgres_stopped_keeps_answering_from_what_it_knows_and_loses_no_usage(chaos):
    with Load(chaos) as load:
        time.sleep(3)
        chaos.database.stop()
        stopped = len(load.answers)
        time.sleep(6)
        served_while_stopped = [a for a in load.answers[stopped:] if a.status == 200 and not a.error]
        chaos.database.start()
        time.sleep(5)
    # Keys, tiers and engines it had cached: tenants are still served while the database is away.
    assert served_while_stopped
    metered_as_answered(chaos, load.answers)


def test_an_engine_paused_is_answered_within_the_hang_bound_and_billed_for_what_it_gave(chaos):
    pid = _engine_pid(chaos, "text")
    with Load(chaos) as load:
        time.sleep(3)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(HANG_BOUND_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        chaos.wait_for_engines(tiers=("text",), timeout=120)  # restarted or back in rotation
        time.sleep(3)
    metered_as_answered(chaos, load.answers)


def test_the_gateway_killed_under_load_loses_no_usage_and_bills_cut_streams_as_received(chaos):
    def streaming_for_a_while():  # a stream cut after it has received for over a second
        answer = load.current.get(0)
        return answer and answer.content_at and time.monotonic() - answer.content_at[0] > 2

    with Load(chaos) as load:
        wait_for(streaming_for_a_while, timeout=60, what="a stream under way")
        os.kill(_children(chaos)["web"], signal.SIGKILL)
        cut = time.monotonic()
        wait_for(lambda: "web" in _children(chaos) and httpx.get(f"{chaos.base_url}/login/", timeout=2).is_success,
                 timeout=60, what="runlocal to restart the gateway")
        time.sleep(4)
    cut_streams = [answer for answer in load.answers if answer.error and answer.request_id and answer.stream]
    # The stream that had received for a while was cut; another may have been cut after its
    # headers and before its first chunk (billed at nothing: it received nothing), and a plain
    # answer between its status line and its body (billed as answered).
    assert any(answer.content_at for answer in cut_streams)
    metered_as_answered(chaos, load.answers, cut=cut)


def test_the_worker_and_beat_killed_under_load_lose_no_usage(chaos):
    with Load(chaos) as load:
        time.sleep(3)
        children = _children(chaos)
        os.kill(children["worker"], signal.SIGKILL)
        os.kill(children["beat"], signal.SIGKILL)
        time.sleep(6)
    metered_as_answered(chaos, load.answers)


def test_restored_from_a_dump_with_redis_lost_it_resumes_and_bills_nothing_twice(chaos):
    """The database restored from a pg_dump and Redis lost: the quota counters are rebuilt from
    what the database meters, nothing in flight is waiting on a journal that is gone, and the
    system resumes. What was metered before the dump is there once; what came after it is lost
    with the restore (a backup's recovery point), never billed twice. Runs last: it restarts
    the system."""
    with Load(chaos) as before:
        time.sleep(3)
    metered_as_answered(chaos, before.answers)
    dump = chaos.database.dir / "chaos.dump"  # where the server's user writes
    chaos.database._run(str(chaos.database.bin / "pg_dump"), "-h", "127.0.0.1", "-p", str(chaos.database.port),
                        "-U", "postgres", "-Fc", "-f", str(dump), "chaos")
    with Load(chaos) as after:  # answered after the dump: lost when it is restored
        time.sleep(2)
    chaos.stop()
    chaos.redis.kill()
    chaos.redis.start()
    with psycopg.connect(**{**chaos.database.connection, "dbname": "postgres"}, autocommit=True) as conn:
        conn.execute('DROP DATABASE "chaos" WITH (FORCE)')
        conn.execute('CREATE DATABASE "chaos"')
    chaos.database._run(str(chaos.database.bin / "pg_restore"), "-h", "127.0.0.1", "-p", str(chaos.database.port),
                        "-U", "postgres", "-d", "chaos", str(dump))
    chaos.start()
    chaos.wait_for_engines(tiers=("text",), timeout=120)
    with Load(chaos) as resumed:
        time.sleep(3)
    metered_as_answered(chaos, resumed.answers)  # the quota counters equal what is metered, too
    with psycopg.connect(**chaos.database.connection) as conn:
        ids = [row[0] for row in conn.execute("SELECT request_id FROM metering_usageevent")]
    assert len(ids) == len(set(ids))
    kept = {answer.request_id for answer in before.answers}
    lost = {answer.request_id for answer in after.answers if answer.request_id}
    assert kept <= set(ids) and not lost & set(ids)
