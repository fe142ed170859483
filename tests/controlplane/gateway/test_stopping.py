"""A rolling deploy, on the server as production runs it (controlplane.serving, a process of its
own): told to stop (SIGTERM), it turns unready at once, serves what still comes for its delay,
lets its requests finish, ends a stream longer than its grace with a clean error event billed
for what was relayed, and exits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
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

DELAY_S, GRACE_S = 5, 4


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


def _text_on(world, engine_port: int) -> None:
    """The text tier served by the simulator on `engine_port`."""
    node = Node.objects.create(name="local", address="127.0.0.1", queue="node.local", last_seen_at=timezone.now())
    EngineInstance.objects.create(tier=world.text, node=node, port=engine_port, actual_state="running", healthy=True,
                                  last_health_at=timezone.now())


def _env(settings, tmp_path, *, delay_s: int, grace_s: int) -> dict:
    """A server process's environment: the test database, stopping after `delay_s` with `grace_s`."""
    return {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", "DEBUG": "false",
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{connection.settings_dict['NAME']}",
            "REDIS_URL": settings.REDIS_URL, "USAGE_OUTBOX": "database", "SECRET_KEY": settings.SECRET_KEY,
            "ALLOWED_HOSTS": "127.0.0.1", "VAR_DIR": str(tmp_path), "SHUTDOWN_DELAY_S": str(delay_s),
            "SHUTDOWN_GRACE_S": str(grace_s)}


def _server(env: dict, port: int) -> subprocess.Popen:
    """The server as production runs it, on `port`, once it is ready."""
    process = subprocess.Popen([sys.executable, "-m", "controlplane.serving", "--port", str(port), "--log-level",
                                "warning"], cwd=ROOT, env=env)
    try:
        wait_for(lambda: _status(f"http://127.0.0.1:{port}/readyz") == 200, timeout=30, what="the server to be ready")
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


@pytest.fixture
def served(world, settings, tmp_path):
    """The control plane served on a port of its own, its text tier on a simulator generating a
    token every 20 ms (a thousand take 20 s: past the grace): the server, its URL, the engine's port."""
    if connection.vendor != "postgresql":
        pytest.skip("a second process shares the test database through PostgreSQL")
    with simulator(family="qwen2", name="text", images=None, extra=("--sim-decode-ms-per-token", "20")) as engine:
        _text_on(world, engine)
        port = free_port()
        process = _server(_env(settings, tmp_path, delay_s=DELAY_S, grace_s=GRACE_S), port)
        try:
            yield process, f"http://127.0.0.1:{port}", engine
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def _running(engine_port: int) -> int:
    """How many requests the simulator on `engine_port` is generating for."""
    metrics = httpx.get(f"http://127.0.0.1:{engine_port}/metrics", timeout=1).text
    return int(float(next(line.split()[-1] for line in metrics.splitlines()
                          if line.startswith("vllm:num_requests_running"))))


def _chat(max_tokens: int, **extra) -> dict:
    return {"model": "text", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "count"}], **extra}


def test_a_process_told_to_stop_turns_unready_serves_on_and_ends_a_long_stream_cleanly(served, world):
    process, base, _ = served
    auth = {"authorization": f"Bearer {world.alice_key}"}
    with httpx.Client(base_url=base, headers=auth, timeout=30) as client, \
            client.stream("POST", "/v1/chat/completions", json=_chat(1000, stream=True, ignore_eos=True)) as stream:
        lines = (line[6:] for line in stream.iter_lines() if line.startswith("data: "))
        received = [json.loads(next(lines))]
        told = time.monotonic()
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: _status(f"{base}/readyz") == 503, timeout=3, interval=0.05, what="it to turn unready")
        # Still serving meanwhile: a load balancer takes the delay to notice.
        late = client.post("/v1/chat/completions", json=_chat(4))
        assert late.status_code == 200 and time.monotonic() - told < DELAY_S
        received += [json.loads(data) for data in lines if data != "[DONE]"]
        request_id = stream.headers["x-request-id"]
    ended = time.monotonic() - told
    assert DELAY_S + GRACE_S - 2.5 < ended < DELAY_S + GRACE_S  # ended a second before the grace, not cut
    *chunks, last = received
    assert last["error"]["code"] == "server_restarting" and "retry" in last["error"]["message"]
    relayed = sum(1 for chunk in chunks for choice in chunk.get("choices") or () if choice["delta"].get("content"))
    assert process.wait(timeout=10) is not None and time.monotonic() - told < DELAY_S + GRACE_S + 5
    assert _status(f"{base}/readyz") is None  # gone
    event = UsageEvent.objects.get(request_id=request_id)
    assert (event.status, event.http_status, event.error_code) == ("aborted", 503, "server_restarting")
    assert event.output_tokens == relayed > 100 and event.cost > 0  # billed for what was relayed
    assert UsageEvent.objects.get(request_id=late.headers["x-request-id"]).status == "ok"


