"""What the gateway adds to a request, against calling the upstream directly and against
the LiteLLM proxy, in one run and one server process each.

    python -m bench.gateway            (needs the bench extra: pip install -e '.[bench]')

An instant fake upstream (bench/fake_upstream.py) stands behind both proxies. Our gateway
runs as in production: uvicorn (one worker), PostgreSQL, Redis (quota admission and the
usage stream), a tenant with a quota, a text tier and a vision tier (1,003,520-pixel cap)
whose engine is the fake upstream registered as an external engine. LiteLLM runs its proxy
with one worker and no database, pointed at the same upstream. On text two more proxies
stand beside them (bench/bare_proxy.py, served and connecting as the gateway does): a bare
pass-through, and the floor (the same with the gateway's two Redis round trips, made as the
gateway makes them), run right after the gateway in each round, so that what the gateway's own
work adds is each round's gateway figure less the floor's; a third, the floor with its
admission's reply awaited before forwarding, shows what running the admission beside the
engine's work saves. For text, a 1 MP
JPEG and a 12 MP JPEG (base64 data URLs; every image request a picture of its own, `stamped`),
at concurrency 1 and 32, it reports the added p50
and p99 latency over the direct call and requests per second; then, for each JPEG, what the
gateway adds to a picture sent again (what it became the first time is kept) against a new
one, in turn, and, on two more gateway processes sharing pictures through a Redis
(GATEWAY_SHARED_REPEATS_URL), a picture sent to one replica and then to the other; it also times the image
library's normalise alone on each image, and the size of the body each proxy forwarded. For the
images, a second gateway process with glibc's malloc defaults (GATEWAY_HEAP_KEEP_MB=0) shows
what keeping freed image buffers is worth, and each gateway's peak resident memory its price.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench import profile
from bench.proc import cpu_seconds, descendants, status_kb
from bench.wire import send

ROOT = Path(__file__).resolve().parent.parent
PG = "postgres://postgres@127.0.0.1:5432"
REDIS = "redis://127.0.0.1:6379/13"
PICTURES = "redis://127.0.0.1:6379/12"  # the store of pictures the replicas share, the bench's own
COUNTS = {("text", 1): 400, ("text", 32): 3000, ("1mp", 1): 60, ("1mp", 32): 240,
          ("12mp", 1): 60, ("12mp", 32): 64}
TEXT_ROUNDS = 3
# A bench's gateway is stopped once its load is over, or when the bench is interrupted, with no
# load balancer in front of it: no readiness delay, and a short grace for what is still in flight.
STOPPING_ENV = {"SHUTDOWN_DELAY_S": "0", "SHUTDOWN_GRACE_S": "5"}
STOP_MARGIN_S = 10  # past the delay and grace: what is left cancelled, its usage recorded, the exit


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def stop_servers(processes: list[subprocess.Popen], env: dict) -> None:
    """`processes`, servers started with `env`, told to stop together, then waited for as long as
    the delay and grace `env` gives them take, and a margin; one still running then is killed, so
    that the bench's clean-up (its database, its Redis db) runs all the same."""
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + int(env["SHUTDOWN_DELAY_S"]) + int(env["SHUTDOWN_GRACE_S"]) + STOP_MARGIN_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"bench: server {process.pid} did not stop within its grace; killed", file=sys.stderr, flush=True)
            process.kill()
            process.wait()


def jpeg(width: int, height: int) -> bytes:
    sys.path.insert(0, str(ROOT))
    from bench.imaging import encoded, photo

    return encoded(photo(width, height), "JPEG", quality=90)


_stamps = itertools.count()


def stamped(image: bytes) -> bytes:
    """The JPEG with an APP1 segment of its own after its start marker: a picture no request of
    the run sent before (the gateway keeps what a picture sent again became, GATEWAY_REPEATS_MB,
    keyed by what decides its pixels, comments aside; an APP1 may carry an orientation, so it
    counts), the same pixels (the same work for every proxy and engine)."""
    text = f"bench picture {next(_stamps)}".encode()
    return image[:2] + b"\xff\xe1" + (len(text) + 2).to_bytes(2, "big") + text + image[2:]


