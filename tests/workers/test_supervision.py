"""The node agent against real engine processes (the simulator, launched like vLLM; where a
test is marked `speaking`, once as vLLM and once speaking SGLang's endpoints and metrics)."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time

import pytest
from django.utils import timezone

from controlplane.fleet.models import EngineEvent, EngineInstance, Node
from tests.system.harness import ROOT, wait_for
from workers import supervision
from workers.engines import process
from workers.supervision import liveness

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def agent(request, world, settings, tmp_path):
    settings.ENGINE_LOG_DIR = tmp_path / "engines"
    settings.ENGINE_PORT_BASE = 21000 + (os.getpid() % 500) * 8
    settings.ENGINE_HEALTH_TIMEOUT = 0.5
    api = getattr(request, "param", "vllm")
    if api != "vllm":
        world.vision.engine_settings = {**world.vision.engine_settings, "engine_api": api}
        world.vision.save()
    node = supervision.this_node()
    instance = EngineInstance.objects.create(tier=world.vision, node=node)
    yield instance
    instance.refresh_from_db()
    if instance.pid and process.is_alive(instance.pid):
        os.killpg(instance.pid, signal.SIGCONT)
        process.terminate(instance.pid, grace=2)


def _reconcile_until(instance, predicate, what, timeout=20):
    def step():
        supervision.node_reconcile(instance.node.name)
        instance.refresh_from_db()
        return predicate(instance)

    return wait_for(step, timeout=timeout, interval=0.2, what=what)


def _running(i):
    return i.actual_state == "running" and i.healthy


# The same supervision whichever engine's API the engine speaks, where it reads the engine's
# metrics: samples, a drain waiting for running requests, a hang seen in frozen counters.
speaking = pytest.mark.parametrize("agent", ["vllm", "sglang"], indirect=True)


def test_the_agent_launches_an_engine_with_its_log_in_a_file(agent):
    _reconcile_until(agent, _running, "the engine to come up")
    assert process.is_alive(agent.pid)
    assert agent.command[1:3] == ["-m", "workers.engines.simulator"]
    assert "--limit-mm-per-prompt" in agent.command
    assert "=== start" in open(agent.log_path).read()
    states = list(EngineEvent.objects.filter(instance=agent).values_list("to_state", flat=True))
    assert states[:2] == ["running", "starting"]


def test_a_killed_engine_is_restarted_after_a_backoff(agent):
    _reconcile_until(agent, _running, "the engine to come up")
    first_pid = agent.pid
    os.kill(first_pid, signal.SIGKILL)
    _reconcile_until(agent, lambda i: i.actual_state == "crashed", "the crash to be noticed", timeout=10)
    assert agent.restart_count == 1
    # restarted 10 s after the crash was noticed (however long the rest of that pass took)
    assert "restart 1 in 10s" in agent.events.first().reason
    assert 0 < (agent.next_start_at - timezone.now()).total_seconds() <= 10

    supervision.node_reconcile(agent.node.name)  # still inside the backoff: nothing starts
    agent.refresh_from_db()
    assert agent.actual_state == "crashed" and agent.pid is None

    supervision.engine_check(agent, timezone.now() + dt.timedelta(seconds=11))
    agent.refresh_from_db()
    assert agent.pid not in (None, first_pid)
    _reconcile_until(agent, _running, "the restarted engine to be healthy")


def test_backoff_doubles_to_a_five_minute_cap():
    assert [supervision.restart_delay(n) for n in range(1, 8)] == [10, 20, 40, 80, 160, 300, 300]


def test_a_stopped_engine_leaves_rotation_and_returns_when_it_resumes(agent):
    from controlplane.fleet.selectors import routable_instances

    _reconcile_until(agent, _running, "the engine to come up")
    os.kill(agent.pid, signal.SIGSTOP)  # alive, answers nothing: a hang
    _reconcile_until(agent, lambda i: i.actual_state == "unhealthy", "the hang to be noticed")
    assert routable_instances(tier_id=agent.tier_id) == []
    os.kill(agent.pid, signal.SIGCONT)
    _reconcile_until(agent, _running, "the engine to be healthy again")
    assert [i.pk for i in routable_instances(tier_id=agent.tier_id)] == [agent.pk]


def test_a_restarted_agent_adopts_the_engines_still_running(agent):
    # A separate agent process launches the engine, then exits, as a worker restart does.
    script = ("import django; django.setup(); from workers import supervision; "
              f"supervision.node_reconcile({agent.node.name!r})")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings",
           "ENGINE_LOG_DIR": str(agent.log_path or "") or os.environ.get("ENGINE_LOG_DIR", "/tmp"),
           "ENGINE_PORT_BASE": str(21000 + (os.getpid() % 500) * 8 + 4)}
    from django.db import connection

    env["DATABASE_URL"] = "postgres://postgres@127.0.0.1:5432/" + connection.settings_dict["NAME"]
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=True, timeout=60)
    agent.refresh_from_db()
    assert agent.actual_state == "starting" and process.is_alive(agent.pid)
    launched = agent.pid

    _reconcile_until(agent, _running, "this agent to adopt the engine")
    assert agent.pid == launched  # adopted, not relaunched
    assert EngineEvent.objects.filter(instance=agent, to_state="starting").count() == 1


def test_with_no_pass_asked_for_the_agent_supervises_on_its_own_clock(agent):
    """A host cut off from the broker gets no passes from the control plane: its agent launches,
    watches and keeps fresh the health of its engines by itself."""
    clock = supervision.SupervisionClock(agent.node.name, interval_s=0.2)
    clock.start()
    try:
        first = wait_for(lambda: _refreshed(agent) if _running(_refreshed(agent)) else None, timeout=20,
                         what="the engine launched and found healthy on the node's own clock")
        checked = first.last_health_at
        wait_for(lambda: _refreshed(agent).last_health_at > checked, timeout=5, what="its health checked again")
    finally:
        clock.stop(timeout=10)
    assert not clock._thread.is_alive()


def test_while_passes_are_asked_for_the_agents_clock_runs_none(agent):
    clock = supervision.SupervisionClock(agent.node.name, interval_s=0.2)
    clock.start()
    try:
        until = time.monotonic() + 1.5
        while time.monotonic() < until:  # a pass asked for just now, as the broker's come
            Node.objects.filter(pk=agent.node_id).update(last_seen_at=timezone.now())
            time.sleep(0.05)
    finally:
        clock.stop(timeout=10)
    assert _refreshed(agent).actual_state == "pending" and agent.pid is None  # nothing launched


def _refreshed(instance):
    instance.refresh_from_db()
    return instance


def test_setting_desired_stopped_terminates_the_engine(agent):
    _reconcile_until(agent, _running, "the engine to come up")
    pid = agent.pid
    EngineInstance.objects.filter(pk=agent.pk).update(desired_state="stopped")
    _reconcile_until(agent, lambda i: i.actual_state == "stopped", "the engine to stop")
    assert not process.is_alive(pid) and agent.pid is None


def test_a_pass_that_finds_another_pass_running_launches_nothing(agent):
    import fcntl
    from pathlib import Path

    from django.conf import settings

    lock_path = Path(settings.ENGINE_LOG_DIR) / f".reconcile-{agent.node.name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another pass is at work
        assert supervision.node_reconcile(agent.node.name) == 0
        agent.refresh_from_db()
        assert agent.pid is None and agent.actual_state == "pending"
    _reconcile_until(agent, _running, "the engine to come up once the lock is free")
    assert EngineEvent.objects.filter(instance=agent, to_state="starting").count() == 1


def test_an_engine_no_row_owns_is_stopped_as_an_orphan(agent):
    _reconcile_until(agent, _running, "the engine to come up")
    # A second copy of the same engine, as an overlapping pass or a lost row would leave.
    from tests.system.harness import free_port

    marker = supervision.engine_marker(agent)
    orphan = subprocess.Popen(
        [sys.executable, "-m", "workers.engines.simulator", "m", "--family", "qwen2", "--port", str(free_port())],
        cwd=ROOT, env={**os.environ, process.MARKER_ENV: marker}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: orphan.pid in process.marked_processes(marker), timeout=10, what="the orphan to start")
    supervision.node_reconcile(agent.node.name)
    assert orphan.wait(timeout=10) is not None  # stopped
    agent.refresh_from_db()
    assert process.is_alive(agent.pid)  # the owned engine runs on


def test_engines_of_another_deployment_on_the_same_host_are_left_alone(agent):
    _reconcile_until(agent, _running, "the engine to come up")
    from tests.system.harness import free_port

    other = subprocess.Popen(
        [sys.executable, "-m", "workers.engines.simulator", "m", "--family", "qwen2", "--port", str(free_port())],
        cwd=ROOT, env={**os.environ, process.MARKER_ENV: f"another-deployment/{agent.node.name}/{agent.pk}"},
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        supervision.node_reconcile(agent.node.name)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


@speaking
def test_each_pass_scrapes_the_engine_into_samples_and_gauges(agent):
    from controlplane.fleet.models import EngineMetricSample

    _reconcile_until(agent, _running, "the engine to come up")
    _reconcile_until(agent, lambda i: i.metrics_at is not None, "a scrape")
    sample = EngineMetricSample.objects.filter(instance=agent).first()
    assert sample is not None and sample.generation_tokens >= 1  # the completion probe produced a token
    assert sample.prompt_tokens >= 1 and sample.ttft is not None and sample.ttft["count"] >= 1
    assert agent.last_probe_at is not None and agent.probe_failures == 0


def test_repeated_crashes_show_as_a_crash_loop(agent):
    now = timezone.now()
    for n in range(1, 4):
        _reconcile_until(agent, lambda i: i.pid and process.is_alive(i.pid), f"start {n}")
        os.kill(agent.pid, signal.SIGKILL)
        wait_for(lambda: not process.is_alive(agent.pid), timeout=5, what="the kill")
        now = now + dt.timedelta(seconds=400)  # past any backoff
        supervision.engine_check(EngineInstance.objects.select_related("tier", "node").get(pk=agent.pk), now)
        agent.refresh_from_db()
        assert agent.restart_count == n
        assert agent.actual_state == ("crashloop" if n >= 3 else "crashed")
        supervision.engine_check(EngineInstance.objects.select_related("tier", "node").get(pk=agent.pk),
                                 now + dt.timedelta(seconds=301))
        agent.refresh_from_db()
    assert "restart 3 in 40s" in agent.events.filter(to_state="crashloop").first().reason


def test_an_idle_engine_drains_and_stops(agent):
    from controlplane.fleet.services import instance_action

    _reconcile_until(agent, _running, "the engine to come up")
    pid = agent.pid
    instance_action(instance=agent, action="drain", user=None)
    _reconcile_until(agent, lambda i: i.actual_state == "draining", "draining to start")
    assert not agent.healthy
    _reconcile_until(agent, lambda i: i.actual_state == "stopped", "the drained engine to stop", timeout=30)
    assert not process.is_alive(pid)
    assert "drained after" in agent.state_reason


@speaking
def test_a_draining_engine_finishes_its_in_flight_request_first(agent, settings):
    import threading

    import httpx

    from controlplane.fleet.services import instance_action

    agent.tier.engine_settings = {**agent.tier.engine_settings, "decode_ms_per_token": 150}
    agent.tier.save()
    _reconcile_until(agent, _running, "the engine to come up")
    result = {}

    def long_request():
        response = httpx.post(f"{agent.base_url}/v1/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {agent.api_key}"},
                              json={"model": agent.tier.name, "max_tokens": 30,
                                    "messages": [{"role": "user", "content": "a long answer please"}]})
        result["status"] = response.status_code

    client = threading.Thread(target=long_request)
    client.start()
    wait_for(lambda: supervision.node_reconcile(agent.node.name) is not None and
             EngineInstance.objects.get(pk=agent.pk).num_running >= 1, timeout=10, what="the request to run")
    instance_action(instance=agent, action="drain", user=None)
    _reconcile_until(agent, lambda i: i.actual_state == "draining", "draining to start")
    supervision.node_reconcile(agent.node.name)
    agent.refresh_from_db()
    assert agent.actual_state == "draining"  # still busy: not stopped under the request
    client.join(timeout=30)
    assert result["status"] == 200  # the in-flight request completed
    _reconcile_until(agent, lambda i: i.actual_state == "stopped", "the engine to stop once idle", timeout=30)


def test_a_draining_engine_whose_counters_cannot_be_read_is_not_taken_for_idle(agent):
    from controlplane.fleet.services import instance_action

    _reconcile_until(agent, _running, "the engine to come up")
    instance_action(instance=agent, action="drain", user=None)
    _reconcile_until(agent, lambda i: i.actual_state == "draining", "draining to start")
    # Its last scrape said idle (num_running 0), but it no longer answers: it may be busy.
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        later = timezone.now() + dt.timedelta(seconds=10)  # well past the drain's grace
        supervision.engine_check(EngineInstance.objects.select_related("tier", "node").get(pk=agent.pk), later)
        agent.refresh_from_db()
        assert agent.actual_state == "draining"
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    _reconcile_until(agent, lambda i: i.actual_state == "stopped", "the engine to stop once seen idle", timeout=30)


def test_an_external_engine_is_watched_and_routed_to_but_never_launched(world, settings):
    from controlplane.catalog.models import ModelTier
    from controlplane.fleet.selectors import routable_instances
    from tests.engines import simulator

    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["127.0.0.1/32"]  # where the test's engine runs
    tier = ModelTier.objects.create(name="vlm-ext", family="qwen2_5_vl", model_id="m", kind="vision",
                                    engine_kind="external", resolution_policy=world.vision.resolution_policy,
                                    price_plan=world.vision.price_plan)
    with simulator(name="vlm-ext") as port:
        instance = EngineInstance.objects.create(tier=tier, external_url=f"http://127.0.0.1:{port}")
        supervision.external_reconcile()
        instance.refresh_from_db()
        assert (instance.actual_state, instance.healthy, instance.pid) == ("running", True, None)
        assert [i.pk for i in routable_instances(tier_id=tier.pk)] == [instance.pk]
    supervision.external_reconcile()  # the endpoint is gone
    instance.refresh_from_db()
    assert instance.actual_state == "unhealthy" and routable_instances(tier_id=tier.pk) == []


def test_an_external_engine_serving_its_model_under_its_own_name_answers_for_the_tier(client, world, settings):
    from controlplane.catalog.models import ModelTier
    from controlplane.fleet.services import external_engine_register
    from tests.controlplane.gateway.calls import post
    from tests.engines import simulator

    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["127.0.0.1/32"]  # where the test's engine runs
    tier = ModelTier.objects.create(name="vlm-7b", family="qwen2_5_vl", model_id="Qwen/Qwen2.5-VL-7B-Instruct",
                                    kind="vision", engine_kind="external",
                                    resolution_policy=world.vision.resolution_policy, price_plan=world.vision.price_plan)
    with simulator(name="Qwen/Qwen2.5-VL-7B-Instruct") as port:
        # Registered under the tier's name, the engine knows no model "vlm-7b": its probe fails.
        unnamed = external_engine_register(tier=tier, url=f"http://127.0.0.1:{port}", actor="olivia")
        supervision.external_reconcile()
        unnamed.refresh_from_db()
        assert unnamed.actual_state == "unhealthy" and "404" in unnamed.state_reason
        unnamed.delete()
        external_engine_register(tier=tier, url=f"http://127.0.0.1:{port}", actor="olivia",
                                 served_model_name="Qwen/Qwen2.5-VL-7B-Instruct")
        supervision.external_reconcile()
        response = post(client, world.alice_key, {"model": "vlm-7b", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hello"}]})
    assert response.status_code == 200, response.content
    assert response.json()["model"] == "vlm-7b"  # as the client asked, whatever the engine calls it


def test_an_external_engine_at_an_address_no_longer_trusted_is_taken_out_of_rotation(world, settings):
    from controlplane.catalog.models import ModelTier
    from controlplane.fleet.selectors import routable_instances
    from tests.engines import simulator

    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["127.0.0.1/32"]
    tier = ModelTier.objects.create(name="vlm-ext", family="qwen2_5_vl", model_id="m", kind="vision",
                                    engine_kind="external", resolution_policy=world.vision.resolution_policy,
                                    price_plan=world.vision.price_plan)
    with simulator(name="vlm-ext") as port:
        instance = EngineInstance.objects.create(tier=tier, external_url=f"http://127.0.0.1:{port}")
        supervision.external_reconcile()
        assert [i.pk for i in routable_instances(tier_id=tier.pk)] == [instance.pk]
        # Its name now points inside the network, or the network is no longer trusted: each
        # pass vets the URL again, and the engine answering its health check changes nothing.
        settings.OPERATOR_URL_TRUSTED_NETWORKS = []
        supervision.external_reconcile()
        instance.refresh_from_db()
        assert (instance.actual_state, instance.healthy) == ("unhealthy", False)
        assert "engine URL host '127.0.0.1' resolves to 127.0.0.1, a loopback address" in instance.state_reason
        assert routable_instances(tier_id=tier.pk) == []


@speaking
def test_a_hang_that_health_does_not_show_is_caught_within_30_seconds(agent):
    """The engine answers /health but serves nothing: counters freeze, the probe times out."""
    import time

    import httpx

    _reconcile_until(agent, _running, "the engine to come up")
    headers = {"Authorization": f"Bearer {agent.api_key}"}
    httpx.post(f"{agent.base_url}/sim/fault", json={"mode": "hang"}, headers=headers, timeout=5).raise_for_status()
    hung_at = time.monotonic()
    assert httpx.get(f"{agent.base_url}/health", timeout=5).status_code == 200  # health still says fine
    _reconcile_until(agent, lambda i: i.actual_state == "unhealthy", "the hang to be caught", timeout=40)
    assert time.monotonic() - hung_at < 30
    assert "hung" in agent.state_reason or "probe failed" in agent.state_reason
    httpx.post(f"{agent.base_url}/sim/fault", json={"mode": "none"}, headers=headers, timeout=5)
    _reconcile_until(agent, _running, "the engine back in rotation")


def _engine_with_a_child(marker: str) -> subprocess.Popen:
    """A process group like vLLM's: a leader and a child that can outlive it."""
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
    return subprocess.Popen([sys.executable, "-c", script], env={**os.environ, process.MARKER_ENV: marker},
                            start_new_session=True)


