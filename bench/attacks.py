"""Other tenants' text latency, and the gateway's memory, while an attacker makes it work before
admission: each attack beside the same load without it, in one run.

    python -m bench.attacks [--seconds 10] [--before REF]

One gateway process as production runs it (uvicorn with the project's protocol, PostgreSQL,
Redis) in front of the instant fake upstream (bench/fake_upstream.py). A victim tenant sends
text requests open loop (VICTIM_RATE a second over keep-alive connections; each latency taken
from when its request was due, so a stall counts in full). An attacker, a tenant of its own for
each attack with a quota of ATTACKER_RPM requests a minute and the gateway's default limits
otherwise, sends one of the bodies the security test found costly at the rate its key allows
(ATTACKER_RPM a minute, on up to ATTACKER_CONNECTIONS connections), from a process of its own;
with --flood, as fast as the gateway answers, never waiting for Retry-After. For each attack the
victim's p50 and p99 with the attack are printed beside the same load without it (run just
before), the attacker's answers by status, the gateway's CPU seconds, and its resident memory
(before, and its peak during). Every process shares this machine's cores: the attacker's own
work (building a 54 MB body) takes from them too.

With --before REF the same run is made against the gateway at git commit REF, checked out in a
temporary worktree (its C extension built there): the naive gateway beside this one.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.gateway import PG, STOPPING_ENV, free_port, stop_servers, wait_http
from bench.proc import cpu_seconds, status_kb

ROOT = Path(__file__).resolve().parent.parent
REDIS = "redis://127.0.0.1:6379/11"
VICTIM_RATE, VICTIM_CONNECTIONS = 100, 8
ATTACKER_RPM, ATTACKER_CONNECTIONS = 600, 4
GRACE_S = 20  # how long past its phase an attack's requests may still be answered
SEED = """
import json, sys
from django.utils import timezone
from controlplane.catalog.models import ModelTier, PricePlan, PriceRate, ResolutionPolicy
from controlplane.fleet.models import EngineInstance
from controlplane.tenants.models import Quota, Tenant
from controlplane.tenants.services import api_key_create
plan = PricePlan.objects.create(name="bench")
PriceRate.objects.create(plan=plan, effective_from=timezone.now() - timezone.timedelta(days=1),
                         text_input_per_mtok=1, image_per_mtok=1, output_per_mtok=1)
policy = ResolutionPolicy.objects.create(name="bench")  # the defaults: 16 MP in all, 1 MP sent
common = {"model_id": "fake", "engine_kind": "external", "price_plan": plan,
          "engine_settings": {"max_model_len": 32768, "max_output_tokens": 1024}}
text = ModelTier.objects.create(name="text", family="qwen2", kind="text", **common)
vision = ModelTier.objects.create(name="vlm", family="qwen2_5_vl", kind="vision", resolution_policy=policy, **common)
for tier in (text, vision):
    EngineInstance.objects.create(tier=tier, external_url=sys.argv[1], actual_state="running", healthy=True,
                                  last_health_at=timezone.now())
victim = Tenant.objects.create(name="victim")
Quota.objects.create(tenant=victim, period="month", requests_per_minute=10**7)
attackers = []
for n in range(int(sys.argv[3])):
    attacker = Tenant.objects.create(name=f"attacker-{n}")
    Quota.objects.create(tenant=attacker, period="month", requests_per_minute=int(sys.argv[2]))
    attackers.append(api_key_create(tenant=attacker).secret)
print(json.dumps({"victim": api_key_create(tenant=victim).secret, "attackers": attackers}))
"""
# What the control plane's workers would do meanwhile: the external engine's health checks, and
# the usage stream ingested (a tenant's first admission of a period reads what is left in it).
FRESH = """
import sys, time
from django.db import connection
from django.utils import timezone
from controlplane.fleet.models import EngineInstance
from controlplane.metering.outbox import usage_ingest
while True:
    EngineInstance.objects.update(last_health_at=timezone.now())
    while usage_ingest():
        pass
    connection.close()
    time.sleep(2)
