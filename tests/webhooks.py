"""A real webhook receiver for the tests: an HTTP server on 127.0.0.1 (a port of its own) that
answers each post as told and keeps what it was sent."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from dataclasses import dataclass, field


@dataclass
class Receiver:
    url: str
    # What to answer, in turn: (status, headers, body, only posts whose text has this); once
    # used up, 200 "ok" as Slack does.
    answers: list = field(default_factory=list)
    received: list = field(default_factory=list)  # each post's JSON body, in order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, status: int, body: str = "", headers: dict | None = None, *, when: str = "") -> None:
        with self.lock:
            self.answers.append((status, headers or {}, body, when))

    def _next_answer(self, text: str) -> tuple[int, dict, str]:
        for i, (status, headers, body, when) in enumerate(self.answers):
            if when in text:
                del self.answers[i]
                return status, headers, body
        return 200, {}, "ok"

    def texts(self) -> list[str]:
        with self.lock:
            return [body.get("text", "") for body in self.received]


@contextlib.contextmanager
def webhook_receiver():
    receiver = Receiver(url="")

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with receiver.lock:
                received = (json.loads(raw) if self.headers.get("Content-Type") == "application/json"
                            else {"unexpected content type": self.headers.get("Content-Type")})
                receiver.received.append(received)
                status, headers, body = receiver._next_answer(str(received.get("text", "")))
            data = body.encode()
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/T000/B000/secret-token"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