def messages(image: bytes | None) -> list:
    if image is None:
        return [{"role": "user", "content": "Say something short."}]
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    return [{"role": "user", "content": [{"type": "text", "text": "Describe."},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


class Gateway:
    """Our gateway on its own PostgreSQL database and Redis db, seeded for the bench."""

    def __init__(self, upstream_port: int, *, db: str | None = None, redis_url: str = REDIS,
                 env: dict | None = None):
        self.db = db or f"bench_gateway_{os.getpid()}"
        self.redis_url = redis_url  # flushed at the end: a Redis db of the bench's own
        self.port = free_port()
        self.env = {**{k: v for k, v in os.environ.items() if k not in ("USAGE_OUTBOX", "VAR_DIR")},
                    "DATABASE_URL": f"{PG}/{self.db}", "REDIS_URL": redis_url, "DEBUG": "false",
                    "SECRET_KEY": "bench-" + "b" * 50, "ALLOWED_HOSTS": "127.0.0.1",
                    "DJANGO_SETTINGS_MODULE": "controlplane.settings", "LOG_LEVEL": "WARNING",
                    "VAR_DIR": tempfile.mkdtemp(prefix="bench-gateway-"),
                    # The load generator is one address and one key standing for many clients:
                    # the cap on one client's bodies read at once (16) would refuse its c=32 image
                    # rounds, and one key's share of bodies and intake CPU a minute its 12 MP ones.
                    "HTTP_MAX_BODY_READS_PER_CLIENT": "0", "GATEWAY_KEY_INTAKE_MB": "0",
                    "GATEWAY_KEY_INTAKE_CPU_S": "0", **STOPPING_ENV, **(env or {})}
        self.upstream = f"http://127.0.0.1:{upstream_port}"
        self.process = self.untuned = None
        self.others: list[subprocess.Popen] = []
        self._fresh = threading.Event()

    def start(self) -> str:
        import psycopg

        with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db}"')
            conn.execute(f'CREATE DATABASE "{self.db}"')
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=self.env,
                       check=True, capture_output=True)
        os.environ.update(self.env)
        import django

        django.setup()
        key = self._seed()
        threading.Thread(target=self._keep_fresh, daemon=True).start()
        self.process = self._serve(self.port, self.env)
        return key

    def _serve(self, port: int, env: dict) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-m", "controlplane.serving", "--port", str(port), "--workers", "1",
             "--log-level", "warning"],
            cwd=ROOT, env=env)
        wait_http(f"http://127.0.0.1:{port}/login/")
        self.others.append(process)
        return process

    def start_untuned(self) -> int:
        """A second gateway process on the same data with glibc's malloc defaults
        (GATEWAY_HEAP_KEEP_MB=0), to show what keeping freed image buffers is worth."""
        port = free_port()
        self.untuned = self._serve(port, {**self.env, "GATEWAY_HEAP_KEEP_MB": "0"})
        return port

    def start_replicas(self) -> tuple[int, int]:
        """Two more gateway processes on the same data sharing pictures through a Redis
        (GATEWAY_SHARED_REPEATS_URL), as replicas behind a load balancer would."""
        env = {**self.env, "GATEWAY_SHARED_REPEATS_URL": PICTURES}
        ports = free_port(), free_port()
        for port in ports:
            self._serve(port, env)
        return ports

    def _seed(self) -> str:
        from django.utils import timezone

        from controlplane.catalog.models import ModelTier, PricePlan, PriceRate, ResolutionPolicy
        from controlplane.fleet.models import EngineInstance
        from controlplane.tenants.models import Quota, Tenant
        from controlplane.tenants.services import api_key_create

        plan = PricePlan.objects.create(name="bench")
        PriceRate.objects.create(plan=plan, effective_from=timezone.now() - timezone.timedelta(days=1),
                                 text_input_per_mtok=1, image_per_mtok=1, output_per_mtok=1)
        policy = ResolutionPolicy.objects.create(name="bench", max_pixels=1_003_520, max_input_pixels=60_000_000)
        common = {"model_id": "fake", "engine_kind": "external", "price_plan": plan,
                  "engine_settings": {"max_model_len": 32768, "max_output_tokens": 1024}}
        text = ModelTier.objects.create(name="text", family="qwen2", kind="text", **common)
        vision = ModelTier.objects.create(name="vlm", family="qwen2_5_vl", kind="vision",
                                          resolution_policy=policy, **common)
        for tier in (text, vision):
            EngineInstance.objects.create(tier=tier, external_url=self.upstream, actual_state="running",
                                          healthy=True, last_health_at=timezone.now())
        tenant = Tenant.objects.create(name="bench")
        Quota.objects.create(tenant=tenant, period="month", image_tokens=10**12, total_tokens=10**12,
                             requests_per_minute=10**7)
        return api_key_create(tenant=tenant).secret

    def _keep_fresh(self) -> None:
        """Stand in for the control plane's health checks of the external engine."""
        from django.db import connection
        from django.utils import timezone

        from controlplane.fleet.models import EngineInstance

        while not self._fresh.wait(5):
            EngineInstance.objects.update(last_health_at=timezone.now())
            connection.close()

    def stop(self) -> None:
        self._fresh.set()
        stop_servers(self.others, self.env)
        import redis

        redis.Redis.from_url(self.redis_url).flushdb()
        redis.Redis.from_url(PICTURES).flushdb()
        from django.db import connections

        connections.close_all()
        import psycopg

        with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')
        shutil.rmtree(self.env["VAR_DIR"], ignore_errors=True)


