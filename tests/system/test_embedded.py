"""Embedded mode: what `make run` gives on a machine with no database or Redis server."""

from __future__ import annotations

import sqlite3

import httpx
import openai
import pytest

from tests.images import data_url, image_bytes
from tests.system.harness import System, free_port, system_env, wait_for
from workers.engines import process

# One started system serves every test of the group, on one xdist worker.
pytestmark = [pytest.mark.system, pytest.mark.xdist_group("embedded")]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    var_dir = tmp_path_factory.mktemp("embedded")
    # As `make run` starts it: no secret key given (one is generated once under var/), DEBUG off.
    env = system_env(var_dir=var_dir, extra={"NODE_NAME": "embedded-node", "LOCAL_SECRET_KEY": "true"})
    env.pop("SECRET_KEY")
    env.pop("ALLOWED_HOSTS", None)
    running = System(env=env, var_dir=var_dir, port=free_port())
    running.start()
    running.wait_for_engines(tiers=("text", "vlm-lite"))
    yield running
    running.stop()


def _db(system: System) -> sqlite3.Connection:
    return sqlite3.connect(system.var_dir / "controlplane.sqlite3", timeout=20)


def test_it_serves_and_meters_an_image_request_without_any_server(embedded):
    client = openai.OpenAI(base_url=f"{embedded.base_url}/v1", api_key=embedded.api_key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="vlm-lite", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe"},
            {"type": "image_url", "image_url": {"url": data_url(image_bytes(1280, 720))}}]}])
    completion = raw.parse()
    # 1280x720 is under the 1,003,520-pixel cap; Qwen2.5-VL rounds it to 1288x728:
    # 46 x 26 merged patches = 1196 features, plus vision start and end.
    assert completion.usage.prompt_tokens_details.image_tokens == 1198
    with _db(embedded) as db:
        row = db.execute(
            "SELECT image_count, image_tokens, output_tokens FROM metering_usageevent WHERE request_id=?",
            (raw.headers["x-request-id"],)).fetchone()
    assert row == (1, completion.usage.prompt_tokens_details.image_tokens, completion.usage.completion_tokens)
    assert (embedded.var_dir / "secret_key").exists()

    def rolled_up():
        with _db(embedded) as db:
            total = db.execute("SELECT SUM(image_tokens) FROM metering_dailyusage").fetchone()[0]
        return total and total >= completion.usage.prompt_tokens_details.image_tokens

    wait_for(rolled_up, timeout=30, interval=0.5, what="beat to roll usage up over the file broker")


def test_an_unknown_page_is_the_products_404_not_a_list_of_every_url(embedded):
    response = httpx.get(f"{embedded.base_url}/no-such-page/", timeout=10)
    assert response.status_code == 404 and 'id="not-found"' in response.text
    assert "URLconf" not in response.text and "api/v1/" not in response.text


def test_a_second_run_starts_cleanly_with_the_same_demo_key(embedded):
    key = embedded.api_key
    with _db(embedded) as db:
        running = [pid for (pid,) in db.execute("SELECT pid FROM fleet_engineinstance WHERE pid IS NOT NULL")]
    assert running
    embedded.stop()
    with _db(embedded) as db:
        pids = db.execute("SELECT pid FROM fleet_engineinstance WHERE pid IS NOT NULL").fetchall()
    assert pids == []  # Ctrl-C stopped the engines too...
    assert not [pid for pid in running if process.is_alive(pid)]  # ...really: no process is left
    embedded.start()  # migrate, seed and run again, as a second `make run` does
    assert embedded.api_key == key
    embedded.wait_for_engines(tiers=("text",))


SQLITE_CONCURRENCY = r"""
import datetime as dt, threading
from django.db import connection
from controlplane.gateway.ledger import Ask, DatabaseLedger, Limits, Refused
from controlplane.tenants.models import Tenant
tenant, _ = Tenant.objects.get_or_create(name="sqlite-race")
backend = DatabaseLedger()
now = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)
start, results = threading.Barrier(24), []
def ask():
    start.wait()
    try:
        backend.reserve_sync(tenant.pk, Limits(image_tokens=1000), Ask(100, 150, False), now)
        results.append("admitted")
    except Refused:
        results.append("refused")
    finally:
        connection.close()
threads = [threading.Thread(target=ask) for _ in range(24)]
[t.start() for t in threads]; [t.join() for t in threads]
print(results.count("admitted"), results.count("refused"))
"""


def test_parallel_requests_never_admit_more_than_the_quota_on_sqlite(embedded):
    """The same concurrency test as for Redis and PostgreSQL, on the embedded database."""
    out = embedded.manage("shell", "-c", SQLITE_CONCURRENCY).stdout.split()
    assert out[-2:] == ["10", "14"]
