"""A relay in front of Redis for tests of what happens while Redis's reply is on its way."""

from __future__ import annotations

import contextlib
import socket
import threading
import urllib.parse
import uuid

HOLD_S = 10  # a reply is held at most this long (Redis's replies are awaited for longer)


class HeldReplies:
    """A relay in front of Redis that passes every command on at once and every reply back,
    except on a connection that has sent `marker` (a script's hash, say): there Redis's
    replies are held until `release()`."""

    def __init__(self, redis_url: str, marker: bytes):
        parsed = urllib.parse.urlsplit(redis_url)
        self.target = (parsed.hostname, parsed.port or 6379)
        self.marker = marker
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = parsed._replace(netloc=f"127.0.0.1:{self.listener.getsockname()[1]}").geturl()
        self.released = threading.Event()
        self.acknowledged = threading.Event()  # a reply to the marked command has gone back
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self.sockets += [client, server]
            handed = threading.Event()
            threading.Thread(target=self._commands, args=(client, server, handed), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, handed), daemon=True).start()

    def _commands(self, client, server, handed) -> None:
        while data := _recv(client):
            if self.marker in data:
                handed.set()  # before Redis can have answered it
            if not _send(server, data):
                return

    def _replies(self, server, client, handed) -> None:
        while data := _recv(server):
            if handed.is_set():
                self.released.wait(HOLD_S)
            if not _send(client, data):
                return
            if handed.is_set():
                self.acknowledged.set()

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.release()
        self.listener.close()
        for sock in self.sockets:
            sock.close()


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except OSError:  # the relay closed at the test's end
        return False


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


@contextlib.contextmanager
def ledger_behind_relay(settings, marker: bytes, name: str):
    """The gateway's ledger in Redis, under keys of its own, reached through a HeldReplies relay
    holding the replies on connections that sent `marker` (its keys removed afterwards).
    `settings`: pytest-django's fixture."""
    import redis

    from tests.conftest import skip_without_redis

    skip_without_redis()
    prefix = f"{name}-{uuid.uuid4().hex}"
    relay = HeldReplies(settings.REDIS_URL, marker)
    settings.USAGE_OUTBOX = "redis"
    settings.CACHES = {"default": {**settings.CACHES["default"], "KEY_PREFIX": prefix}}
    real_redis = settings.REDIS_URL
    settings.REDIS_URL = relay.url
    settings.REDIS_TIMEOUT_S = 2 * HOLD_S
    try:
        yield relay
    finally:
        relay.close()
        client = redis.Redis.from_url(real_redis)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