def start_litellm(upstream_port: int, folder: Path | None = None) -> tuple[subprocess.Popen, int, str]:
    """LiteLLM's proxy, its config written in `folder` (the caller's to remove) or a new temporary one."""
    port = free_port()
    folder = folder or Path(tempfile.mkdtemp(prefix="bench-litellm-"))
    config = folder / "config.yaml"
    config.write_text(
        "model_list:\n"
        + "".join(f"  - model_name: {name}\n    litellm_params:\n      model: openai/{name}\n"
                  f"      api_base: http://127.0.0.1:{upstream_port}/v1\n      api_key: fake\n" for name in ("text", "vlm"))
        + "general_settings:\n  master_key: sk-bench-litellm\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update({"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"})
    binary = shutil.which("litellm", path=str(Path(sys.executable).parent)) or "litellm"
    process = subprocess.Popen([binary, "--config", str(config), "--port", str(port), "--num_workers", "1"],
                               cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/health/liveliness", timeout=120)
    return process, port, "sk-bench-litellm"


async def load(url: str, key: str, model: str, image: bytes | None, concurrency: int, count: int, *,
               again: bool = False):
    """Each image request a picture of its own (`stamped`), or with `again` the same one."""
    def body() -> bytes:
        sent = image if image is None or again else stamped(image)
        return json.dumps({"model": model, "max_tokens": 8, "messages": messages(sent)}).encode()
    headers = {"Authorization": f"Bearer {key}"}
    await send(url, headers, [body()], 1)  # warm up caches (with `again`: the picture to be sent again)
    bodies = [body() for _ in range(count)] if image is not None and not again else [body()] * count
    latencies, elapsed = await send(url, headers, bodies, concurrency)
    latencies.sort()
    return {"p50": statistics.median(latencies), "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "rps": len(latencies) / elapsed}


async def shared_again(replicas: list[str], key: str, image: bytes, count: int) -> float:
    """The p50 of `count` pictures, each new, sent to the first replica and then, once it has
    had time to share it, to the second (at concurrency 1)."""
    headers = {"Authorization": f"Bearer {key}"}
    bodies = [json.dumps({"model": "vlm", "max_tokens": 8, "messages": messages(stamped(image))}).encode()
              for _ in range(count)]
    await send(replicas[0], headers, bodies, 1)
    await asyncio.sleep(0.5)  # the first replica writes what it made after its answers
    latencies, _ = await send(replicas[1], headers, bodies, 1)
    return statistics.median(latencies)


def image_steps(image: bytes, repeats: int = 10) -> dict[str, float]:
    """Seconds each step of the gateway's work on an image takes alone (the median of
    `repeats`): the base64 data URL decoded, the JPEG decoded at the DCT scale the policy's cap
    allows (the floor: the pixels must be decoded), resampled, re-encoded and fingerprinted;
    and normalise whole, and with the base64 intake, as the gateway runs them; for an image the
    policy sends as it came, its check and the entropy decoding in it. And the request's body,
    from its bytes to the image's, read as the gateway reads it (a large one with its base64
    decoded where it lies: controlplane/gateway/body.py) and parsed whole before its base64."""
    import msgspec
    from PIL import Image

    from controlplane.gateway.body import read_body
    from controlplane.imaging.budget import DecodeBudget
    from controlplane.imaging.decode import as_image, decode_jpeg
    from controlplane.imaging.fingerprint import fingerprint
    from controlplane.imaging.intake import image_source_bytes
    from controlplane.imaging.policy import (
        Policy,
        _check_sent,
        _dct_scale,
        _Documents,
        normalise,
        plan_tiles,
    )
    from controlplane.imaging.resample import bicubic

    policy = Policy(max_pixels=1_003_520, max_input_pixels=60_000_000)
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    opened = Image.open(io.BytesIO(image))
    plan = plan_tiles(opened.width, opened.height, policy, policy.max_pixels)
    target = (plan.width, plan.height)
    raw = decode_jpeg(image, opened, _dct_scale(opened.size, target))
    decoded = as_image(raw)
    resized = bicubic(decoded, target, pixels=raw) if decoded.size != target else decoded

    def encode():
        out = io.BytesIO()
        resized.save(out, "JPEG", quality=85)

    body = json.dumps({"model": "vlm", "max_tokens": 8, "messages": messages(image)}).encode()

    def image_of(read):
        return image_source_bytes(read(body)["messages"][0]["content"][1]["image_url"]["url"], max_bytes=10**8,
                                  fetch=None)

    steps = {
        "body to image bytes, as read": lambda: image_of(read_body),
        "parsed whole, then base64": lambda: image_of(msgspec.json.decode),
        "base64": lambda: image_source_bytes(url, max_bytes=10**8, fetch=None),
        "decode (floor)": lambda: decode_jpeg(image, opened, _dct_scale(opened.size, target)),
        "resample": lambda: bicubic(decoded, target, pixels=raw) if decoded.size != target else None,
        "encode": encode,
        "fingerprint": lambda: fingerprint(resized),
        "normalise": lambda: normalise(image, policy),
        "base64 + normalise": lambda: normalise(image_source_bytes(url, max_bytes=10**8, fetch=None), policy),
    }
    if target == opened.size:
        # Sent as it came: its check (its search for an embedded document, every scan decoded
        # at a quarter of its size, grey, and fingerprinted), and the part of it no check can
        # skip: the entropy decoding of every scan, here at an eighth, where libjpeg-turbo
        # transforms nothing but the DC terms.
        steps["check"] = lambda: _check_sent(image, opened, None, _Documents(image), DecodeBudget())
        steps["entropy decoding alone"] = lambda: decode_jpeg(image, opened, 8, grey=True)
    timings = {}
    for name, step in steps.items():
        step()
        runs = []
        for _ in range(repeats):
            started = time.perf_counter()
            step()
            runs.append(time.perf_counter() - started)
        timings[name] = statistics.median(runs)
    return timings


def decode_floor(image: bytes) -> Callable[[], object]:
    """The floor of an image's work: the JPEG decoded at the DCT scale the policy's cap allows,
    by simplejpeg (libjpeg-turbo), the fastest whole-picture decoder at hand."""
    from PIL import Image

    from controlplane.imaging.decode import decode_jpeg
    from controlplane.imaging.policy import Policy, _dct_scale, plan_tiles

    policy = Policy(max_pixels=1_003_520, max_input_pixels=60_000_000)
    opened = Image.open(io.BytesIO(image))
    plan = plan_tiles(opened.width, opened.height, policy, policy.max_pixels)
    scale = _dct_scale(opened.size, (plan.width, plan.height))
    return lambda: decode_jpeg(image, opened, scale)


def added_over_floor(gateway_url: str, key: str, direct_url: str, image: bytes, *, rounds: int = 6,
                     count: int = 20) -> list[tuple[float, float]]:
    """(the gateway's added p50, the decode alone's median) in seconds, for each of `rounds`
    taken in turn at concurrency 1: `count` requests direct, `count` through the gateway, and
    the decode alone `count` times, so that each ratio is taken within the same minute (this
    machine's speed drifts by tens of per cent between minutes)."""
    floor = decode_floor(image)
    figures = []
    for _ in range(rounds):
        direct = asyncio.run(load(direct_url, "fake", "vlm", image, 1, count))
        through = asyncio.run(load(gateway_url, key, "vlm", image, 1, count))
        floor()
        decodes = []
        for _ in range(count):
            started = time.perf_counter()
            floor()
            decodes.append(time.perf_counter() - started)
        figures.append((through["p50"] - direct["p50"], statistics.median(decodes)))
    return figures


def _each_round(more: list[float], less: list[float]) -> str:
    """The median of the rounds' differences (seconds), and each round's, in milliseconds."""
    differences = [a - b for a, b in zip(more, less, strict=True)]
    return f"{1000 * statistics.median(differences):.2f} ms (" + ", ".join(f"{1000 * d:.2f}" for d in differences) + ")"


def main() -> None:
    upstream_port = free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "bench.fake_upstream", str(upstream_port)], cwd=ROOT)
    wait_http(f"http://127.0.0.1:{upstream_port}/health")
    # The fake upstream reports no image count, which the gateway warns of on every image
    # request (an engine that counted otherwise): errors only.
    gateway = Gateway(upstream_port, env={"LOG_LEVEL": "ERROR"})
    litellm, floors = None, []
    try:
        key = gateway.start()
        untuned_port = gateway.start_untuned()
        replicas = [f"http://127.0.0.1:{port}/v1/chat/completions" for port in gateway.start_replicas()]
        litellm, litellm_port, litellm_key = start_litellm(upstream_port)
        bare_port, floor_port, awaited_port = free_port(), free_port(), free_port()
        for port, redis_url in ((bare_port, ()), (floor_port, (REDIS,)),
                                (awaited_port, (REDIS, "--admission-awaited"))):
            floors.append(subprocess.Popen([sys.executable, "-m", "bench.bare_proxy", str(port),
                                            f"http://127.0.0.1:{upstream_port}", *redis_url], cwd=ROOT))
            wait_http(f"http://127.0.0.1:{port}/health")
        images = {"text": None, "1mp": jpeg(1155, 866), "12mp": jpeg(4000, 3000)}
        targets = {
            "direct": (f"http://127.0.0.1:{upstream_port}/v1/chat/completions", "fake"),
            "gateway": (f"http://127.0.0.1:{gateway.port}/v1/chat/completions", key),
            # The floor and the bare proxy right after the gateway: the machine drifts by more
            # than they differ over minutes, and each round's differences are taken.
            "floor": (f"http://127.0.0.1:{floor_port}/v1/chat/completions", "fake"),
            # The floor as the gateway was before its admission ran beside the engine, right
            # after the floor, the two taken round by round.
            "awaited": (f"http://127.0.0.1:{awaited_port}/v1/chat/completions", "fake"),
            "bare": (f"http://127.0.0.1:{bare_port}/v1/chat/completions", "fake"),
            "litellm": (f"http://127.0.0.1:{litellm_port}/v1/chat/completions", litellm_key),
            "gw-nokeep": (f"http://127.0.0.1:{untuned_port}/v1/chat/completions", key),
        }
        processes = {"direct": upstream.pid, "gateway": gateway.process.pid, "litellm": litellm.pid,
                     "gw-nokeep": gateway.untuned.pid, "bare": floors[0].pid, "floor": floors[1].pid,
                     "awaited": floors[2].pid}
        print(f"{'payload':8} {'conc':>4} {'target':8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} "
              f"{'req/s':>8} {'fwd body':>10} {'cpu ms/req':>10}")
        added_p50, rates = {}, {}
        for (payload, concurrency), count in COUNTS.items():
            image = images[payload]
            model = "text" if image is None else "vlm"
            # Text takes seconds a round, and its added p50 (about a millisecond) moves by more
            # than itself between runs on this machine: three rounds, the median reported.
            for _round in range(TEXT_ROUNDS if image is None else 1):
                base = None
                for name, (url, secret) in targets.items():
                    if name == "gw-nokeep" and image is None:
                        continue  # the malloc tuning matters for image buffers only
                    if name in ("floor", "awaited") and image is not None:
                        continue  # the floor of the text path: images are measured against the decode
                    if name == "bare" and payload not in ("text", "1mp"):
                        continue  # a bare proxy carrying a photo as it came: what its bytes cost a hop
                    before = httpx.get(f"http://127.0.0.1:{upstream_port}/stats").json()
                    tree = descendants(processes[name])
                    cpu = sum(map(cpu_seconds, tree))
                    result = asyncio.run(load(url, secret, model, image, concurrency, count))
                    cpu = (sum(map(cpu_seconds, tree)) - cpu) / (count + 1)  # the process's own CPU per request
                    after = httpx.get(f"http://127.0.0.1:{upstream_port}/stats").json()
                    forwarded = (after["body_bytes"] - before["body_bytes"]) / max(1, after["requests"] - before["requests"])
                    if name == "direct":
                        base = result
                    if name != "direct":
                        added_p50.setdefault((name, payload, concurrency), []).append(result["p50"] - base["p50"])
                        rates.setdefault((name, payload, concurrency), []).append(result["rps"])
                    added = "" if name == "direct" else (f"{1000 * (result['p50'] - base['p50']):8.2f} "
                                                         f"{1000 * (result['p99'] - base['p99']):8.2f}")
                    print(f"{payload:8} {concurrency:4d} {name:8} {1000 * result['p50']:8.2f} {1000 * result['p99']:8.2f} "
                          f"{added or ' ' * 17:>17} {result['rps']:8.1f} {forwarded / 1024:8.1f}KB {1000 * cpu:10.2f}")
        for concurrency in (1, 32):
            rounds = added_p50[("gateway", "text", concurrency)]
            print(f"text, concurrency {concurrency}: the gateway's added p50, median of {len(rounds)} rounds "
                  f"{1000 * statistics.median(rounds):.2f} ms ("
                  + ", ".join(f"{1000 * added:.2f}" for added in rounds) + ")")
            # The same hops with none of the work: what is left is what the gateway's work costs.
            added = {name: added_p50[(name, "text", concurrency)]
                     for name in ("gateway", "floor", "awaited", "bare", "litellm")}
            rate = {name: statistics.median(rates[(name, "text", concurrency)]) for name in added}
            print(f"text, concurrency {concurrency}, medians of the rounds: added p50 and requests per second: "
                  + ", ".join(f"{name} {1000 * statistics.median(added[name]):.2f} ms {rate[name]:.0f}/s"
                              for name in added))
            print(f"text, concurrency {concurrency}, within each round: the gateway's own work (gateway less "
                  f"floor) {_each_round(added['gateway'], added['floor'])}, the two Redis round trips (floor "
                  f"less bare) {_each_round(added['floor'], added['bare'])}, the admission's reply awaited "
                  f"before forwarding (awaited less floor) {_each_round(added['awaited'], added['floor'])}")
        if profile.available():
            # Where the gateway's CPU goes on text at concurrency 32, sampled while loaded.
            sampling = profile.record(gateway.process.pid, seconds=8)
            time.sleep(0.5)
            asyncio.run(load(targets["gateway"][0], key, "text", None, 32, COUNTS[("text", 32)] * 2))
            sampling.wait()
            print("where the gateway's CPU goes, text at concurrency 32 (py-spy samples): "
                  + ", ".join(f"{part} {share:.0%}" for part, share in profile.summarise(sampling.output)))
        for payload in ("1mp", "12mp"):
            sent = len(base64.b64encode(images[payload]))
            steps = image_steps(images[payload])
            print(f"{payload} ({sent / 1024:.0f} KB of base64), each step alone: "
                  + ", ".join(f"{name} {1000 * seconds:.1f} ms" for name, seconds in steps.items()))
            gateway_added = statistics.median(added_p50[("gateway", payload, 1)])
            if "check" in steps:  # sent as it came: target 2 asks that it cost no more than validating it
                text = statistics.median(added_p50[("gateway", "text", 1)])
                bare = statistics.median(added_p50[("bare", payload, 1)])
                bare_text = statistics.median(added_p50[("bare", "text", 1)])
                print(f"{payload}: the gateway's added p50 at concurrency 1 is {1000 * gateway_added:.1f} ms, "
                      f"{1000 * (gateway_added - text):.1f} beyond the text overhead ({1000 * text:.2f}), where "
                      f"validating it alone (base64 and normalise, its check included) takes "
                      f"{1000 * steps['base64 + normalise']:.1f}; a bare proxy carrying the same body adds "
                      f"{1000 * bare:.2f} ms, {1000 * (bare - bare_text):.2f} beyond its own on text "
                      f"(what the body's {sent / 1024:.0f} KB cost a hop, whatever it does)")
            else:
                print(f"{payload}: the gateway's added p50 at concurrency 1 is {1000 * gateway_added:.1f} ms, "
                      f"{gateway_added / steps['decode (floor)']:.2f}x the decode alone")
            if payload == "12mp":
                rounds = added_over_floor(targets["gateway"][0], key, targets["direct"][0], images[payload])
                ratios = [added / floor for added, floor in rounds]
                print(f"{payload}, concurrency 1, rounds of 20 requests direct, 20 through the gateway and 20 "
                      f"decodes alone taken in turn: the gateway's added p50 over the decode alone, median "
                      f"{statistics.median(ratios):.2f}x ("
                      + ", ".join(f"{1000 * added:.1f}/{1000 * floor:.1f} ms" for added, floor in rounds) + ")")
        for payload in ("1mp", "12mp"):
            # A picture sent again (a chat resends its images on every turn): what it became the
            # first time is taken, against a new picture each request, in turn, three rounds.
            new, again = [], []
            for _round in range(3):
                direct = asyncio.run(load(targets["direct"][0], "fake", "vlm", images[payload], 1, 20))
                for added, repeat in ((new, False), (again, True)):
                    through = asyncio.run(load(targets["gateway"][0], key, "vlm", images[payload], 1, 20, again=repeat))
                    added.append(through["p50"] - direct["p50"])
            print(f"{payload}, concurrency 1, the gateway's added p50 for a picture sent again "
                  f"{1000 * statistics.median(again):.1f} ms, for a new one {1000 * statistics.median(new):.1f} ms "
                  f"(medians of 3 rounds of 20 each: " + ", ".join(
                      f"{1000 * a:.1f}/{1000 * n:.1f}" for a, n in zip(again, new, strict=True)) + ")")
        for payload in ("1mp", "12mp"):
            # Sent again, but to another replica: found in the store the replicas share.
            new, elsewhere, here = [], [], []
            for _round in range(3):
                direct = asyncio.run(load(targets["direct"][0], "fake", "vlm", images[payload], 1, 20))
                fresh = asyncio.run(load(replicas[1], key, "vlm", images[payload], 1, 20))
                moved = asyncio.run(shared_again(replicas, key, images[payload], 20))
                again = asyncio.run(load(replicas[1], key, "vlm", images[payload], 1, 20, again=True))
                new.append(fresh["p50"] - direct["p50"])
                elsewhere.append(moved - direct["p50"])
                here.append(again["p50"] - direct["p50"])
            print(f"{payload}, concurrency 1, two replicas sharing pictures: the gateway's added p50 for a picture "
                  f"sent before to the other replica {1000 * statistics.median(elsewhere):.1f} ms, to the same "
                  f"replica {1000 * statistics.median(here):.1f}, a new one {1000 * statistics.median(new):.1f} "
                  f"(medians of 3 rounds of 20 each: " + ", ".join(
                      f"{1000 * e:.1f}/{1000 * h:.1f}/{1000 * n:.1f}"
                      for e, h, n in zip(elsewhere, here, new, strict=True)) + ")")
        for name, process in (("gateway", gateway.process), ("gw-nokeep", gateway.untuned)):
            print(f"{name} peak resident memory: {status_kb('VmHWM', process.pid) / 1024:.0f} MB")
    finally:
        if litellm is not None:
            litellm.terminate()
        for process in floors:
            process.terminate()
        gateway.stop()
        upstream.terminate()


if __name__ == "__main__":
    main()
