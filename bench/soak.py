"""A soak: mixed text and image traffic through the gateway for an hour (by default), and what
every process and store holds over time, so a leak shows as a slope.

    python -m bench.soak [--minutes 60] [--clients 8] [--sample-s 10] [--json PATH]

Our gateway runs as bench/gateway runs it (uvicorn, one worker, its own PostgreSQL database
and Redis db, the usage stream ingested every 2 s as beat does), its tiers on the simulator
(one process serving text and vision as vLLM would answer them). `--clients` clients loop:
a text question; a new picture (a JPEG of its own, so nothing is cached); and a chat of five
turns that resends its picture with the history each turn, as chat clients do (the gateway
keeps what a picture became). Every `--sample-s` seconds it records, per process (the gateway,
the engine): resident memory, open file descriptors and threads; of Redis: its memory and the
keys of the gateway's db; of PostgreSQL: the connections to the bench's database. After the
warm-up (the first fifth of the run) each series gets a least-squares slope, per hour: one
that grows past a tolerance over the run is flagged. The floor to compare with is each
series' own value after warm-up: a process that holds what it needs stays flat.

The soak's own work failing (a sample, an ingest, a client's loop) is logged, counted and
carried on from; a run with any such failure says so under its figures and exits with 1:
its figures have gaps (and usage left uningested grows Redis like a leak would).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.gateway import ROOT, Gateway, free_port, jpeg, messages, stamped, wait_http

# What counts as growth over the run after warm-up, per series: at least this much and this
# share of its median (a few file descriptors come and go with connections).
TOLERANCE = {"rss_mb": (8.0, 0.05), "fds": (8, 0.10), "threads": (4, 0.10), "redis_mb": (4.0, 0.10),
             "redis_keys": (50, 0.10), "db_connections": (3, 0.25)}


@dataclass
class Failures:
    """What failed of the soak's own work, counted by where; the first failure of each kind is
    logged with its traceback (a failure that repeats would flood the log), the rest counted."""
    counts: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def note(self, where: str, exc: Exception) -> None:
        with self.lock:
            self.counts[where] += 1
            first = self.counts[where] == 1
        if first:
            print(f"soak: {where} failed (counted, carrying on): "
                  f"{''.join(traceback.format_exception(exc)).rstrip()}", file=sys.stderr, flush=True)

    def attempt(self, where: str, work: Callable[[], object]) -> None:
        """`work` done, or its failure noted: the thread doing it goes on."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - noted, and reported with the run's figures
            self.note(where, exc)


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, value)

    def after(self, warm: float) -> list[tuple[float, float]]:
        return [(t, v) for t, v in self.points if t >= warm]

    def slope_per_hour(self, warm: float) -> float | None:
        points = self.after(warm)
        if len(points) < 3:
            return None
        times, values = zip(*points, strict=True)
        return statistics.linear_regression(times, values).slope * 3600

    def verdict(self, warm: float, duration: float) -> tuple[str, float | None]:
        slope = self.slope_per_hour(warm)
        if slope is None:
            return "too short", None
        kind = self.name.split(":")[-1]
        least, share = TOLERANCE[kind]
        grown = slope * (duration - warm) / 3600
        median = statistics.median(v for _, v in self.after(warm))
        return ("GROWS" if grown > max(least, share * median) else "flat"), grown


def _proc(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Sampler:
    def __init__(self, processes: dict[str, int], redis_url: str, database: str):
        import redis

        self.processes, self.database = processes, database
        self.redis = redis.Redis.from_url(redis_url)
        self.series: dict[str, Series] = {}
        self.started = time.monotonic()

    def _add(self, name: str, value: float) -> None:
        self.series.setdefault(name, Series(name)).points.append((time.monotonic() - self.started, value))

    def sample(self) -> None:
        for name, pid in self.processes.items():
            for kind, value in _proc(pid).items():
                self._add(f"{name}:{kind}", value)
        self._add("redis:redis_mb", self.redis.info("memory")["used_memory"] / 2**20)
        self._add("redis:redis_keys", self.redis.dbsize())
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [self.database])
            self._add("postgresql:db_connections", cursor.fetchone()[0])
        connection.close()


async def _client(url: str, key: str, until: float, seed: int, outcomes: dict, failures: Failures) -> None:
    rng = random.Random(seed)
    picture = jpeg(800, 600)
    async with httpx.AsyncClient(timeout=120, headers={"authorization": f"Bearer {key}"}) as client:
        while time.monotonic() < until:
            kind = rng.choice(("text", "picture", "chat"))
            try:
                if kind == "text":
                    await _ask(client, url, "text", messages(None), outcomes)
                elif kind == "picture":
                    await _ask(client, url, "vlm", messages(stamped(picture)), outcomes)
                else:  # a chat resending its picture with the history, turn after turn
                    history = messages(stamped(picture))
                    for _ in range(5):
                        answer = await _ask(client, url, "vlm", history, outcomes)
                        history = [*history, {"role": "assistant", "content": answer or "ok"},
                                   {"role": "user", "content": "And then?"}]
            except httpx.HTTPError as exc:  # the gateway's answer: part of what the soak measures
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
            except Exception as exc:  # noqa: BLE001 - the client's own: noted, and the client goes on
                failures.note("a client", exc)
                await asyncio.sleep(1)  # one that fails every time does not spin


