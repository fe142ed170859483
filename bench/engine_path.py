"""The large-image path end to end: our gateway, LiteLLM's proxy, a bare pass-through proxy and
no proxy at all in front of one real vLLM CPU engine, with the CPU each process spends per request.

    python -m bench.engine_path            (--quick for a short run; needs the bench extra)

One vLLM CPU engine (workers/engines/cpu) serves the tiny random-weight Qwen2.5-VL, started
as the fleet starts it: the command line and environment of the tier's launch spec (the
policy's pixel cap passed to vLLM as --mm-processor-kwargs, --limit-mm-per-prompt, the CPU
build's niceness), the tier's tokenizer published for the gateway. Our gateway runs as
bench/gateway runs it (uvicorn, one worker, its own PostgreSQL database and Redis db) with a
vision tier on a 1,003,520-pixel policy whose engine is that vLLM, registered by URL;
LiteLLM's proxy (one worker, no database) points at the same vLLM, and so does a bare
pass-through proxy (bench/bare_proxy.py: served and connecting as the gateway is, doing nothing
else), the floor under any proxy: what carrying a body through a Python hop costs on its own.

For text, a 1 MP and a 12 MP JPEG as base64 data URLs (every request its own picture, made
before the timing, so neither vLLM's multimodal cache nor its prefix cache can hit), at
concurrency 1 and 4, max_tokens 2, the paths taking turns (at concurrency 1 a request each,
at 4 two rounds each, the order rotating: the machine may be shared): p50 and p90
end-to-end latency, requests per second, and CPU seconds per request (utime + stime from
/proc before and after each turn) of the gateway, of LiteLLM's proxy, of vLLM's API server
(where vLLM decodes and resizes images) and of its engine core (with the worker process the
CPU build runs the model in). "outside" is the CPU spent outside the engine core: the
proxy's plus the API server's. Last, "again": one 1 MP picture sent by every request, as a
chat resends its images on each turn (the gateway keeps what it became; vLLM's caches hit on
every path alike). Then the ratios issue 16 sets targets for, the 1 MP one against the
gateway's text overhead in the same run, also paired round by round at concurrency 1 (each
round sends one request down every path back to back) with a bootstrap interval.

With --pin, the engine core (with its worker, where the model runs) has CPU 0 to itself and
every other process (vLLM's API server, the gateway, LiteLLM, this client) shares CPU 1: the
shape of a GPU host, where the model's work is not done on the cores a proxy runs on. vLLM's
CPU build binds its compute threads to CPU 0 and reserves CPU 1 for others on this machine
anyway (VLLM_CPU_OMP_THREADS_BIND=auto); --pin binds the rest of the processes to match.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.gateway import Gateway, free_port, image_steps, messages, start_litellm, wait_http
from bench.proc import children, command_line, cpu_seconds, descendants
from bench.wire import send

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "bench_engine_path"
REDIS = "redis://127.0.0.1:6379/11"
TIER = "vlm"  # bench/gateway's vision tier; also the name vLLM serves and LiteLLM routes
SIZES = {"text": None, "1mp": (1155, 866), "12mp": (4000, 3000), "again": (1155, 866)}
CONCURRENCY = (1, 4)
COUNTS = {("text", 1): 60, ("text", 4): 120, ("1mp", 1): 60, ("1mp", 4): 64, ("12mp", 1): 20, ("12mp", 4): 40,
          ("again", 1): 40}
QUICK = {("text", 1): 8, ("text", 4): 8, ("1mp", 1): 4, ("1mp", 4): 8, ("12mp", 1): 3, ("12mp", 4): 4,
         ("again", 1): 4}
MAX_TOKENS = 2
ROUNDS = 2
PROXIES = ("gateway", "litellm", "bare")  # the paths with a process of their own in front of vLLM
# Carried in the engine's environment (as the fleet tags its engines), so that cleanup finds it
# even when interrupted between its start and the return of its pid.
MARKER = f"bench-engine-path/{os.getpid()}"


class EngineGateway(Gateway):
    """bench/gateway's world, its vision tier made the tier of a vLLM CPU engine."""

    def __init__(self, engine_port: int, model: Path, vllm_python: Path):
        super().__init__(engine_port, db=DATABASE, redis_url=REDIS, env={"VLLM_PYTHON": str(vllm_python)})
        self.model = model

    def _seed(self) -> str:
        from controlplane.catalog.models import ModelTier
        from controlplane.demo import CPU_ENGINE_SETTINGS

        key = super()._seed()
        ModelTier.objects.filter(name=TIER).update(engine_kind="vllm", model_id=str(self.model),
                                                   engine_settings=CPU_ENGINE_SETTINGS)
        ModelTier.objects.exclude(name=TIER).update(enabled=False)
        return key