def test_a_stream_its_engine_has_gone_silent_on_is_ended_cleanly_too(served, world):
    """An engine can be silent on a stream for long (the request queued, in a long prefill, or the
    engine stalled): with no event to end it on, it is ended all the same before the grace runs
    out, not cut when it does, and billed for what was relayed."""
    process, base, engine = served
    auth = {"authorization": f"Bearer {world.alice_key}"}
    with httpx.Client(base_url=base, headers=auth, timeout=30) as client, \
            client.stream("POST", "/v1/chat/completions", json=_chat(1000, stream=True, ignore_eos=True)) as stream:
        lines = (line[6:] for line in stream.iter_lines() if line.startswith("data: "))
        received = [json.loads(next(lines)) for _ in range(3)]
        assert httpx.post(f"http://127.0.0.1:{engine}/sim/fault", json={"mode": "hang"}).status_code == 200
        told = time.monotonic()
        process.send_signal(signal.SIGTERM)
        received += [json.loads(data) for data in lines if data != "[DONE]"]
        request_id = stream.headers["x-request-id"]
    ended = time.monotonic() - told
    assert DELAY_S + GRACE_S - 2.5 < ended < DELAY_S + GRACE_S  # ended a second before the grace, not cut
    *chunks, last = received
    assert last["error"]["code"] == "server_restarting"
    relayed = sum(1 for chunk in chunks for choice in chunk.get("choices") or () if choice["delta"].get("content"))
    process.wait(timeout=10)
    event = UsageEvent.objects.get(request_id=request_id)
    assert (event.status, event.http_status, event.error_code) == ("aborted", 503, "server_restarting")
    assert event.output_tokens == relayed > 0  # billed for what was relayed


def test_an_answer_still_being_generated_when_the_grace_runs_out_is_metered(served, world):
    """A request not streamed has no event to end it on: the server cuts it when the grace runs
    out and stops straight away, and its usage is recorded all the same before the process exits."""
    process, base, engine = served
    auth = {"authorization": f"Bearer {world.alice_key}"}
    answers = []

    def ask() -> None:  # a thousand tokens: 20 s, past the grace
        try:
            answers.append(httpx.post(f"{base}/v1/chat/completions", json=_chat(1000, ignore_eos=True),
                                      headers=auth, timeout=60).status_code)
        except httpx.HTTPError as exc:
            answers.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    wait_for(lambda: _running(engine), timeout=10, interval=0.05, what="the engine to be generating")
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=DELAY_S + GRACE_S + 10)
    asking.join(timeout=10)
    assert answers and answers[0] != 200  # cut
    event = UsageEvent.objects.get(tenant=world.alice)
    # Told apart from a client that left: the gateway cut it, and says so.
    assert (event.status, event.http_status, event.error_code) == ("aborted", 503, "server_restarting")
    assert event.error_stage == "engine"


def test_readiness_is_answered_by_the_asgi_front(serve):
    from controlplane.asgi import Application

    port = serve(Application())
    assert httpx.get(f"http://127.0.0.1:{port}/readyz").text == "ready\n"


class ReadyBalancer:
    """A load balancer as deployments put in front of replicas: each request goes to the next
    backend whose /readyz answered 200 at its last check (every 0.2 s), and fails (502) when it
    cannot connect to it, retrying nothing (many balancers do not); responses are streamed
    through."""

    def __init__(self, backends: list[str]):
        self.backends, self.ready, self.turn = backends, set(backends), 0
        self.client: httpx.AsyncClient | None = None
        self.done = threading.Event()
        for backend in backends:  # each checked on its own: a slow answer holds up no other
            threading.Thread(target=self._check, args=(backend,), daemon=True).start()

    def _check(self, backend: str) -> None:
        while not self.done.wait(0.2):
            if _status(f"{backend}/readyz") == 200:
                self.ready = self.ready | {backend}
            else:
                self.ready = self.ready - {backend}

    def _next(self) -> str | None:
        ready = [b for b in self.backends if b in self.ready]
        self.turn += 1
        return ready[self.turn % len(ready)] if ready else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.client = self.client or httpx.AsyncClient(timeout=60)
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"host", b"connection")]
        backend = self._next()
        if backend is not None:
            try:
                response = await self.client.send(self.client.build_request(
                    scope["method"], backend + scope["path"], headers=headers, content=body), stream=True)
            except httpx.ConnectError:
                self.ready.discard(backend)
                return await _bad_gateway(send, f"{backend} refused the connection")
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in (b"content-length",
                                                                                                     b"transfer-encoding")]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await response.aclose()
            await send({"type": "http.response.body", "body": b""})
            return
        await _bad_gateway(send, "no backend ready")