"""


class Gateway:
    """A gateway process from the code at `root`, on a database and Redis db of its own."""

    def __init__(self, root: Path, name: str, upstream_port: int, redis_url: str):
        self.root, self.db, self.port, self.redis_url = root, f"bench_attacks_{name}_{os.getpid()}", free_port(), redis_url
        self.env = {**{k: v for k, v in os.environ.items() if k not in ("USAGE_OUTBOX", "VAR_DIR", "PYTHONPATH")},
                    "PYTHONPATH": str(root), "DATABASE_URL": f"{PG}/{self.db}", "REDIS_URL": redis_url,
                    "DEBUG": "false", "SECRET_KEY": "bench-" + "b" * 50, "ALLOWED_HOSTS": "127.0.0.1",
                    "DJANGO_SETTINGS_MODULE": "controlplane.settings", "LOG_LEVEL": "CRITICAL",
                    "VAR_DIR": tempfile.mkdtemp(prefix="bench-attacks-"), **STOPPING_ENV}
        self.upstream = f"http://127.0.0.1:{upstream_port}"
        self.processes: list[subprocess.Popen] = []

    def _python(self, code: str, *args: str) -> str:
        script = "import django; django.setup()\n" + code
        return subprocess.run([sys.executable, "-c", script, *args], cwd=self.root, env=self.env, check=True,
                              capture_output=True, text=True).stdout

    def start(self) -> dict[str, str]:
        import psycopg

        with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db}"')
            conn.execute(f'CREATE DATABASE "{self.db}"')
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=self.root, env=self.env,
                       check=True, capture_output=True)
        keys = json.loads(self._python(SEED, self.upstream, str(ATTACKER_RPM), str(len(ATTACKS))))
        self.processes.append(subprocess.Popen([sys.executable, "-c", "import django; django.setup()\n" + FRESH],
                                               cwd=self.root, env=self.env))
        self.server = subprocess.Popen([sys.executable, "-m", "controlplane.serving", "--port", str(self.port),
                                        "--log-level", "critical"], cwd=self.root, env=self.env,
                                       stderr=subprocess.DEVNULL)
        self.processes.append(self.server)
        wait_http(f"http://127.0.0.1:{self.port}/login/")
        return keys

    def stop(self) -> None:
        stop_servers(self.processes, self.env)
        import psycopg
        import redis

        redis.Redis.from_url(self.redis_url).flushdb()
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')
        shutil.rmtree(self.env["VAR_DIR"], ignore_errors=True)


# -- the bodies ----------------------------------------------------------------------------------

def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")


def zeros_png(width: int, height: int) -> bytes:
    """A PNG of black rows, a few hundred kilobytes at most, that decodes to width x height."""
    compressor, row = zlib.compressobj(9), b"\0" * (1 + width * 3)
    payload = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes((8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", payload) + _png_chunk(b"IEND", b"")


def with_text(png: bytes) -> bytes:
    """`png` with a text chunk of its own: the same pixels, other bytes."""
    return png[:33] + _png_chunk(b"tEXt", f"Comment\0{random.random()}".encode()) + png[33:]


def chat(picture: bytes, mime: str) -> bytes:
    url = f"data:{mime};base64," + base64.b64encode(picture).decode()
    return json.dumps({"model": "vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


def _scan_bomb(width: int, height: int, scans: int) -> bytes:
    sys.path.insert(0, str(ROOT))
    from tests.imaging_corpus import jpeg_scan_bomb

    return jpeg_scan_bomb(width, height, scans, colour=True)


@dataclass
class Attack:
    name: str
    path: str
    body: bytes
    content_type: str = "application/json"
    head: str = ""  # extra request header lines, raw
    method: str = "POST"
    vary: object = None  # what makes each request's body of the one before, if anything
    held: int = 0  # connections that send all their body but its last byte, and wait

    def next_body(self) -> bytes:
        return self.vary(self.body) if self.vary is not None else self.body


def _multipart(picture: bytes) -> tuple[bytes, str]:
    boundary = "benchboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"tier\"\r\n\r\nvlm\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"p.jpg\"\r\n"
            "Content-Type: image/jpeg\r\n\r\n").encode() + picture + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def _estimate() -> Attack:
    body, kind = _multipart(_scan_bomb(2000, 2000, 60)[:-2])
    return Attack("estimate of a 2000x2000 progressive JPEG", "/api/v1/estimate/", body, content_type=kind)


def _chat_attack(name: str, picture, mime: str, vary=None) -> Attack:
    if vary is None:
        return Attack(name, "/v1/chat/completions", chat(picture(), mime))
    return Attack(name, "/v1/chat/completions", picture(), vary=lambda png: chat(vary(png), mime))


# Each built in the attacker's process, when its turn comes: name -> what makes it.
ATTACKS = {
    "JPEG 4100x4000, 2,646 scans (194 KB)": lambda name: _chat_attack(name, lambda: _scan_bomb(4100, 4000, 2646),
                                                                       "image/jpeg"),
    "JPEG 4000x4000, 60 scans, cut short": lambda name: _chat_attack(name, lambda: _scan_bomb(4000, 4000, 60)[:-2],
                                                                      "image/jpeg"),
    "JPEG 1000x1000, 2,646 scans": lambda name: _chat_attack(name, lambda: _scan_bomb(1000, 1000, 2646),
                                                              "image/jpeg"),
    "PNG 7000x7000 of zeros, new text each": lambda name: _chat_attack(name, lambda: zeros_png(7000, 7000),
                                                                        "image/png", with_text),
    "PNG 4000x4000 of zeros, new text each": lambda name: _chat_attack(name, lambda: zeros_png(4000, 4000),
                                                                        "image/png", with_text),
    "2,048 x 1,024 content parts (54.6 MB)": lambda name: Attack(name, "/v1/chat/completions", json.dumps(
        {"model": "vlm", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1024}] * 2048}
    ).encode()),
    "a million empty arrays (3 MB)": lambda name: Attack(name, "/v1/chat/completions", b'{"model": "vlm", '
                                                         b'"messages": [], "metadata": [' + b",".join([b"[]"] * 10**6)
                                                         + b"]}"),
    "estimate of a 2000x2000 progressive JPEG": lambda name: _estimate(),
    "a million headers on GET /v1/models": lambda name: Attack(name, "/v1/models", b"", method="GET",
                                                               head="X-A: b\r\n" * 1_000_000),
    "10 bodies of 64 MB held before their last byte": lambda name: Attack(
        name, "/v1/chat/completions", b'{"model": "vlm", "messages": [], "x": "' + b"a" * 63_999_960 + b'"}',
        held=10),
}


# -- load ------------------------------------------------------------------------------------------

async def _exchange(port: int, raw: bytes) -> int:
    """One request on a connection of its own: its status, or 0 when the connection broke."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0
    try:
        writer.write(raw)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await asyncio.wait_for(reader.readexactly(length), 60)
        return status
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError, IndexError):
        return 0
    finally:
        writer.close()


