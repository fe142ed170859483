"""Benchmark runs: start, cancel, execute. The run row is the truth about a run.

A run loads its profile's target with the profile's request mix, one stage per load level,
and stores what each stage measured. The target is the tier through the gateway, with a key of
the service's internal tenant made for the run and revoked after it, so that its usage is
metered apart from the tenants'; or one engine instance directly, which measures the engine
itself, without the gateway, and so is metered nowhere (its log says so). The load itself runs
on an event loop in a thread of its own (loadgen.py is pure asyncio); this thread keeps the
database: it polls the cancel flag and writes progress, log lines and the results of each
stage as they come.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import threading

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Value
from django.db.models.functions import Coalesce, Concat
from django.utils import timezone

from controlplane import outbound
from controlplane.benchmarks import loadgen, observed, resolution, stats
from controlplane.benchmarks.models import BenchmarkImage, BenchmarkProfile, BenchmarkRun, EvalSet
from controlplane.benchmarks.resolution import Item
from controlplane.benchmarks.schedules import profile_schedule_remove, profile_schedule_sync
from controlplane.benchmarks.workload import (
    CLASS_NAMES,
    Mix,
    UploadedImage,
    Workload,
    buckets_from_json,
    synthetic_jpeg,
)
from controlplane.catalog.services import tier_image_tokens
from controlplane.celery import app
from controlplane.fleet.selectors import routable_instances
from controlplane.imaging.policy import sent_sizes
from controlplane.imaging.tokens import count_image_tokens
from controlplane.metering.ratebook import NoRate, RateBook
from controlplane.tenants.services import (
    TenantInactive,
    api_key_create,
    api_key_revoke,
    internal_tenant,
)

log = logging.getLogger(__name__)

POLL_S = 0.5
MAX_STORED_SAMPLES = 20_000
# The run task's hard time limit (workers.tasks.benchmark_run): no worker still runs a run
# that started longer ago than this.
RUN_TIME_LIMIT_S = 3700
# A running run whose worker has written nothing for this long has lost it (a worker beats
# every POLL_S under load; preparing images or a key before the load takes seconds).
RUN_SILENCE_S = 300
SAMPLE_COLUMNS = ["stage", "class", "start_s", "ok", "ttft_s", "tpot_s", "e2e_s", "output_tokens", "image_tokens"]


class BenchmarkError(Exception):
    """A run cannot go ahead; the message says why and lands in the run's log."""


def benchmark_start(*, profile: BenchmarkProfile, label: str = "", user=None,
                    trigger: str = BenchmarkRun.Trigger.MANUAL) -> BenchmarkRun:
    # The tasks module imports this one: imported here, where a task is enqueued.
    from controlplane.benchmarks.tasks import benchmark_run

    run = BenchmarkRun.objects.create(profile=profile, label=label, created_by=user, trigger=trigger,
                                      config=profile_config(profile))

    def enqueue():
        result = benchmark_run.delay(run.pk)
        BenchmarkRun.objects.filter(pk=run.pk).update(task_id=result.id or "")

    transaction.on_commit(enqueue)
    return run


def benchmark_start_scheduled(*, profile_id: int, task_id: str = "") -> BenchmarkRun | None:
    """A schedule's turn: a run of the profile, unless one is still queued or running."""
    profile = BenchmarkProfile.objects.filter(pk=profile_id).first()
    if profile is None:
        return None
    _abandoned_runs_end(profile.runs.all(), BenchmarkRun.State.FAILED)
    if profile.runs.filter(state__in=[BenchmarkRun.State.QUEUED, BenchmarkRun.State.RUNNING]).exists():
        log.info("benchmark profile %s: the previous run has not finished; skipping this turn", profile.name)
        return None
    return BenchmarkRun.objects.create(profile=profile, trigger=BenchmarkRun.Trigger.SCHEDULE,
                                       label=f"scheduled {timezone.now():%Y-%m-%d %H:%M}",
                                       config=profile_config(profile), task_id=task_id)


def benchmark_cancel(*, run: BenchmarkRun) -> None:
    """A queued run is cancelled at once; a running one stops at its next poll, keeping what
    it measured."""
    if run.finished:
        return
    BenchmarkRun.objects.filter(pk=run.pk).update(cancel_requested=True)
    _abandoned_runs_end(BenchmarkRun.objects.filter(pk=run.pk), BenchmarkRun.State.CANCELLED)
    cancelled_now = BenchmarkRun.objects.filter(pk=run.pk, state=BenchmarkRun.State.QUEUED).update(
        state=BenchmarkRun.State.CANCELLED, finished_at=timezone.now(), log="cancelled before it started\n")
    if cancelled_now and run.task_id:
        try:  # the flag already stops it; revoking only spares a worker the pickup
            app.control.revoke(run.task_id)
        except Exception:
            log.warning("could not revoke the task of benchmark run %s", run.pk, exc_info=True)
    run.refresh_from_db()


