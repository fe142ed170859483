"""One started system shared by the end-to-end tests (they run in one xdist group)."""

from __future__ import annotations

import os
import uuid

import psycopg
import pytest
import redis
from django.db import connections

from tests.system.harness import System, free_port, system_env

PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "test"}
SYSTEM_REDIS_DB = 15


def _admin(sql: str) -> None:
    with psycopg.connect(**PG, autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture(scope="session")
def system(tmp_path_factory, django_db_blocker):
    """The whole product on PostgreSQL and Redis, started with `manage.py runlocal`."""
    name = f"system_{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE DATABASE "{name}"')
    redis.Redis(host="127.0.0.1", db=SYSTEM_REDIS_DB).flushdb()
    var_dir = tmp_path_factory.mktemp("system")
    env = system_env(var_dir=var_dir, extra={
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{name}",
        "REDIS_URL": f"redis://127.0.0.1:6379/{SYSTEM_REDIS_DB}",
        "NODE_NAME": f"e2e-{os.getpid()}",
        "GATEWAY_TRUSTED_IMAGE_NETWORKS": "127.0.0.1/32",  # the tests' own image server
        # A killed gateway's requests are taken for dead after 3 s instead of 30.
        "GATEWAY_HEARTBEAT_S": "1",
        "GATEWAY_JOURNAL_STALE_S": "3",
    })
    running = System(env=env, var_dir=var_dir, port=free_port())
    try:
        running.start()
        running.wait_for_engines()
        _connect_alias(name)
        yield running
    finally:
        running.stop()
        connections["system"].close() if "system" in connections.settings else None
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
