"""A bench stops its gateway servers within the delay and grace it gives them, and always."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

from bench import gateway


def _server(stops_after_s: float | None) -> subprocess.Popen:
    """A process that exits `stops_after_s` after SIGTERM, as a server finishing its requests
    does (None: never), once it is ready to be told."""
    on_term = "signal.SIG_IGN" if stops_after_s is None else f"lambda *_: (time.sleep({stops_after_s}), sys.exit(0))"
    code = (f"import signal, sys, time\nsignal.signal(signal.SIGTERM, {on_term})\n"
            "print('ready', flush=True)\nwhile True: time.sleep(1)")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    return process


def test_servers_are_let_finish_within_their_delay_and_grace(monkeypatch):
    monkeypatch.setattr(gateway, "STOP_MARGIN_S", 1)
    servers = [_server(2), _server(2)]
    started = time.monotonic()
    gateway.stop_servers(servers, {"SHUTDOWN_DELAY_S": "1", "SHUTDOWN_GRACE_S": "2"})
    assert [server.returncode for server in servers] == [0, 0]  # stopped, not killed
    assert time.monotonic() - started < 3.5  # told together, waited for together


def test_a_server_past_its_grace_is_killed_and_the_stop_goes_on(monkeypatch):
    monkeypatch.setattr(gateway, "STOP_MARGIN_S", 0.5)
    server = _server(None)
    started = time.monotonic()
    gateway.stop_servers([server], {"SHUTDOWN_DELAY_S": "0", "SHUTDOWN_GRACE_S": "1"})
    assert server.returncode == -signal.SIGKILL and 1.5 <= time.monotonic() - started < 5


def test_the_bench_gateway_stops_with_a_short_grace_and_no_delay():
    env = gateway.Gateway(1).env
    shutil.rmtree(env["VAR_DIR"])
    assert env["SHUTDOWN_DELAY_S"] == "0" and int(env["SHUTDOWN_GRACE_S"]) <= 10
