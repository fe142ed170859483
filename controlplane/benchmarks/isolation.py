"""The experiment the serving design rests on, end to end against simulated engines:

1. text only: the text traffic alone, on two engines (the baseline);
2. mixed: the same text plus small and large images, on two engines, first come first served;
3. isolated: the same mixed traffic, with large images on an engine of their own (the tier's
   large-image pool) and text ahead of images on the other (priority scheduling).

Every request goes through the gateway (its own web process) with a benchmark key, so
routing, the large-image threshold and the priorities are the product's own. The engines
are GPU-shaped simulators: a fixed step cost that batching amortises, prefill and vision
encoding by the token. Tiers, engines and profiles made here are removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from decimal import Decimal

import httpx
from django.conf import settings
from django.db import connections
from django.utils import timezone

from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun
from controlplane.benchmarks.services import benchmark_execute
from controlplane.catalog.models import ModelTier, PricePlan, PriceRate, ResolutionPolicy
from controlplane.fleet.models import EngineInstance, Node
from controlplane.metering.models import UsageEvent
from workers.engines.launch import LaunchSpec, build_command

# An H100-like step for a 7B VLM, scaled to run on a laptop (see the simulator's scheduler).
ENGINE = {"max_model_len": 32768, "max_num_seqs": 64, "max_output_tokens": 512, "step_overhead_ms": 8,
          "decode_ms_per_token": 0.3, "prefill_us_per_token": 50, "encode_us_per_image_token": 30,
          "enable_prefix_caching": False}
MIX = {"images_per_request_min": 1, "images_per_request_max": 1, "prompt_tokens_min": 64,
       "prompt_tokens_max": 160, "output_tokens_min": 32, "output_tokens_max": 64,
       "image_buckets": [{"width": 640, "height": 480, "weight": 3}, {"width": 1792, "height": 1792, "weight": 2}]}
PREFIX = "isolation-"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _engine(tier: ModelTier):
    port = _free_port()
    policy = tier.resolution_policy
    argv, env = build_command(LaunchSpec(
        engine_kind="simulator", model_id=tier.model_id, served_model_name=tier.name, family=tier.family,
        host="127.0.0.1", port=port, settings=tier.settings, images_per_prompt=4,
        processor_kwargs={"min_pixels": policy.min_pixels, "max_pixels": policy.max_pixels}))
    process = subprocess.Popen(argv, cwd=settings.BASE_DIR, env={**os.environ, **env},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", process, f"the simulator for {tier.name}")
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextlib.contextmanager
def _gateway():
    """The web process as `make run` starts it, apart from the load generator's process."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1", "--port",
         str(port), "--no-access-log", "--log-level", "warning"], cwd=settings.BASE_DIR,
        env={**os.environ, "LOG_LEVEL": "WARNING"})  # not a line per upstream request under the table
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/v1/models", process, "the gateway", ok=(401,))
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def _wait_healthy(url: str, process: subprocess.Popen, what: str, ok=(200,)) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url, timeout=1).status_code in ok:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.2)


@contextlib.contextmanager
def _kept_healthy(instances: list[EngineInstance]):
    """No node agent runs here: mark the engines checked, as its health pass would."""
    stop = threading.Event()

    def beat():
        try:
            while not stop.wait(5):
                EngineInstance.objects.filter(pk__in=[i.pk for i in instances]).update(last_health_at=timezone.now())
        finally:
            connections.close_all()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _tier(name: str, plan: PricePlan, policy: ResolutionPolicy, **engine) -> ModelTier:
    return ModelTier.objects.create(
        name=f"{PREFIX}{name}", family="qwen2_5_vl", model_id="Qwen/Qwen2.5-VL-7B-Instruct", kind="vision",
        engine_kind="simulator", engine_settings={**ENGINE, **engine}, resolution_policy=policy,
        price_plan=plan, large_image_threshold=1300, replicas=2)


