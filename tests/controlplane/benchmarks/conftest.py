"""Engines and a gateway for benchmark runs to load: real simulator processes, and the
whole ASGI application served by uvicorn on a thread (the load generator speaks HTTP)."""

from __future__ import annotations

import threading

import pytest
import uvicorn
from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone

from controlplane.fleet.models import EngineInstance, Node
from tests.engines import simulator
from tests.system.harness import free_port, wait_for


@pytest.fixture(scope="module")
def engine_port():
    with simulator(name="vlm-lite") as port:
        yield port


@pytest.fixture
def instance(world, engine_port):
    node = Node.objects.create(name="local", address="127.0.0.1", queue="node.local",
                               last_seen_at=timezone.now())
    return EngineInstance.objects.create(tier=world.vision, node=node, port=engine_port, actual_state="running",
                                         healthy=True, last_health_at=timezone.now())


@pytest.fixture
def gateway_url(settings):
    from controlplane.asgi import application

    # A gateway of the operator's own on this host (behind a load balancer, say): trusted.
    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["127.0.0.1/32"]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=10, what="the gateway to listen")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    # The gateway's database work ran on asgiref's thread: close its connection there, so
    # that the test database can be flushed and dropped.
    import asyncio

    asyncio.run(sync_to_async(connections.close_all)())
