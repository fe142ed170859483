"""Chaos: a system of its own, on a Redis and a PostgreSQL of its own, under steady load from a
tenant with a quota, while the tests kill Redis and restart it empty (it keeps nothing on disk,
as on these machines), pause Redis, stop PostgreSQL, pause an engine, and kill -9 the gateway,
the worker and beat. Each compares what the clients got with what was metered: every request
metered once, no answer a 500, every answer within a bound, and the quota counters equal to
metered usage afterwards."""

from __future__ import annotations

import datetime as dt
import glob
import json
import os
import pwd
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest
import redis

from tests.system.harness import RedisServer, System, free_port, system_env, wait_for

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("chaos")]
# In flight on an engine that stops making progress: failed over or answered within this bound
# (the hang detection of workers/supervision/liveness.py), and no request waits longer.
HANG_BOUND_S = 30
PLAIN_MAX_TOKENS = 4  # the plain (not streamed) requests' max_tokens


class PostgresServer:
    """A PostgreSQL cluster of the test's own, so that stopping it touches no other test. Made
    with the server's own initdb and pg_ctl, run as the postgres user when the tests run as root
    (the server refuses to run as root); in a folder of /tmp that user can reach."""

    def __init__(self):
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")) or [shutil.which("pg_ctl")]
        if not found[-1]:
            pytest.fail("the chaos suite needs PostgreSQL's server programs (initdb, pg_ctl)")
        self.bin = Path(found[-1]).parent
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="chaos-pg-"))
        self.data = self.dir / "data"
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            os.chown(self.dir, pwd.getpwnam("postgres").pw_uid, -1)

    @property
    def connection(self) -> dict:
        return {"host": "127.0.0.1", "port": self.port, "user": "postgres", "dbname": "chaos"}

    def _run(self, *argv: str) -> None:
        subprocess.run([*self.as_user, *argv], check=True, capture_output=True, timeout=120)

    def create(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--no-sync")
        self.start()
        with psycopg.connect(**{**self.connection, "dbname": "postgres"}, autocommit=True) as conn:
            conn.execute('CREATE DATABASE "chaos"')

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-o", options,
                  "-w", "start")

    def stop(self) -> None:
        """As an operator's `systemctl stop postgresql` does: sessions ended, connections refused."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


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


@dataclass
class Answer:
    """What one client got: the status (None if the connection failed before one), the request
    id, and for a stream when each piece of content arrived; `error` if the connection broke."""

    stream: bool
    started: float
    ended: float = 0.0
    status: int | None = None
    request_id: str | None = None
    body: str = ""
    content_at: list[float] = field(default_factory=list)
    error: str = ""
    longest_wait: float = 0.0  # the longest the client waited for anything (a byte, or the end)
    last_heard: float = 0.0

    def heard(self) -> None:
        now = time.monotonic()
        self.longest_wait = max(self.longest_wait, now - (self.last_heard or self.started))
        self.last_heard = now


class Load:
    """Clients sending text requests, short and streamed, until stopped; what each got."""

    def __init__(self, system, clients: int = 4):
        self.system, self.answers, self.stopping = system, [], threading.Event()
        self.current: dict[int, Answer] = {}  # what each client is receiving now
        self.threads = [threading.Thread(target=self._client, args=(n,)) for n in range(clients)]

    def _client(self, n: int) -> None:
        with httpx.Client(base_url=self.system.base_url, timeout=120,
                          headers={"Authorization": f"Bearer {self.system.secret}"}) as client:
            while not self.stopping.is_set():
                stream = n == 0  # one client streams long answers, which span each outage
                body = {"model": "text", "max_tokens": 1000 if stream else PLAIN_MAX_TOKENS, "ignore_eos": stream,
                        "stream": stream, "messages": [{"role": "user", "content": f"hello {n}"}]}
                answer = self.current[n] = Answer(stream=stream, started=time.monotonic())
                try:
                    with client.stream("POST", "/v1/chat/completions", json=body) as response:
                        answer.status, answer.request_id = response.status_code, response.headers.get("x-request-id")
                        answer.heard()
                        for line in response.iter_lines():
                            answer.heard()
                            answer.body += line + "\n"
                            if stream and line.startswith("data: {") and _content(line):
                                answer.content_at.append(time.monotonic())
                except httpx.HTTPError as exc:
                    answer.error = type(exc).__name__
                answer.heard()
                answer.ended = time.monotonic()
                self.answers.append(answer)
                if answer.status in (None, 429, 503):
                    time.sleep(0.2)  # refused, or nothing listening (a gateway restarting): as clients back off

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc):
        self.stopping.set()
        for thread in self.threads:
            thread.join(180)


def _content(line: str) -> bool:
    return any((choice.get("delta") or {}).get("content") for choice in json.loads(line[6:]).get("choices") or ())


def _metered_as_answered(system, answers, *, bound_s: float = HANG_BOUND_S, cut: float | None = None) -> None:
    """Every answer the gateway began is metered once, as the client got it, and came within
    `bound_s` (no client waits longer for its answer's next byte); a stream the gateway's death cut (at `cut`) is billed at most what its client
    received and at least what it had received one progress interval before; the quota
    counters equal what is metered."""
    assert any(answer.status == 200 and not answer.error for answer in answers)
    statuses = [answer.status for answer in answers]
    assert 500 not in statuses, {s: statuses.count(s) for s in set(statuses)}
    slowest = max(answer.longest_wait for answer in answers)
    assert slowest < bound_s, f"a client waited {slowest:.1f}s"
    begun = [answer for answer in answers if answer.status is not None]
    unanswered = [answer for answer in answers if answer.status is None]
    assert cut is not None or not unanswered, [answer.error for answer in unanswered]
    if cut is None:
        assert not [answer.error for answer in begun if answer.error]
    ids = [answer.request_id for answer in begun]
    assert None not in ids and len(ids) == len(set(ids))

    def metered():
        with psycopg.connect(**system.database.connection) as conn:
            rows = conn.execute("SELECT request_id, status, http_status, output_tokens FROM metering_usageevent "
                                "WHERE request_id = ANY(%s)", (ids,)).fetchall()
        return {row[0]: row[1:] for row in rows} if len(rows) == len(ids) else None

    events = wait_for(metered, timeout=90, interval=1, what="every answered request metered")
    for answer in begun:
        status, http_status, output = events[answer.request_id]
        if answer.error and not answer.stream:
            # A plain answer cut between its status line and its body (the server writes them
            # apart, and the gateway died between the two): recorded in full, as answered,
            # before a byte of it left (test_hand_over), as any answer lost on its way is.
            assert cut is not None and answer.status == 200 and status == "ok", (answer, status)
            assert output <= PLAIN_MAX_TOKENS, (answer.request_id, output)
        elif answer.error:  # a stream cut by the gateway's death: billed for what the client received
            assert cut is not None and status == "interrupted", (answer, status)
            received = len(answer.content_at)
            progress_s = int(system.env.get("GATEWAY_PROGRESS_MS", "500")) / 1000
            before = sum(1 for at in answer.content_at if at < cut - 2 * progress_s)
            assert before <= output <= received, (answer.request_id, before, output, received)
        elif answer.status == 200 and not answer.stream:
            assert (status, output) == ("ok", json.loads(answer.body)["usage"]["completion_tokens"])
        elif answer.status == 200 and "engine_error" not in answer.body:
            assert (status, output) == ("ok", len(answer.content_at))
        elif answer.status == 200:  # the engine failed mid-stream: billed for what was relayed
            assert (status, http_status, output) == ("error", 502, len(answer.content_at))
        else:
            assert (status, http_status) == ("error", answer.status)
    client = redis.Redis.from_url(system.redis.url)

    def settled():
        return client.hlen("vlmcp:inflight") == 0 and client.xlen("vlmcp:usage") == 0

    try:
        wait_for(settled, timeout=60, interval=0.5, what="nothing left in flight or in the usage stream")
    except TimeoutError:
        complaints = [line for line in system.log_path.read_text().splitlines() if "WARNING" in line or "ERROR" in line]
        pytest.fail(f"still in flight: {client.hgetall('vlmcp:inflight')}; {client.xlen('vlmcp:usage')} entries "
                    f"in the usage stream; the system's last complaints: {complaints[-20:]}")
    with psycopg.connect(**system.database.connection) as conn:
        tenant = conn.execute("SELECT id FROM tenants_tenant WHERE name = 'chaos'").fetchone()[0]
        used = conn.execute(
            "SELECT coalesce(sum(image_tokens + text_tokens + output_tokens), 0) FROM metering_usageevent "
            "WHERE tenant_id = %s AND created_at >= %s AND (status = 'ok' OR (status IN ('aborted', 'interrupted') "
            "AND instance_id IS NOT NULL))",
            (tenant, dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0))).fetchone()[0]
    counter = client.get(f"vlmcp:quota:{tenant}:{dt.datetime.now(dt.UTC):%Y%m%d}:total_tokens")
    assert counter is not None and int(counter) == used


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
    _metered_as_answered(chaos, load.answers)


def test_redis_killed_and_restarted_empty_loses_no_usage_and_no_quota(chaos):
    with Load(chaos) as load:
        time.sleep(3)
        chaos.redis.kill()
        time.sleep(3)
        chaos.redis.start()  # empty: no persistence
        time.sleep(6)
    _metered_as_answered(chaos, load.answers)


def test_redis_paused_answers_within_bounds_and_loses_no_usage_and_no_quota(chaos):
    with Load(chaos) as load:
        time.sleep(3)
        chaos.redis.pause()
        time.sleep(4)
        chaos.redis.resume()
        time.sleep(5)
    _metered_as_answered(chaos, load.answers)


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
    _metered_as_answered(chaos, load.answers)


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
    _metered_as_answered(chaos, load.answers)


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
    _metered_as_answered(chaos, load.answers, cut=cut)


def test_the_worker_and_beat_killed_under_load_lose_no_usage(chaos):
    with Load(chaos) as load:
        time.sleep(3)
        children = _children(chaos)
        os.kill(children["worker"], signal.SIGKILL)
        os.kill(children["beat"], signal.SIGKILL)
        time.sleep(6)
    _metered_as_answered(chaos, load.answers)


def test_restored_from_a_dump_with_redis_lost_it_resumes_and_bills_nothing_twice(chaos):
    """The database restored from a pg_dump and Redis lost: the quota counters are rebuilt from
    what the database meters, nothing in flight is waiting on a journal that is gone, and the
    system resumes. What was metered before the dump is there once; what came after it is lost
    with the restore (a backup's recovery point), never billed twice. Runs last: it restarts
    the system."""
    with Load(chaos) as before:
        time.sleep(3)
    _metered_as_answered(chaos, before.answers)
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
    _metered_as_answered(chaos, resumed.answers)  # the quota counters equal what is metered, too
    with psycopg.connect(**chaos.database.connection) as conn:
        ids = [row[0] for row in conn.execute("SELECT request_id FROM metering_usageevent")]
    assert len(ids) == len(set(ids))
    kept = {answer.request_id for answer in before.answers}
    lost = {answer.request_id for answer in after.answers if answer.request_id}
    assert kept <= set(ids) and not lost & set(ids)
