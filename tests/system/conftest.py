"""One started system shared by the end-to-end tests (they run in one xdist group)."""

from __future__ import annotations

import os
import uuid

import psycopg
import pytest
import redis
from django.db import connections

from tests.system.harness import System, free_port, system_env, wait_for

PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "test"}
# Flushed at the start: a database of its own (SYSTEM_REDIS_DB picks another, so that two
# checkouts can run their system tests on one Redis at once).
SYSTEM_REDIS_DB = int(os.environ.get("SYSTEM_REDIS_DB", "15"))


def _admin(sql: str) -> None:
    with psycopg.connect(**PG, autocommit=True) as conn:
        conn.execute(sql)


# Sorts after the demo's vision tiers, so that `auto` keeps sending images where the other tests expect.
REAL_TIER = "vlm-tiny-cpu"


@pytest.fixture(scope="session")
def system(tmp_path_factory, django_db_blocker, vllm_cpu_python):
    """The whole product on PostgreSQL and Redis, started with `manage.py runlocal`, with the
    demo's simulated tiers and one tier on the real vLLM CPU build (launched by the node
    agent as in production; it starts while the first tests run)."""
    name = f"system_{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE DATABASE "{name}"')
    redis.Redis(host="127.0.0.1", db=SYSTEM_REDIS_DB).flushdb()
    var_dir = tmp_path_factory.mktemp("system")
    env = system_env(var_dir=var_dir, extra={
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{name}",
        "REDIS_URL": f"redis://127.0.0.1:6379/{SYSTEM_REDIS_DB}",
        "NODE_NAME": f"e2e-{os.getpid()}",
        "GATEWAY_TRUSTED_IMAGE_NETWORKS": "127.0.0.1/32",  # the tests' own image server
        "OPERATOR_URL_TRUSTED_NETWORKS": "127.0.0.1/32",  # the tests' own webhook receiver
        # A killed gateway's requests are taken for dead after 3 s instead of 30.
        "GATEWAY_HEARTBEAT_S": "1",
        "GATEWAY_JOURNAL_STALE_S": "3",
        "VLLM_PYTHON": str(vllm_cpu_python),
    })
    running = System(env=env, var_dir=var_dir, port=free_port())
    try:
        running.start()
        _connect_alias(name)
        with django_db_blocker.unblock():
            _add_real_tier(vllm_cpu_python)
        running.wait_for_engines()
        yield running
    finally:
        running.stop()
        connections["system"].close() if "system" in connections.settings else None
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _add_real_tier(python) -> None:
    from controlplane.catalog.models import ModelTier, PricePlan, ResolutionPolicy
    from controlplane.demo import CPU_ENGINE_SETTINGS
    from workers.engines.cpu import seeing_model

    # A policy of its own (the demo's standard one, copied), so that gating it touches no
    # other tier.
    policy = ResolutionPolicy.objects.using("system").get(name="standard")
    policy.pk, policy.name = None, "tiny-cpu"
    policy.save(using="system")
    ModelTier.objects.using("system").create(
        name=REAL_TIER, display_name="Tiny Qwen2.5-VL on vLLM's CPU build, trained here to read",
        family="qwen2_5_vl", kind="vision", engine_kind="vllm", model_id=str(seeing_model.ensure(python)),
        # Long answers let the drain test keep requests running for several supervision passes.
        engine_settings={**CPU_ENGINE_SETTINGS, "max_output_tokens": 7000}, large_image_threshold=100_000,
        resolution_policy=policy,
        price_plan=PricePlan.objects.using("system").get(name="vlm-lite"))
    connections["system"].close()


@pytest.fixture(scope="session")
def real_engine(system, django_db_blocker):
    """The real vLLM instance once it serves (its first start takes about a minute)."""
    from controlplane.fleet.models import EngineInstance

    def serving():
        return EngineInstance.objects.using("system").filter(
            tier__name=REAL_TIER, actual_state="running", healthy=True).select_related("tier", "node").first()

    with django_db_blocker.unblock():
        try:
            instance = wait_for(serving, timeout=420, interval=1, what=f"the {REAL_TIER} engine to serve")
        finally:
            connections["system"].close()
    system.wait_for_engines(tiers=(REAL_TIER,), timeout=30)
    return instance


def _connect_alias(name: str) -> None:
    settings = dict(connections.settings["default"])
    settings["NAME"] = name
    settings["TEST"] = {**settings.get("TEST", {}), "NAME": name}
    connections.settings["system"] = settings


@pytest.fixture
def system_db(system, django_db_blocker):
    """Read the running system's database through the ORM: `Model.objects.using('system')`."""
    with django_db_blocker.unblock():
        yield "system"
        connections["system"].close()