def _abandoned_runs_end(runs, state: str) -> int:
    """End the runs still marked running whose worker has gone silent (or that outlived their
    task's hard time limit): it died (killed, or the limit reached) without writing how they
    ended, and nothing else ever will."""
    now = timezone.now()
    silent = Q(last_sign__lt=now - dt.timedelta(seconds=RUN_SILENCE_S))
    too_long = Q(started_at__lt=now - dt.timedelta(seconds=RUN_TIME_LIMIT_S))
    gone = runs.filter(state=BenchmarkRun.State.RUNNING).annotate(
        last_sign=Coalesce("beat_at", "started_at")).filter(silent | too_long).values_list("pk", flat=True)
    return BenchmarkRun.objects.filter(pk__in=list(gone)).update(
        state=state, finished_at=now,
        log=Concat("log", Value(f"{now:%H:%M:%S} the worker running it stopped without finishing it\n")))


def profile_config(profile: BenchmarkProfile) -> dict:
    """The profile and the tier's engine settings as a run used them, for comparing runs."""
    fields = ["kind", "pixel_caps", "target", "gateway_url", "instance_id", "text_share", "images_per_request_min",
              "images_per_request_max", "image_source", "image_buckets", "prompt_tokens_min",
              "prompt_tokens_max", "output_tokens_min", "output_tokens_max", "arrival", "sweep",
              "stage_duration_s", "seed", "ttft_slo_ms", "tpot_slo_ms"]
    tier = profile.tier
    return {
        **{name: getattr(profile, name) for name in fields},
        "uploaded_images": profile.images.count(),
        "eval_set": profile.eval_set.name if profile.eval_set_id else None,
        "eval_items": profile.eval_set.items.count() if profile.eval_set_id else 0,
        "tier": {"name": tier.name, "family": tier.family, "engine_settings": tier.engine_settings,
                 "large_image_threshold": tier.large_image_threshold,
                 "resolution_policy": tier.resolution_policy.name if tier.resolution_policy else None,
                 "replicas": tier.replicas},
    }


def token_estimator(tier):
    """Image tokens of a `width` x `height` image on the tier, after its resolution policy."""
    policy = tier.image_policy()

    def estimate(width: int, height: int) -> int:
        if policy is None:
            return count_image_tokens(tier.family, width, height)
        return sum(tier_image_tokens(tier, *sent) for sent in sent_sizes(width, height, policy))

    return estimate


def workload_for(profile: BenchmarkProfile) -> Workload:
    uploads = ()
    if profile.image_source == BenchmarkProfile.ImageSource.UPLOADS:
        uploads = tuple(UploadedImage(bytes(i.data), i.width, i.height, i.content_type) for i in profile.images.all())
        if not uploads and profile.text_share < 1:
            raise BenchmarkError("the profile sends uploaded images but has none")
    mix = Mix(text_share=profile.text_share, images_min=profile.images_per_request_min,
              images_max=profile.images_per_request_max, buckets=buckets_from_json(profile.image_buckets),
              uploads=uploads, prompt_tokens=(profile.prompt_tokens_min, profile.prompt_tokens_max),
              output_tokens=(profile.output_tokens_min, profile.output_tokens_max))
    try:
        return Workload(mix, seed=profile.seed, estimate_tokens=token_estimator(profile.tier),
                        large_threshold=profile.tier.large_image_threshold)
    except ValueError as exc:
        raise BenchmarkError(str(exc)) from None