def run_experiment(*, text_rate: float = 4.0, duration_s: float = 30.0, seed: int = 1, out=print) -> list[dict]:
    """Run the three benchmarks; return one row of figures each."""
    policy = ResolutionPolicy.objects.create(name=f"{PREFIX}policy", max_pixels=3211264,
                                             low_detail_max_pixels=401408)
    plan = PricePlan.objects.create(name=f"{PREFIX}plan")
    PriceRate.objects.create(plan=plan, effective_from=timezone.now() - timezone.timedelta(days=1),
                             text_input_per_mtok=Decimal("0.15"), image_per_mtok=Decimal("0.15"),
                             output_per_mtok=Decimal("0.45"))
    node = Node.objects.create(name=f"{PREFIX}node", address="127.0.0.1", queue=f"node.{PREFIX}node",
                               last_seen_at=timezone.now())
    shared = _tier("shared", plan, policy, scheduling_policy="fcfs")
    isolated = _tier("isolated", plan, policy, scheduling_policy="priority", large_pool_replicas=1)
    rows = []
    try:
        with contextlib.ExitStack() as stack:
            instances = []
            for tier, pool in ((shared, "standard"), (shared, "standard"), (isolated, "standard"),
                               (isolated, "large")):
                port = stack.enter_context(_engine(tier))
                instances.append(EngineInstance.objects.create(
                    tier=tier, node=node, port=port, pool=pool, actual_state="running", healthy=True,
                    last_health_at=timezone.now()))
            stack.enter_context(_kept_healthy(instances))
            gateway = stack.enter_context(_gateway())
            plans = [("text only", shared, 1.0, text_rate),
                     ("mixed, shared engines, first come first served", shared, 0.5, 2 * text_rate),
                     ("mixed, large-image pool, text priority", isolated, 0.5, 2 * text_rate)]
            for n, (title, tier, text_share, rate) in enumerate(plans):
                profile = BenchmarkProfile.objects.create(
                    name=f"{PREFIX}{n}", tier=tier, target="gateway", gateway_url=gateway, text_share=text_share,
                    arrival="open", sweep=[rate], stage_duration_s=duration_s, seed=seed, ttft_slo_ms=250,
                    tpot_slo_ms=50, **MIX)
                run = BenchmarkRun.objects.create(profile=profile, label=title)
                out(f"running: {title} ({rate:g} requests/s for {duration_s:g} s)")
                benchmark_execute(run_id=run.pk)
                run.refresh_from_db()
                if run.state != BenchmarkRun.State.SUCCEEDED:
                    raise RuntimeError(f"{title}: {run.state}\n{run.log}")
                rows.append({"title": title, "run": run.pk, "stage": run.results["stages"][0]})
        return rows
    finally:
        UsageEvent.objects.filter(tier__name__startswith=PREFIX).delete()
        BenchmarkRun.objects.filter(profile__name__startswith=PREFIX).delete()
        BenchmarkProfile.objects.filter(name__startswith=PREFIX).delete()
        ModelTier.objects.filter(name__startswith=PREFIX).delete()
        node.delete()
        plan.delete()
        policy.delete()


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table: text latency first, since it is what the design protects."""
    lines = ["| traffic | text TTFT p50 / p90 / p99 (ms) | text TPOT p99 (ms) | image TTFT p99 (ms) | "
             "large image TTFT p99 (ms) | requests | goodput |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        stage = row["stage"]
        text = stage["classes"]["text"]["ttft"]

        def p99(klass, stage=stage):
            figures = stage["classes"].get(klass)
            return f"{figures['ttft']['p99']:.0f}" if figures else "—"

        lines.append(f"| {row['title']} | {text['p50']:.0f} / {text['p90']:.0f} / {text['p99']:.0f} | "
                     f"{stage['classes']['text']['tpot']['p99']:.1f} | {p99('image')} | {p99('large_image')} | "
                     f"{stage['requests']} | {stage['goodput']['share']:.0%} |")
    return "\n".join(lines)