def _raw(attack: Attack, key: str) -> bytes:
    body = attack.next_body()
    head = (f"{attack.method} {attack.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: {attack.content_type}\r\nContent-Length: {len(body)}\r\n{attack.head}\r\n")
    return head.encode() + body


async def _attacker(port: int, key: str, attack: Attack, seconds: float, flood: bool) -> Counter:
    """The attack's answers by status: its requests sent ATTACKER_RPM a minute (each due at its
    time, on a connection of its own, up to ATTACKER_CONNECTIONS at once), or with `flood` on
    ATTACKER_CONNECTIONS connections as fast as they are answered."""
    answers: Counter = Counter()
    until, period = time.monotonic() + seconds, 60 / ATTACKER_RPM
    fixed = None if attack.vary is not None else _raw(attack, key)
    slots = asyncio.Semaphore(ATTACKER_CONNECTIONS)

    async def one():
        async with slots:
            answers[await _exchange(port, fixed or _raw(attack, key))] += 1

    if attack.held:
        return await _held(port, _raw(attack, key), attack.held, seconds)
    if flood:
        async def worker():
            while time.monotonic() < until:
                await one()

        sent = [asyncio.ensure_future(worker()) for _ in range(ATTACKER_CONNECTIONS)]
    else:
        sent, due = [], time.monotonic()
        while due < until:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            sent.append(asyncio.ensure_future(one()))
            due += period
    _, late = await asyncio.wait(sent, timeout=max(0.0, until - time.monotonic()) + GRACE_S)
    for task in late:
        task.cancel()
    if late and not flood:
        answers["unanswered"] += len(late)
    return answers