def _target(run: BenchmarkRun, planned_s: float):
    """The endpoint, and what to undo afterwards (the run's gateway key)."""
    profile = run.profile
    if profile.target == BenchmarkProfile.Target.INSTANCE:
        instance = profile.instance
        if instance is None:
            instances = routable_instances(tier_id=profile.tier_id)
            if not instances:
                raise BenchmarkError(f"no healthy instance of {profile.tier.name} to benchmark")
            instance = instances[0]
        if not instance.base_url:
            raise BenchmarkError(f"instance {instance.pk} has no address yet")
        url = f"{instance.base_url}/v1/chat/completions"
        # Engines the node agent launched are called as they are; an external one's URL was set
        # by an operator, and is vetted.
        pinned = _vetted(url, "engine URL") if instance.external_url else None
        target = loadgen.Target(url=url, model=instance.model_name, api_key=instance.api_key, pinned=pinned)
        where = f"instance {instance.pk} at {instance.base_url} (straight to the engine: not metered)"
        return target, where, lambda: None
    url = f"{profile.gateway_base}/v1/chat/completions"
    # This server's own gateway (GATEWAY_PUBLIC_URL) is its configuration, not a URL an operator set.
    pinned = _vetted(url, "benchmark target URL") if profile.gateway_url else None
    tenant = internal_tenant()
    try:
        issued = api_key_create(tenant=tenant, name=f"benchmark run {run.pk}",
                                expires_at=timezone.now() + dt.timedelta(seconds=planned_s + 3600))
    except TenantInactive as exc:
        raise BenchmarkError(str(exc)) from None
    target = loadgen.Target(url=url, model=profile.tier.name, api_key=issued.secret, pinned=pinned)
    return target, f"{profile.tier.name} through the gateway at {profile.gateway_base}", \
        lambda: api_key_revoke(api_key=issued.api_key)


def _vetted(url: str, what: str) -> outbound.Target:
    """The address a run's requests all go to, vetted once as it starts."""
    try:
        return outbound.vet(url, trusted_networks=settings.OPERATOR_URL_TRUSTED_NETWORKS, what=what)
    except (outbound.UnsafeURL, outbound.FetchFailed) as exc:
        raise BenchmarkError(str(exc)) from None


def _rates(tier):
    try:
        return RateBook().rates_at(tier.price_plan_id, timezone.now())
    except NoRate:
        return None


def _stage_line(n: int, level, arrival: str, summary: dict) -> str:
    unit = "concurrency" if arrival == loadgen.CLOSED else "rate"
    parts = [f"stage {n + 1} ({unit} {level:g}): {summary['requests']} requests, {summary['errors']} errors"]
    for klass, figures in summary["classes"].items():
        p99 = figures["ttft"]["p99"]
        if p99 is not None:
            parts.append(f"{CLASS_NAMES[klass]} TTFT p99 {p99:.0f} ms")
    parts.append(f"goodput {summary['goodput']['requests_per_s']:.2f}/s")
    return "; ".join(parts)


@dataclasses.dataclass
class _Shared:
    """What the load thread hands to the database thread."""

    progress: float = 0.0
    stop: bool = False
    finished_stages: list = dataclasses.field(default_factory=list)  # (index, samples, seconds)
    error: BaseException | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def benchmark_execute(*, run_id: int) -> None:
    moved = BenchmarkRun.objects.filter(pk=run_id, state=BenchmarkRun.State.QUEUED, cancel_requested=False) \
        .update(state=BenchmarkRun.State.RUNNING, started_at=timezone.now(), beat_at=timezone.now())
    if not moved:
        return
    run = BenchmarkRun.objects.select_related("profile__tier__price_plan", "profile__tier__resolution_policy",
                                              "profile__instance__node").get(pk=run_id)
    profile = run.profile
    levels = [float(v) for v in profile.sweep]
    planned_s = len(levels) * profile.stage_duration_s
    cleanup = None
    resolution_sweep = profile.kind == BenchmarkProfile.Kind.RESOLUTION
    try:
        workload = None if resolution_sweep else workload_for(profile)
        target, where, cleanup = _target(run, planned_s)
    except BenchmarkError as exc:
        _finish(run, BenchmarkRun.State.FAILED, f"{exc}\n")
        return
    try:
        if resolution_sweep:
            _append_log(run, f"resolution sweep against {where}; caps {profile.pixel_caps}")
            _measure_resolution(run, target)
        else:
            _append_log(run, f"{profile.arrival} loop against {where}; levels {profile.sweep}, "
                             f"{profile.stage_duration_s:g}s each")
            _measure(run, workload, target, levels)
    except BenchmarkError as exc:
        _finish(run, BenchmarkRun.State.FAILED, f"{exc}\n")
    except Exception as exc:  # whatever broke, the row says so instead of staying "running"
        log.exception("benchmark run %s failed", run.pk)
        _finish(run, BenchmarkRun.State.FAILED, f"failed: {type(exc).__name__}: {exc}\n")
    finally:
        if cleanup is not None:
            cleanup()


