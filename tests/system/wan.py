"""A slow, lossy link to one address, for a host in a network namespace: what `tc netem` does,
in user space, for kernels built without it.

Run inside the namespace: `python -m tests.system.wan --to 10.0.0.11 --delay-ms 200 --loss 0.05`.
Packets this host sends to `--to` are routed into a TUN device; this program holds each for the
delay, drops the given share at random, and sends the rest on through the host's own interface
(a raw socket whose mark selects a routing table that bypasses the TUN device). Packets coming
back are not touched here: run it on the other host too for both directions.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import socket
import struct
import subprocess
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
SO_MARK = 36
MARK = 0x77
TABLE = 177


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def route_through(name: str, to: str, via_dev: str) -> None:
    """Send what goes to `to` into the TUN device, and marked packets past it on `via_dev`."""
    for argv in (["ip", "link", "set", name, "up"],
                 ["ip", "route", "replace", f"{to}/32", "dev", name],
                 ["ip", "route", "replace", f"{to}/32", "dev", via_dev, "table", str(TABLE)],
                 ["ip", "rule", "add", "fwmark", str(MARK), "lookup", str(TABLE), "priority", "100"]):
        subprocess.run(argv, check=True)
    for conf in ("all", name, via_dev):  # replies come back on via_dev, not the TUN device
        with open(f"/proc/sys/net/ipv4/conf/{conf}/rp_filter", "w") as knob:
            knob.write("0")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--to", required=True)
    parser.add_argument("--dev", default="eth0")
    parser.add_argument("--delay-ms", type=float, default=200)
    parser.add_argument("--loss", type=float, default=0.05)
    args = parser.parse_args()
    name = "wan0"
    fd = open_tun(name)
    route_through(name, args.to, args.dev)
    out = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    out.setsockopt(socket.SOL_SOCKET, SO_MARK, MARK)
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    arrived = threading.Condition()
    delay = args.delay_ms / 1000

    def send() -> None:
        while True:
            with arrived:
                while not held:
                    arrived.wait()
                due, packet = held[0]
                if due > time.monotonic():
                    arrived.wait(due - time.monotonic())
                    continue
                held.popleft()
            destination = socket.inet_ntoa(packet[16:20])
            try:
                out.sendto(packet, (destination, 0))
            except OSError:
                pass  # as a link that drops it

    threading.Thread(target=send, daemon=True).start()
    print("ready", flush=True)
    while True:
        packet = os.read(fd, 65536)
        if not packet or packet[0] >> 4 != 4 or random.random() < args.loss:
            continue
        with arrived:
            held.append((time.monotonic() + delay, packet))
            arrived.notify()


if __name__ == "__main__":
    main()
