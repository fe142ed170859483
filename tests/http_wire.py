"""HTTP on the wire: a client on a plain socket, for what an HTTP library will not send (a body
declared and never finished, a million headers) and for seeing what the server does to the
connection; and an application counting the body it takes, for what the server buffered."""

from __future__ import annotations

import http.client
import socket
import time
from dataclasses import dataclass


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


def send(port: int, head: str, body: bytes = b"") -> socket.socket:
    """A connection to 127.0.0.1:`port` that has sent `head` (a request line and headers,
    without the blank line that ends them) and the start of a body."""
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(head.replace("\n", "\r\n").encode() + b"\r\n\r\n" + body)
    return connection


def answer(connection: socket.socket, *, within: float = 10) -> Answer:
    """The response read from `connection`, or TimeoutError when none came within `within` seconds."""
    connection.settimeout(within)
    response = http.client.HTTPResponse(connection)
    response.begin()
    return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())


def refused(connection: socket.socket, *, within: float = 10) -> bool:
    """Whether the server closed `connection` without a word within `within` seconds."""
    connection.settimeout(within)
    try:
        return connection.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def closed(connection: socket.socket, *, within: float = 10) -> bool:
    """Whether the server closed `connection` (reading anything it still sent) within `within` seconds."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        connection.settimeout(left)
        try:
            if connection.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
    return False


class BodyBytesTaken:
    """An ASGI application as it is, counting the request body bytes it takes from the server:
    what it could have buffered."""

    def __init__(self, app):
        self.app, self.taken = app, 0

    async def __call__(self, scope, receive, send):
        async def counted():
            message = await receive()
            self.taken += len(message.get("body", b""))
            return message

        await self.app(scope, counted, send)