def drain_seconds(stage_duration_s: float) -> float:
    """How long a stage waits for what is in flight at its end. With MAX_PLANNED_S of load
    and at most 20 stages, a run stays inside its task's one-hour limit."""
    return min(30.0, max(10.0, stage_duration_s))


def _measure(run: BenchmarkRun, workload: Workload, target: loadgen.Target, levels: list[float]) -> None:
    profile = run.profile
    slo = stats.Slo(ttft_ms=profile.ttft_slo_ms, tpot_ms=profile.tpot_slo_ms)
    rates = _rates(profile.tier)
    counter = iter(range(10**12))
    results = {"kind": "load", "arrival": profile.arrival,
               "unit": "concurrency" if profile.arrival == loadgen.CLOSED else "rps",
               "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}, "stages": [],
               "sample_columns": SAMPLE_COLUMNS, "samples": []}

    def start(on_tick, on_stage):
        return loadgen.run_sweep(
            target, lambda: workload.spec(next(counter)), arrival=profile.arrival, levels=levels,
            duration_s=profile.stage_duration_s, seed=profile.seed, on_tick=on_tick, on_stage=on_stage,
            tick_s=0.2, drain_s=drain_seconds(profile.stage_duration_s))

    def summarise(n, samples, elapsed_s, stopped):
        # Rates are per second of the stage as it ran: its load, the drain of what was in
        # flight at the end, or until it was stopped.
        summary = stats.stage_summary(samples, duration_s=elapsed_s, slo=slo, rates=rates, level=levels[n])
        summary["stopped_early"] = stopped
        results["stages"].append(summary)
        room = MAX_STORED_SAMPLES - len(results["samples"])
        results["samples"].extend(stats.sample_row(s) for s in samples[:max(0, room)])
        return _stage_line(n, levels[n], profile.arrival, summary)

    _drive(run, results, start, summarise)


def _measure_resolution(run: BenchmarkRun, target: loadgen.Target) -> None:
    profile = run.profile
    items = resolution_items(profile)
    caps = list(profile.pixel_caps)
    stages = resolution.sweep_specs(items, caps, max_tokens=profile.output_tokens_max,
                                    estimate_tokens=token_estimator(profile.tier))
    specs = {spec.index: spec for stage in stages for spec in stage}
    rates = _rates(profile.tier)
    results = {"kind": "resolution", "items": len(items), "caps": []}

    def start(on_tick, on_stage):
        return loadgen.run_fixed(target, stages, concurrency=max(1, int(profile.sweep[0])), on_tick=on_tick,
                                 on_stage=on_stage, tick_s=0.2)

    def summarise(n, samples, elapsed_s, stopped):
        summary = resolution.cap_summary(samples, specs, cap=caps[n], rates=rates)
        summary["stopped_early"] = stopped
        results["caps"].append(summary)
        scores = ", ".join(resolution.task_line(t, v) for t, v in summary["tasks"].items())
        return (f"cap {caps[n]:,} px: {summary['requests']} requests, {summary['errors']} errors, "
                f"{summary['mean_image_tokens'] or 0:.0f} image tokens each" + (f"; {scores}" if scores else ""))

    _drive(run, results, start, summarise)


def set_items(eval_set: EvalSet) -> list:
    """An evaluation set's items, as a sweep asks them."""
    return [Item(key=f"row-{i.row}", data=bytes(i.data), width=i.width, height=i.height,
                 content_type=i.content_type, question=i.question, task_type=i.task_type, answers=tuple(i.answers))
            for i in eval_set.items.all()]


def resolution_items(profile: BenchmarkProfile) -> list:
    """The items of its evaluation set, else the uploaded images, else one synthetic image per
    size bucket."""
    items = set_items(profile.eval_set) if profile.eval_set_id else []
    if not items:
        items = [Item(key=f"image-{i.pk}", data=bytes(i.data), width=i.width, height=i.height,
                      content_type=i.content_type) for i in profile.images.all()]
    if not items:
        items = [Item(key=f"{b.width}x{b.height}", data=synthetic_jpeg(b.width, b.height, 0), width=b.width,
                      height=b.height) for b in buckets_from_json(profile.image_buckets)]
    if not items:
        raise BenchmarkError("a resolution sweep needs an evaluation set, uploaded images or size buckets")
    return items


