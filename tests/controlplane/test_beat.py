"""Beat sends each scheduled task once however many beats run (a deploy that overlaps the old
beat and the new): only the holder of the beat lease (in the database) sends, and another takes
it over once its holder stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import redis
from django.db import connection
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from controlplane.beat import BeatLease
from controlplane.fleet.models import Lease
from tests.conftest import skip_without_redis
from tests.system.harness import ROOT, free_port, wait_for

# Each test's beats have a broker and lease of their own, emptied before and after: the tests may
# run at once on two workers.
BROKERS = {"every second": "redis://127.0.0.1:6379/9", "takeover": "redis://127.0.0.1:6379/8",
           "redis down": "redis://127.0.0.1:6379/7"}
PROBE = "beat-probe"  # the queue the probe task is sent to (nothing consumes it)


@pytest.mark.django_db
def test_a_lease_is_held_by_one_owner_renewed_by_it_and_taken_over_once_it_lapses():
    if connection.vendor != "postgresql":
        pytest.skip("beats share their lease through PostgreSQL")
    first, second = (BeatLease(owner=owner, seconds=0.5) for owner in ("first", "second"))
    assert first.held() and not second.held() and first.held()  # renewed by its holder
    time.sleep(0.7)  # the holder stopped renewing it
    assert second.held() and not first.held()
    second.release()
    assert first.held()


def _sent(client) -> int:
    return client.llen(PROBE)


def _beats(settings, tmp_path, every_s: int, broker: str, lease_s: int = 2,
           redis_url: str | None = None) -> tuple[list[subprocess.Popen], redis.Redis]:
    """Two beats against the test database, a probe task due every `every_s` seconds, their lease
    `lease_s` long; the gateway's Redis the broker's unless `redis_url` says otherwise."""
    skip_without_redis()
    if connection.vendor != "postgresql":
        pytest.skip("the beats share the test database through PostgreSQL")
    every = IntervalSchedule.objects.create(every=every_s, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="probe", task="controlplane.probe", interval=every, queue=PROBE)
    client = redis.Redis.from_url(broker)
    client.flushdb()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", "DEBUG": "false",
           "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{connection.settings_dict['NAME']}",
           "CELERY_BROKER_URL": broker, "REDIS_URL": redis_url or broker, "SECRET_KEY": settings.SECRET_KEY, "VAR_DIR": str(tmp_path), "BEAT_LEASE_S": str(lease_s)}
    beats = [subprocess.Popen([sys.executable, "-m", "celery", "-A", "controlplane", "beat", "--loglevel", "WARNING",
                               "--pidfile", ""], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(2)]
    return beats, client


def _stopped(beats, client) -> None:
    for beat in beats:
        if beat.poll() is None:
            beat.send_signal(signal.SIGTERM)
    for beat in beats:
        try:
            beat.wait(timeout=20)
        except subprocess.TimeoutExpired:
            beat.kill()
            beat.wait()
    client.flushdb()


def _holder(beats) -> subprocess.Popen:
    pid = int(Lease.objects.get(name="beat").holder.split(":")[1])
    return next(beat for beat in beats if beat.pid == pid)


@pytest.mark.django_db(transaction=True)
def test_two_beats_at_once_send_a_task_due_every_second_once_a_second(settings, tmp_path):
    beats, client = _beats(settings, tmp_path, 1, BROKERS["every second"])
    try:
        wait_for(lambda: _sent(client) >= 1, timeout=30, what="a beat to send the probe")
        start, started = _sent(client), time.monotonic()
        time.sleep(6)
        per_second = (_sent(client) - start) / (time.monotonic() - started)
        assert 0.5 < per_second < 1.5  # once a second, not twice
        _holder(beats).kill()  # the other sends on, within a lease
        time.sleep(3)
        start, started = _sent(client), time.monotonic()
        time.sleep(4)
        assert (_sent(client) - start) / (time.monotonic() - started) > 0.5
    finally:
        _stopped(beats, client)


@pytest.mark.django_db(transaction=True)
def test_a_beat_taking_over_does_not_send_again_what_its_holder_sent(settings, tmp_path):
    # A lease longer than a loaded machine may keep its holder from renewing it: only a stop
    # should hand it over here (a lapse is the other test's).
    beats, client = _beats(settings, tmp_path, 20, BROKERS["takeover"], lease_s=6)
    try:
        wait_for(lambda: _sent(client) >= 1, timeout=30, what="a beat to send the probe")
        first_sent = time.monotonic()
        holder = _holder(beats)
        holder.send_signal(signal.SIGTERM)  # a deploy: the new beat takes over
        holder.wait(timeout=20)
        wait_for(lambda: _holder(beats) is not holder, timeout=10, what="the other beat to take the lease")
        time.sleep(max(0.0, 15 - (time.monotonic() - first_sent)))
        assert _sent(client) == 1  # not sent again on the takeover: due again only 20 s after
        wait_for(lambda: _sent(client) == 2, timeout=20, what="the new holder to send it when due")
    finally:
        _stopped(beats, client)


@pytest.mark.django_db(transaction=True)
def test_beats_with_a_broker_of_their_own_send_on_while_the_gateways_redis_is_down(settings, tmp_path):
    # Rollups, partitions and alerts go on through an outage of the gateway's Redis when the
    # broker is elsewhere (an alert that Redis is down is sent by beat); and still once, not twice.
    nothing_listens = f"redis://127.0.0.1:{free_port()}/0"
    beats, client = _beats(settings, tmp_path, 1, BROKERS["redis down"], redis_url=nothing_listens)
    try:
        wait_for(lambda: _sent(client) >= 1, timeout=30, what="a beat to send the probe")
        start, started = _sent(client), time.monotonic()
        time.sleep(6)
        assert 0.5 < (_sent(client) - start) / (time.monotonic() - started) < 1.5
    finally:
        _stopped(beats, client)