async def _bad_gateway(send, why: str) -> None:
    await send({"type": "http.response.start", "status": 502, "headers": []})
    await send({"type": "http.response.body", "body": why.encode()})


def test_rolling_two_replicas_under_16_streaming_clients_fails_no_request(world, settings, tmp_path, serve):
    if connection.vendor != "postgresql":
        pytest.skip("the replicas share the test database through PostgreSQL")
    with simulator(family="qwen2", name="text", images=None) as engine:
        _text_on(world, engine)
        env = _env(settings, tmp_path, delay_s=3, grace_s=10)
        ports = [free_port(), free_port()]
        replicas = [_server(env, port) for port in ports]
        balancer = ReadyBalancer([f"http://127.0.0.1:{port}" for port in ports])
        front = f"http://127.0.0.1:{serve(balancer)}/v1/chat/completions"
        rolled, answers, failures = threading.Event(), {}, []

        def roll() -> None:  # one replica at a time: stopped, started again, ready
            try:
                for n, port in enumerate(ports):
                    time.sleep(1.5)
                    replicas[n].send_signal(signal.SIGTERM)
                    replicas[n].wait(timeout=30)
                    replicas[n] = _server(env, port)
                time.sleep(1.5)
            finally:
                rolled.set()

        async def client(n: int) -> None:
            async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {world.alice_key}"}) as http:
                while not rolled.is_set():
                    body = _chat(16, stream=True, stream_options={"include_usage": True})
                    try:
                        async with http.stream("POST", front, json=body) as response:
                            lines = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
                    except httpx.HTTPError as exc:
                        failures.append(repr(exc))
                        continue
                    if response.status_code != 200 or not lines or lines[-1] != "[DONE]" or \
                            any('"error"' in line for line in lines):
                        failures.append(f"{response.status_code}: {lines[-2:]}")
                        continue
                    answers[response.headers["x-request-id"]] = json.loads(lines[-2])["usage"]["completion_tokens"]

        async def clients() -> None:
            await asyncio.gather(*(client(n) for n in range(16)))

        rolling = threading.Thread(target=roll)
        rolling.start()
        try:
            asyncio.run(clients())
        finally:
            rolling.join()
            balancer.done.set()
            for replica in replicas:
                replica.send_signal(signal.SIGTERM)
            for replica in replicas:
                replica.wait(timeout=30)
    assert failures == [] and len(answers) > 100
    metered = dict(UsageEvent.objects.filter(request_id__in=answers).values_list("request_id", "output_tokens"))
    assert metered == answers  # every answer metered, as its client counted it
    assert not UsageEvent.objects.exclude(status="ok").exists()


def test_a_stop_sent_to_a_process_group_reaches_it_twice_and_still_waits_its_delay(served, world):
    """A SIGTERM to the whole group reaches a worker from the group and again from its parent:
    the same stop, not a second one that skips the delay."""
    process, base, _ = served
    told = time.monotonic()
    process.send_signal(signal.SIGTERM)
    wait_for(lambda: _status(f"{base}/readyz") == 503, timeout=3, interval=0.05, what="it to turn unready")
    process.send_signal(signal.SIGTERM)  # the parent's, just after (two at once would arrive as one)
    time.sleep(0.3)
    late = httpx.post(f"{base}/v1/chat/completions", json=_chat(4), timeout=30,
                      headers={"authorization": f"Bearer {world.alice_key}"})
    assert late.status_code == 200 and time.monotonic() - told < DELAY_S
    process.wait(timeout=DELAY_S + GRACE_S + 10)
    assert time.monotonic() - told >= DELAY_S - 0.5
