"""Faults a whole system is put through, and what its clients got: servers of a test's own,
clients under steady load, and the check that every answer was metered once, as received."""

from __future__ import annotations

import datetime as dt
import glob
import json
import os
import pwd
import shutil
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

from tests.system.harness import free_port, wait_for

# In flight on an engine that stops making progress: failed over or answered within this bound
# (the hang detection of workers/supervision/liveness.py), and no request waits longer.
HANG_BOUND_S = 30
PLAIN_MAX_TOKENS = 4  # the plain (not streamed) requests' max_tokens


class PostgresServer:
    """A PostgreSQL cluster of the test's own, so that stopping it touches no other test. Made
    with the server's own initdb and pg_ctl, run as the postgres user when the tests run as root
    (the server refuses to run as root); in a folder of /tmp that user can reach."""

    def __init__(self, *, listen: str = "127.0.0.1"):
        self.listen = listen
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
        if self.listen != "127.0.0.1":  # other hosts connect too, from their own addresses
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write("host all all 0.0.0.0/0 trust\n")
        self.start()
        with psycopg.connect(**{**self.connection, "dbname": "postgres"}, autocommit=True) as conn:
            conn.execute('CREATE DATABASE "chaos"')

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses={self.listen} -c fsync=off"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-o", options,
                  "-w", "start")

    def stop(self) -> None:
        """As an operator's `systemctl stop postgresql` does: sessions ended, connections refused."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


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

    def __init__(self, system, clients: int = 4, *, base_url: str | None = None):
        self.system, self.answers, self.stopping = system, [], threading.Event()
        self.base_url = base_url or system.base_url
        self.current: dict[int, Answer] = {}  # what each client is receiving now
        self.threads = [threading.Thread(target=self._client, args=(n,)) for n in range(clients)]

    def _client(self, n: int) -> None:
        with httpx.Client(base_url=self.base_url, timeout=120,
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


def metered_as_answered(system, answers, *, bound_s: float = HANG_BOUND_S, cut: float | None = None) -> None:
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
        tenant = conn.execute("SELECT id FROM tenants_tenant WHERE name = %s",
                              (getattr(system, "tenant", "chaos"),)).fetchone()[0]
        used = conn.execute(
            "SELECT coalesce(sum(image_tokens + text_tokens + output_tokens), 0) FROM metering_usageevent "
            "WHERE tenant_id = %s AND created_at >= %s AND (status = 'ok' OR (status IN ('aborted', 'interrupted') "
            "AND instance_id IS NOT NULL))",
            (tenant, dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0))).fetchone()[0]
    counter = client.get(f"vlmcp:quota:{tenant}:{dt.datetime.now(dt.UTC):%Y%m%d}:total_tokens")
    assert counter is not None and int(counter) == used