@dataclass
class Engine:
    pid: int  # vLLM's API server, the leader of its own process group
    log: Path
    core: int | None = None  # its engine core, found once it serves


def engine_start(port: int, log_dir: Path) -> Engine:
    """vLLM as the fleet launches the tier (workers/supervision/engine.py's engine_launch)."""
    from controlplane.catalog.models import ModelTier
    from controlplane.catalog.tokenizers import tier_tokenizer_publish
    from workers.engines import process
    from workers.engines.launch import build_command
    from workers.supervision.engine import tier_launch_spec
    from workers.supervision.node import detect_engine_packages

    tier = ModelTier.objects.select_related("resolution_policy").get(name=TIER)
    spec = tier_launch_spec(tier, port=port, transformers_version=detect_engine_packages()["transformers"])
    argv, env = build_command(spec)
    tier_tokenizer_publish(tier=tier, source="bench")
    print("engine:", " ".join(argv[1:]), f"(nice {spec.nice})", flush=True)
    log = log_dir / "engine.log"
    return Engine(process.spawn(argv, env, log_path=log, instance_id=MARKER, cwd=str(ROOT), nice=spec.nice), log)


def engine_stop() -> None:
    from workers.engines import process

    process.stop_marked(MARKER)  # its process group: the API server and the engine core


def clean_up(*steps) -> None:
    """Run each cleanup step (None: nothing to clean), whatever the ones before it raised."""
    for step in steps:
        if step:
            try:
                step()
            except Exception as exc:  # clean up the rest whatever one step says
                print(f"cleanup: {exc!r}", file=sys.stderr)


def engine_wait(engine: Engine, port: int, timeout: float = 900) -> None:
    from workers.engines import process

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.is_alive(engine.pid):
            raise RuntimeError(f"vLLM exited while starting:\n{engine.log.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                engine.core = engine_core(engine.pid)
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"vLLM did not serve within {timeout:.0f}s; log: {engine.log}")


def engine_core(api_server: int) -> int:
    """The child vLLM names VLLM::EngineCore (its process title)."""
    for pid in descendants(api_server)[1:]:
        if "EngineCore" in command_line(pid):
            return pid
    raise RuntimeError(f"no engine core under vLLM's API server {api_server}: children {children(api_server)}")