async def _held(port: int, raw: bytes, connections: int, seconds: float) -> Counter:
    """`connections` that send `raw` but its last byte and hold on for `seconds`: the answers
    that come meanwhile, by status ('held' for none)."""
    answers: Counter = Counter()

    async def hold():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            answers[0] += 1
            return
        try:
            writer.write(raw[:-1])
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), seconds)
            answers[int(head.split(b" ", 2)[1])] += 1
        except TimeoutError:
            answers["held"] += 1
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            answers[0] += 1
        finally:
            writer.close()

    await asyncio.gather(*(hold() for _ in range(connections)))
    return answers


def attacker(port: int, key: str, name: str, seconds: float, flood: bool, ready, answers) -> None:
    """The attacker's process: builds its attack, says it is ready, attacks."""
    attack = ATTACKS[name](name)
    ready.put(True)
    answers.put(dict(asyncio.run(_attacker(port, key, attack, seconds, flood))))


async def victim(port: int, key: str, seconds: float) -> list[float]:
    """Latencies (s) of text requests sent open loop at VICTIM_RATE, from when each was due."""
    body = json.dumps({"model": "text", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    latencies: list[float] = []
    period = VICTIM_CONNECTIONS / VICTIM_RATE
    start = time.monotonic() + 0.05

    async def connection(offset: float):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        due = start + offset
        try:
            while due < start + seconds:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(raw)
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                latencies.append(time.monotonic() - due)
                due += period
        finally:
            writer.close()

    await asyncio.gather(*(connection(i * period / VICTIM_CONNECTIONS) for i in range(VICTIM_CONNECTIONS)))
    return latencies


class Memory:
    """The peak resident memory of a process while sampled."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def __enter__(self):
        self.peak = status_kb("VmRSS", self.pid)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, status_kb("VmRSS", self.pid))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _phase(gateway: Gateway, key: str | None, name: str | None, seconds: float, flood: bool = False):
    """The victim's latencies over `seconds`, beside the attack `name` with `key` (None: alone);
    the attack's answers, the gateway's CPU seconds and its peak resident memory (KiB)."""
    import multiprocessing

    attacking = None
    if name is not None:
        spawn = multiprocessing.get_context("spawn")
        ready, answers = spawn.Queue(), spawn.Queue()
        attacking = spawn.Process(target=attacker, args=(gateway.port, key, name, seconds, flood, ready, answers))
        attacking.start()
        ready.get(timeout=300)  # built: what it takes to build it is not measured
    pid = gateway.server.pid
    cpu = cpu_seconds(pid)
    with Memory(pid) as memory:
        latencies = asyncio.run(victim(gateway.port, gateway.keys["victim"], seconds))
        got = Counter(answers.get(timeout=seconds + GRACE_S + 60)) if attacking is not None else Counter()
    if attacking is not None:
        attacking.join()
    return latencies, got, cpu_seconds(pid) - cpu, memory.peak


def run(gateway: Gateway, seconds: float, flood: bool, only: str | None) -> list[dict]:
    gateway.keys = gateway.start()
    rows = []
    try:
        _phase(gateway, None, None, 2)  # warm up
        for name, key in zip(ATTACKS, gateway.keys["attackers"], strict=True):
            if only and only not in name:
                continue
            base, _, _, _ = _phase(gateway, None, None, seconds)
            before_kb = status_kb("VmRSS", gateway.server.pid)
            hit, answers, cpu, peak = _phase(gateway, key, name, seconds, flood)
            rows.append({"attack": name, "base": base, "hit": hit, "answers": answers, "cpu": cpu,
                         "rss_mb": before_kb / 1024, "peak_mb": peak / 1024})
            print(_line(rows[-1]), flush=True)
    finally:
        gateway.stop()
    return rows


def _line(row: dict) -> str:
    base50, base99 = (_percentile(row["base"], q) * 1000 for q in (0.5, 0.99))
    hit50, hit99 = (_percentile(row["hit"], q) * 1000 for q in (0.5, 0.99))
    answers = " ".join(f"{status or 'broken'}:{count}" for status, count in sorted(row["answers"].items(), key=str))
    return (f"{row['attack'][:42]:42} {base50:6.1f} {hit50:7.1f} {hit50 / base50:5.2f}x {base99:7.1f} {hit99:8.1f} "
            f"{hit99 / base99:6.2f}x {row['cpu']:6.1f} {row['rss_mb']:6.0f} {row['peak_mb']:6.0f}  {answers}")


HEADER = (f"{'attack':42} {'p50 ms':>6} {'attack':>7} {'ratio':>6} {'p99 ms':>7} {'attack':>8} {'ratio':>7} "
          f"{'cpu s':>6} {'rss MB':>6} {'peak':>6}  attacker's answers")


def _worktree(ref: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="bench-attacks-before-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), ref], cwd=ROOT, check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=folder, check=True,
                   capture_output=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attacks")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--before", help="a git commit to run the same attacks against, for comparison")
    parser.add_argument("--flood", action="store_true", help="the attacker sends as fast as it is answered")
    parser.add_argument("--only", help="the attacks whose name holds this text, alone")
    args = parser.parse_args()
    upstream_port = free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "bench.fake_upstream", str(upstream_port)], cwd=ROOT)
    wait_http(f"http://127.0.0.1:{upstream_port}/health")
    pace = "as fast as answered" if args.flood else f"{ATTACKER_RPM}/min, its quota"
    print(f"victim: text, {VICTIM_RATE}/s open loop on {VICTIM_CONNECTIONS} connections; attacker: {pace}, up to "
          f"{ATTACKER_CONNECTIONS} connections; {args.seconds:g} s a phase")
    print("each row: the victim's latency without the attack (run just before) and with it; the gateway's CPU "
          "during the attack, its memory before and at its peak")
    before = None
    try:
        targets = [("this gateway", ROOT, REDIS)]
        if args.before:
            before = _worktree(args.before)
            targets.append((f"gateway at {args.before}", before, "redis://127.0.0.1:6379/10"))
        summary = []
        for label, root, redis_url in targets:
            print(f"\n{label}\n{HEADER}")
            rows = run(Gateway(root, label.split()[-1].replace(".", "_")[:12], upstream_port, redis_url), args.seconds,
                       args.flood, args.only)
            worst = max(rows, key=lambda r: _percentile(r["hit"], 0.99) / _percentile(r["base"], 0.99))
            summary.append((label, max(_percentile(r["hit"], 0.5) / _percentile(r["base"], 0.5) for r in rows),
                            _percentile(worst["hit"], 0.99) / _percentile(worst["base"], 0.99), worst["attack"],
                            max(r["peak_mb"] for r in rows)))
        print("\nworst over the attacks: p50 ratio, p99 ratio (which attack), peak memory")
        for label, p50, p99, which, peak in summary:
            print(f"  {label:30} p50 {p50:5.2f}x  p99 {p99:5.2f}x ({which})  peak {peak:.0f} MB")
    finally:
        upstream.terminate()
        if before is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