def test_an_engines_children_are_not_orphans_and_do_not_outlive_a_crash(agent):
    marker = supervision.engine_marker(agent)
    leader = _engine_with_a_child(marker)
    wait_for(lambda: len(process.marked_processes(marker)) == 2, timeout=10, what="the engine and its child")
    child = next(pid for pid in process.marked_processes(marker) if pid != leader.pid)
    EngineInstance.objects.filter(pk=agent.pk).update(pid=leader.pid, actual_state="running", healthy=True,
                                                      started_at=timezone.now())
    assert supervision.stop_orphans(agent.node) == 0  # the child belongs to a living engine
    assert process.is_alive(child)

    leader.kill()
    leader.wait()
    supervision.engine_check(EngineInstance.objects.select_related("tier", "node").get(pk=agent.pk), timezone.now())
    agent.refresh_from_db()
    assert agent.actual_state == "crashed"
    wait_for(lambda: not process.is_alive(child), timeout=10, what="the child to be stopped with its crashed leader")


def test_an_sglang_tier_on_a_node_without_sglang_fails_at_once_with_the_reason(agent, settings):
    from controlplane.catalog.engine_settings import applicable

    tier = agent.tier
    tier.engine_kind, tier.engine_settings = "sglang", applicable(tier.engine_settings, "sglang")
    tier.save()
    settings.SGLANG_PYTHON = sys.executable  # this node's SGLANG_PYTHON has no SGLang
    _reconcile_until(agent, lambda i: i.actual_state == "failed", "the launch to be refused")
    assert agent.pid is None and not agent.command
    assert f"SGLang is not installed for {sys.executable}" in agent.state_reason