class Pictures:
    """Photo-like JPEGs, each one distinct: bench.imaging's photo, shifted, tinted along a
    gradient and grained differently per seed (every pixel changes, so every hash does)."""

    def __init__(self):
        self._bases: dict[tuple[int, int], object] = {}
        self._seed = 0
        self._again: dict[tuple[int, int], bytes] = {}

    def again(self, width: int, height: int) -> bytes:
        """One picture of this size, the same each time: a chat's image, resent on every turn."""
        if (width, height) not in self._again:
            self._again[width, height] = self.next(width, height)
        return self._again[width, height]

    def next(self, width: int, height: int) -> bytes:
        from PIL import Image, ImageChops

        from bench.imaging import encoded, photo

        if (width, height) not in self._bases:
            self._bases[width, height] = photo(width, height)
        self._seed += 1
        rng = random.Random(self._seed)
        small = (max(1, width // 8), max(1, height // 8))

        def colour():
            return tuple(rng.randrange(256) for _ in range(3))

        gradient = Image.linear_gradient("L").rotate(rng.randrange(360)).resize(small)
        tint = Image.composite(Image.new("RGB", small, colour()), Image.new("RGB", small, colour()), gradient)
        image = ImageChops.offset(self._bases[width, height], rng.randrange(width), rng.randrange(height))
        image = Image.blend(image, tint.resize((width, height), Image.Resampling.BILINEAR), 0.25)
        grain = Image.effect_noise((width // 2, height // 2), 40).resize((width, height))
        image = Image.blend(image, Image.merge("RGB", (grain, grain, grain)), 0.06)
        return encoded(image, "JPEG", quality=90)


def bodies(pictures: Pictures, size: str, count: int) -> list[bytes]:
    """Request bodies ready to send (JSON-encoded here, so the client spends little while timed)."""
    out = []
    for _ in range(count):
        make = pictures.again if size == "again" else pictures.next
        chat = messages(None if SIZES[size] is None else make(*SIZES[size]))
        out.append(json.dumps({"model": TIER, "max_tokens": MAX_TOKENS, "messages": chat}).encode())
    return out


def short(command: str) -> str:
    """A command line for a glance: paths by their last part, cut at 70 characters."""
    return " ".join(Path(word).name if "/" in word else word for word in command.split())[:70]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of these processes onto `cpus` (threads they start later inherit it)."""
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(task), cpus)
            except (ProcessLookupError, FileNotFoundError):
                continue  # a thread that has ended meanwhile


def cpu_now(pids: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(pid) for pid in tree) for name, tree in pids.items()}


def measure(paths: dict, processes: dict, pictures: Pictures, size: str, concurrency: int, count: int) -> dict:
    """One case on every path. The paths take turns in ROUNDS rounds, the order rotating, so
    that load from outside the bench (the machine is shared) falls on each path alike; one
    request at a time, a turn is one request, so that the engine's own drift (its time for the
    same work moves by more than a proxy adds, over minutes) falls on each path alike too."""
    seen = {name: {"latencies": [], "elapsed": 0.0, "cpu": dict.fromkeys(processes, 0.0)} for name in paths}
    names = list(paths)
    rounds = count if concurrency == 1 else ROUNDS
    for turn in range(rounds):
        share = count // rounds + (turn < count % rounds)
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            url, headers = paths[name]
            requests = bodies(pictures, size, share)
            before = cpu_now(processes)
            latencies, elapsed = asyncio.run(send(url, headers, requests, concurrency))
            after = cpu_now(processes)
            seen[name]["latencies"] += latencies
            seen[name]["elapsed"] += elapsed
            for process in processes:
                seen[name]["cpu"][process] += after[process] - before[process]
    rows = {}
    for name, got in seen.items():
        cpu = {process: spent / count for process, spent in got["cpu"].items()}
        proxy = cpu[name] if name in PROXIES else 0.0
        rows[name] = {"latencies": got["latencies"],
                      "p50": statistics.median(got["latencies"]), "p90": percentile(got["latencies"], 0.9),
                      "rps": count / got["elapsed"], "proxy": proxy, "api": cpu["api"], "core": cpu["core"],
                      "outside": proxy + cpu["api"]}
    return rows


def run(quick: bool, pinned: bool, cases: set[str] | None = None) -> None:
    from workers.engines.cpu import install, tiny_model

    counts = {case: n for case, n in (QUICK if quick else COUNTS).items() if cases is None or case[0] in cases}
    python = install.ensure()
    model = tiny_model.ensure(python)
    engine_port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="bench-engine-path-"))
    gateway = EngineGateway(engine_port, model, python)
    litellm = bare = None
    try:
        key = gateway.start()
        engine = engine_start(engine_port, folder)
        litellm, litellm_port, litellm_key = start_litellm(engine_port, folder)
        bare_port = free_port()
        bare = subprocess.Popen([sys.executable, "-m", "bench.bare_proxy", str(bare_port),
                                 f"http://127.0.0.1:{engine_port}"], cwd=ROOT)
        wait_http(f"http://127.0.0.1:{bare_port}/health")
        engine_wait(engine, engine_port)
        paths = {
            "direct": (f"http://127.0.0.1:{engine_port}/v1/chat/completions", {}),
            "gateway": (f"http://127.0.0.1:{gateway.port}/v1/chat/completions", {"Authorization": f"Bearer {key}"}),
            "litellm": (f"http://127.0.0.1:{litellm_port}/v1/chat/completions",
                        {"Authorization": f"Bearer {litellm_key}"}),
            "bare": (f"http://127.0.0.1:{bare_port}/v1/chat/completions", {}),
        }
        # The gateway and LiteLLM as process trees (in case either forks a worker); vLLM's
        # API server alone; its engine core with the worker it starts on CPU (its
        # multiprocessing executor), where the model, the vision encoder included, runs.
        processes = {"gateway": descendants(gateway.process.pid), "litellm": descendants(litellm.pid),
                     "bare": descendants(bare.pid), "api": [engine.pid], "core": descendants(engine.core)}
        for name, tree in processes.items():
            print(f"{name}: " + ", ".join(f"{pid} ({short(command_line(pid))})" for pid in tree))
        if pinned:
            pin(processes["core"], {0})
            pin([pid for name in (*PROXIES, "api") for pid in processes[name]] + [os.getpid()], {1})
            print("pinned: the engine core and its worker on CPU 0; vLLM's API server, the gateway, LiteLLM "
                  "and this client on CPU 1")
        pictures = Pictures()
        results = {}
        print(f"\n{'case':5} {'conc':>4} {'path':8} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'req/s':>6}  "
              f"CPU s/req: {'proxy':>6} {'api':>6} {'core':>6} {'outside':>7}", flush=True)
        for (size, concurrency), count in counts.items():
            for url, headers in paths.values():  # warm each path up, untimed (for "again": its picture)
                asyncio.run(send(url, headers, bodies(pictures, size, 1), 1))
            case = measure(paths, processes, pictures, size, concurrency, count)
            for name, row in case.items():
                results[size, concurrency, name] = row
                proxy = f"{row['proxy']:6.3f}" if name != "direct" else f"{'-':>6}"
                print(f"{size:5} {concurrency:4d} {name:8} {count:4d} {1000 * row['p50']:8.1f} "
                      f"{1000 * row['p90']:8.1f} {row['rps']:6.2f}             {proxy} {row['api']:6.3f} "
                      f"{row['core']:6.3f} {row['outside']:7.3f}", flush=True)
        # What validating such a picture costs the gateway alone, in this process, the engine idle.
        validation = image_steps(pictures.next(*SIZES["1mp"]))["base64 + normalise"]
        report(results, validation)
    finally:
        clean_up(litellm and litellm.terminate, bare and bare.terminate, engine_stop, gateway.stop)
        for process in (litellm, bare):
            if process is not None:
                process.wait(timeout=20)
        shutil.rmtree(folder, ignore_errors=True)


def report(results: dict, validation: float) -> None:
    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    print("\nissue 16's targets")
    if (line := beyond_text(results, "again")) is not None:
        print(f"1mp sent again (one picture resent, as a chat resends it on each turn; every path's caches "
              f"warm), c=1, paired by round: {line}")
    for concurrency in (c for c in CONCURRENCY if ("12mp", c, "gateway") in results):
        gw, lite, direct = (results["12mp", concurrency, name] for name in ("gateway", "litellm", "direct"))
        share_lite = gw["outside"] / lite["outside"]
        share_direct = gw["outside"] / direct["outside"]
        p50 = gw["p50"] / direct["p50"]
        print(f"12mp c={concurrency}: CPU outside the engine core, gateway {gw['outside']:.3f} s/req: "
              f"{share_lite:.2f}x LiteLLM's path ({lite['outside']:.3f}; target <= 0.50, {verdict(share_lite <= 0.5)}), "
              f"{share_direct:.2f}x direct ({direct['outside']:.3f}; target <= 0.67, "
              f"{verdict(share_direct <= 2 / 3)}); p50 gateway/direct {p50:.2f} (target < 1, {verdict(p50 < 1)})")
    for concurrency in (c for c in CONCURRENCY if ("1mp", c, "gateway") in results and ("text", c, "gateway") in results):
        added = results["1mp", concurrency, "gateway"]["p50"] - results["1mp", concurrency, "direct"]["p50"]
        text = results["text", concurrency, "gateway"]["p50"] - results["text", concurrency, "direct"]["p50"]
        # Requests in flight together are not paired: each path's latencies resampled on their own.
        low, high = interval([(results[case, concurrency, name]["latencies"], sign)
                              for case, name, sign in (("1mp", "gateway", 1), ("1mp", "direct", -1),
                                                       ("text", "gateway", -1), ("text", "direct", 1))])
        print(f"1mp c={concurrency}: gateway p50 - direct p50 = {1000 * added:+.1f} ms; text overhead "
              f"(the same for text) {1000 * text:+.1f} ms (target: no more, {verdict(added <= max(text, 0.0))}); "
              f"beyond the text overhead {1000 * (added - text):+.1f} ms (90 % interval {1000 * low:+.1f} to "
              f"{1000 * high:+.1f}), where validating the image (base64 and normalise, which forwards it as "
              f"sent) takes {1000 * validation:.1f} ms alone")
    if (line := beyond_text(results, "1mp")) is not None:
        print(f"1mp c=1, paired by round: {line}")
    for case in ("1mp", "again"):
        if (line := beyond_text(results, case, path="bare")) is not None:
            print(f"{case} c=1, paired by round, the floor under any proxy: {line}")


def beyond_text(results: dict, case: str, path: str = "gateway") -> str | None:
    """`case` at concurrency 1 against `path`'s text overhead. One request at a time, each round
    sends one request down every path back to back: the path's time over direct in the same
    round leaves out the engine's drift between rounds. The medians, and a bootstrap interval
    of their difference."""
    if (case, 1, path) not in results or ("text", 1, path) not in results:
        return None
    image, text = (paired(results[name, 1, path]["latencies"], results[name, 1, "direct"]["latencies"])
                   for name in (case, "text"))
    low, high = interval([(image, 1), (text, -1)])
    image_ms, text_ms = 1000 * statistics.median(image), 1000 * statistics.median(text)
    who = "the gateway" if path == "gateway" else f"the {path} proxy"
    return (f"{who} over direct {image_ms:+.1f} ms, on text {text_ms:+.1f} ms; beyond the text overhead "
            f"{image_ms - text_ms:+.1f} ms (90 % interval {1000 * low:+.1f} to {1000 * high:+.1f}: "
            f"{'no more than the text overhead' if low <= 0 else 'more'})")


def paired(proxied: list[float], direct: list[float]) -> list[float]:
    """A proxy's latency less direct's, request by request in the order they were sent (at
    concurrency 1, the nth of each path went in the same round)."""
    return [ours - theirs for ours, theirs in zip(proxied, direct, strict=True)]


def interval(terms: list[tuple[list[float], int]], share: float = 0.9, draws: int = 4000) -> tuple[float, float]:
    """A bootstrap interval of the sum of the terms' medians, each with its sign (+1 or -1),
    each term's samples resampled on their own."""
    rng = random.Random(16)
    spread = sorted(sum(sign * statistics.median(rng.choices(samples, k=len(samples))) for samples, sign in terms)
                    for _ in range(draws))
    return spread[int(draws * (1 - share) / 2)], spread[int(draws * (1 + share) / 2) - 1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few requests per case (a development run)")
    parser.add_argument("--cases", help=f"only these cases, comma-separated (of {', '.join(SIZES)})")
    parser.add_argument("--pin", action="store_true",
                        help="the engine core alone on CPU 0, every other process on CPU 1 (a GPU host's shape)")
    args = parser.parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C does, through run's cleanup.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run(args.quick, args.pin, set(args.cases.split(",")) if args.cases else None)


if __name__ == "__main__":
    main()