def _drive(run: BenchmarkRun, results: dict, start, summarise) -> None:
    """Run the load on a thread of its own; here, poll the cancel flag and write what comes."""
    shared = _Shared()

    async def on_tick(progress: float) -> bool:
        shared.progress = progress
        return shared.stop

    async def on_stage(n: int, samples: list, elapsed_s: float, stopped: bool) -> None:
        with shared.lock:
            shared.finished_stages.append((n, samples, elapsed_s, stopped))

    def load():
        try:
            asyncio.run(start(on_tick, on_stage))
        except BaseException as exc:  # handed to the database thread, which reports it
            shared.error = exc

    def take_finished_stages() -> bool:
        with shared.lock:
            done, shared.finished_stages = shared.finished_stages, []
        for n, samples, elapsed_s, stopped in done:
            _append_log(run, summarise(n, samples, elapsed_s, stopped))
        return bool(done)

    thread = threading.Thread(target=load, name=f"benchmark-{run.pk}", daemon=True)
    thread.start()
    cancelled = False
    while thread.is_alive():
        thread.join(POLL_S)
        fields = {"progress": round(shared.progress, 4), "beat_at": timezone.now()}
        if take_finished_stages():  # the results grow a stage at a time: written when they do
            fields["results"] = results
        if BenchmarkRun.objects.filter(pk=run.pk, cancel_requested=True).exists() and not shared.stop:
            shared.stop = cancelled = True
            _append_log(run, "cancel requested: stopping")
        BenchmarkRun.objects.filter(pk=run.pk).update(**fields)
    take_finished_stages()  # a stage that ended just as the thread did
    if shared.error is not None:
        raise shared.error
    if cancelled:
        _finish(run, BenchmarkRun.State.CANCELLED, "cancelled; the results keep what was measured\n",
                results=results)
        return
    stages = results.get("stages") or results.get("caps") or []
    errors = sum(stage["errors"] for stage in stages)
    requests = sum(stage["requests"] for stage in stages)
    if errors == requests:
        why = "every request failed" if requests else "no request was answered in time"
        _finish(run, BenchmarkRun.State.FAILED, f"{why}\n", results=results)
        return
    _finish(run, BenchmarkRun.State.SUCCEEDED, f"done: {requests} requests, {errors} errors\n", results=results,
            progress=1.0)


def _append_log(run: BenchmarkRun, line: str) -> None:
    stamp = timezone.now().strftime("%H:%M:%S")
    BenchmarkRun.objects.filter(pk=run.pk).update(log=Concat("log", Value(f"{stamp} {line.rstrip()}\n")))


def _finish(run: BenchmarkRun, state: str, line: str, *, results: dict | None = None,
            progress: float | None = None) -> None:
    _append_log(run, line)
    fields = {"state": state, "finished_at": timezone.now()}
    if results is not None:
        fields["results"] = results
    if progress is not None:
        fields["progress"] = progress
    BenchmarkRun.objects.filter(pk=run.pk).update(**fields)


@transaction.atomic
def profile_save(*, profile: BenchmarkProfile) -> BenchmarkProfile:
    """Save a validated profile and bring its beat schedule in line with it."""
    profile.save()
    profile_schedule_sync(profile=profile)
    return profile


def profile_from_traffic(*, name: str, tier, tenant=None, seconds: float, multipliers: list[float],
                         stage_duration_s: float = 30.0) -> BenchmarkProfile:
    """A load profile whose mix and rates are those `tier` (or `tenant` on it) served over the
    last `seconds`, leaving out benchmark traffic. Raises observed.NoTraffic when there was none."""
    until = timezone.now()
    seen = observed.observe(tier, tenant=tenant, since=until - dt.timedelta(seconds=seconds), until=until,
                            exclude_internal=True)
    whose = f"{tenant.name} on {tier.name}" if tenant is not None else tier.name
    profile = BenchmarkProfile(
        name=name, tier=tier,
        description=f"Drawn from the traffic of {whose}, {until - dt.timedelta(seconds=seconds):%Y-%m-%d %H:%M} "
                    f"to {until:%Y-%m-%d %H:%M} UTC: {seen.summary()}.",
        **observed.profile_fields(seen, multipliers=multipliers, stage_duration_s=stage_duration_s))
    profile.full_clean()
    return profile_save(profile=profile)


@transaction.atomic
def profile_delete(*, profile: BenchmarkProfile) -> None:
    profile_schedule_remove(profile=profile)
    profile.delete()


def profile_image_add(*, profile: BenchmarkProfile, name: str, content_type: str, width: int, height: int,
                      data: bytes) -> BenchmarkImage:
    return BenchmarkImage.objects.create(profile=profile, name=name, content_type=content_type, width=width,
                                         height=height, data=data)