def test_an_engine_whose_every_slot_holds_a_long_answer_is_busy_not_hung(agent):
    import threading

    import httpx

    # One slot, held for some seconds by one long answer: the completion probe waits behind it
    # and fails, pass after pass, while the engine's counters advance.
    agent.tier.engine_settings = {**agent.tier.engine_settings, "max_num_seqs": 1, "decode_ms_per_token": 20}
    agent.tier.save()
    _reconcile_until(agent, _running, "the engine to come up")
    pid, result = agent.pid, {}

    def long_request():
        response = httpx.post(f"{agent.base_url}/v1/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {agent.api_key}"},
                              json={"model": agent.tier.name, "max_tokens": 450, "min_tokens": 450, "ignore_eos": True,
                                    "messages": [{"role": "user", "content": "a long answer please"}]})
        result["status"] = response.status_code

    client = threading.Thread(target=long_request)
    client.start()
    probes = set()
    while client.is_alive():
        # A probe on every pass (it is due every 10 s), so that failures would mount quickly.
        EngineInstance.objects.filter(pk=agent.pk).update(last_probe_at=timezone.now() - liveness.PROBE_EVERY)
        supervision.node_reconcile(agent.node.name)
        agent.refresh_from_db()
        probes.add(agent.last_probe_at)
        assert _running(agent) and agent.pid == pid, agent.state_reason
    client.join()
    assert result["status"] == 200 and len(probes) >= 3  # probed on several passes, never taken for hung