async def _ask(client, url, model, chat, outcomes) -> str:
    response = await client.post(url, json={"model": model, "max_tokens": 8, "messages": chat})
    outcomes[response.status_code] = outcomes.get(response.status_code, 0) + 1
    if response.status_code != 200:
        return ""
    return response.json()["choices"][0]["message"]["content"]


def _ingest_every(seconds: float, stop: threading.Event, failures: Failures) -> None:
    """As beat runs metering.usage_ingest: the usage stream moved into the database."""
    from django.db import connection

    from controlplane.metering.outbox import usage_ingest

    def ingest() -> None:
        try:
            while usage_ingest():
                pass
        finally:
            connection.close()  # a broken connection is not reused by the next round

    while not stop.wait(seconds):
        failures.attempt("ingesting usage", ingest)


def run(minutes: float, clients: int, sample_s: float, json_path: Path | None) -> dict:
    engine_port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "workers.engines.simulator", "soak", "--family", "qwen2_5_vl",
                               "--served-model-name", "vlm", "--port", str(engine_port),
                               "--limit-mm-per-prompt", '{"image": 8}'], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gateway = Gateway(engine_port)
    stop, failures = threading.Event(), Failures()
    try:
        wait_http(f"http://127.0.0.1:{engine_port}/health")
        key = gateway.start()  # Django is set up from here on
        from controlplane.fleet.models import EngineInstance

        EngineInstance.objects.update(served_model_name="vlm")  # one simulator serves both tiers, as vlm
        threading.Thread(target=_ingest_every, args=(2.0, stop, failures), daemon=True).start()
        url = f"http://127.0.0.1:{gateway.port}/v1/chat/completions"
        sampler = Sampler({"gateway": gateway.process.pid, "engine": engine.pid}, gateway.redis_url, gateway.db)
        duration = minutes * 60
        until = time.monotonic() + duration
        outcomes: dict = {}

        def sample_until() -> None:
            while time.monotonic() < until + 0.1:
                failures.attempt("sampling", sampler.sample)
                time.sleep(sample_s)

        sampling = threading.Thread(target=sample_until, daemon=True)
        sampling.start()

        async def load():
            await asyncio.gather(*(_client(url, key, until, n, outcomes, failures) for n in range(clients)))

        print(f"soak: {minutes:g} min, {clients} clients, a sample every {sample_s:g} s", flush=True)
        asyncio.run(load())
        sampling.join()
        warm = duration / 5
        rows = []
        print(f"\nanswers: {dict(sorted(outcomes.items(), key=str))}")
        print(f"{'series':28} {'after warm-up':>14} {'at the end':>11} {'slope/hour':>11} {'over the run':>13}  verdict")
        for name, series in sorted(sampler.series.items()):
            verdict, grown = series.verdict(warm, duration)
            points = series.after(warm)
            first, last = (points[0][1], points[-1][1]) if points else (None, None)
            slope = series.slope_per_hour(warm)
            print(f"{name:28} {first if first is not None else float('nan'):14.1f} {last or 0:11.1f} "
                  f"{slope or 0:11.2f} {grown or 0:13.2f}  {verdict}", flush=True)
            rows.append({"series": name, "after_warm_up": first, "at_end": last, "slope_per_hour": slope,
                         "grown": grown, "verdict": verdict, "points": series.points})
        result = {"minutes": minutes, "clients": clients, "answers": {str(k): v for k, v in outcomes.items()},
                  "series": rows, "flagged": [r["series"] for r in rows if r["verdict"] == "GROWS"],
                  "failures": dict(failures.counts)}
        print(f"\nflagged: {', '.join(result['flagged']) or 'none'}")
        if failures.counts:
            print("INCOMPLETE: the soak's own work failed (" +
                  ", ".join(f"{where}: {n} times" for where, n in sorted(failures.counts.items())) +
                  "); the figures above have gaps", flush=True)
        if json_path is not None:
            json_path.write_text(json.dumps(result, indent=1))
        return result
    finally:
        stop.set()
        gateway.stop()
        engine.terminate()
        engine.wait(timeout=20)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run's cleanup
    result = run(args.minutes, args.clients, args.sample_s, args.json)
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
