"""The control plane served as production serves it, for tests that speak HTTP on sockets."""

from __future__ import annotations

import asyncio
import threading

import pytest
import uvicorn
from asgiref.sync import sync_to_async
from django.db import connections

from controlplane.serving import BoundedHttpProtocol
from tests.system.harness import free_port, wait_for


@pytest.fixture
def serve():
    """`serve(app, **config)`: `app` served by uvicorn with the project's protocol
    (controlplane.serving) on a thread of its own; returns the port."""
    servers = []

    def start(app, **config) -> int:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=BoundedHttpProtocol,
                                               log_level="warning", lifespan="off", access_log=False,
                                               **{"proxy_headers": False, **config}))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        wait_for(lambda: server.started, timeout=10, interval=0.02, what="the server to listen")
        return port

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)
    # The database work of the requests ran on asgiref's thread: its connection is closed
    # there, so that the test database can be flushed and dropped.
    asyncio.run(sync_to_async(connections.close_all)())
