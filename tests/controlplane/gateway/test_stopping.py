"""A rolling deploy, on the server as production runs it (controlplane.serving, a process of its
own): told to stop (SIGTERM), it turns unready at once, serves what still comes for its delay,
lets its requests finish, ends a stream longer than its grace with a clean error event billed
for what was relayed, and exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from django.db import connection
from django.utils import timezone

from controlplane.fleet.models import EngineInstance, Node
from controlplane.metering.models import UsageEvent
from tests.engines import simulator
from tests.system.harness import ROOT, free_port, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

DELAY_S, GRACE_S = 2, 4


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


@pytest.fixture
def served(world, settings, tmp_path):
    """The control plane served on a port of its own, its text tier on a simulator generating a
    token every 20 ms (a thousand take 20 s: past the grace)."""
    if connection.vendor != "postgresql":
        pytest.skip("a second process shares the test database through PostgreSQL")
    with simulator(family="qwen2", name="text", images=None, extra=("--sim-decode-ms-per-token", "20")) as engine:
        node = Node.objects.create(name="local", address="127.0.0.1", queue="node.local", last_seen_at=timezone.now())
        EngineInstance.objects.create(tier=world.text, node=node, port=engine, actual_state="running", healthy=True,
                                      last_health_at=timezone.now())
        port = free_port()
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", "DEBUG": "false",
               "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{connection.settings_dict['NAME']}",
               "REDIS_URL": settings.REDIS_URL, "USAGE_OUTBOX": "database", "SECRET_KEY": settings.SECRET_KEY,
               "ALLOWED_HOSTS": "127.0.0.1", "VAR_DIR": str(tmp_path), "SHUTDOWN_DELAY_S": str(DELAY_S),
               "SHUTDOWN_GRACE_S": str(GRACE_S)}
        process = subprocess.Popen([sys.executable, "-m", "controlplane.serving", "--port", str(port),
                                    "--log-level", "warning"], cwd=ROOT, env=env)
        try:
            wait_for(lambda: _status(f"http://127.0.0.1:{port}/readyz") == 200, timeout=30,
                     what="the server to be ready")
            yield process, f"http://127.0.0.1:{port}"
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def _chat(max_tokens: int, **extra) -> dict:
    return {"model": "text", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "count"}], **extra}


def test_a_process_told_to_stop_turns_unready_serves_on_and_ends_a_long_stream_cleanly(served, world):
    process, base = served
    auth = {"authorization": f"Bearer {world.alice_key}"}
    with httpx.Client(base_url=base, headers=auth, timeout=30) as client, \
            client.stream("POST", "/v1/chat/completions", json=_chat(1000, stream=True, ignore_eos=True)) as stream:
        lines = (line[6:] for line in stream.iter_lines() if line.startswith("data: "))
        received = [json.loads(next(lines))]
        told = time.monotonic()
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: _status(f"{base}/readyz") == 503, timeout=1, interval=0.05, what="it to turn unready")
        # Still serving meanwhile: a load balancer takes the delay to notice.
        late = client.post("/v1/chat/completions", json=_chat(4))
        assert late.status_code == 200 and time.monotonic() - told < DELAY_S
        received += [json.loads(data) for data in lines if data != "[DONE]"]
        request_id = stream.headers["x-request-id"]
    ended = time.monotonic() - told
    assert DELAY_S + GRACE_S - 1.5 < ended < DELAY_S + GRACE_S  # ended a second before the grace, not cut
    *chunks, last = received
    assert last["error"]["code"] == "server_restarting" and "retry" in last["error"]["message"]
    relayed = sum(1 for chunk in chunks for choice in chunk.get("choices") or () if choice["delta"].get("content"))
    assert process.wait(timeout=10) is not None and time.monotonic() - told < DELAY_S + GRACE_S + 5
    assert _status(f"{base}/readyz") is None  # gone
    event = UsageEvent.objects.get(request_id=request_id)
    assert (event.status, event.http_status, event.error_code) == ("aborted", 503, "server_restarting")
    assert event.output_tokens == relayed > 100 and event.cost > 0  # billed for what was relayed
    assert UsageEvent.objects.get(request_id=late.headers["x-request-id"]).status == "ok"


def test_readiness_is_answered_by_the_asgi_front(serve):
    from controlplane.asgi import Application

    port = serve(Application())
    assert httpx.get(f"http://127.0.0.1:{port}/readyz").text == "ready\n"
