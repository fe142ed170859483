"""What an image's pixels are worth, measured on the real vLLM CPU engine serving the model
the project trains: vLLM gives the answers transformers gives, the model's reading falls as
the pixel cap falls, through the gateway, and a quality gate blocks a policy that makes the
text unreadable before it serves anyone."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from celery import Celery

from controlplane.benchmarks import advisor, gates, loadgen, resolution
from controlplane.benchmarks.models import EvalItem, EvalSet, GateCheck, QualityGate
from controlplane.catalog.models import ModelTier, ResolutionPolicy
from controlplane.fleet.models import EngineInstance
from controlplane.imaging import synthetic
from controlplane.intervals import wilson
from tests.system.conftest import REAL_TIER, SYSTEM_REDIS_DB
from tests.system.harness import wait_for
from workers.engines.cpu import seeing_long, seeing_model, tiny_model

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("system")]

FULL = 224 * 224  # the trained model's canvas
ITEMS = 30


def _questions(task: str = "read") -> list:
    return [resolution.Item(key=f"{task}-{n}", data=s.image, width=s.width, height=s.height,
                            content_type="image/png", question=s.question, task_type=task, answers=s.answers)
            for n, s in enumerate(synthetic.generate(task, ITEMS, seeing_model.HELD_OUT_SEED,
                                                     style=seeing_model.STYLE))]


def test_vllm_serves_the_trained_model_with_the_answers_transformers_gives(real_engine, vllm_cpu_python):
    count = 30
    result = subprocess.run([str(vllm_cpu_python), "-m", "workers.engines.cpu.seeing_model", "eval",
                             str(seeing_model.ensure(vllm_cpu_python)), "--count", str(count), "--json"],
                            cwd=seeing_model.ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    samples = seeing_model.held_out(count)

    def ask(sample):
        response = httpx.post(f"{real_engine.base_url}/v1/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {real_engine.api_key}"}, json={
                                  "model": REAL_TIER, "max_tokens": 8, "temperature": 0,
                                  "messages": [{"role": "user", "content": [
                                      {"type": "image_url", "image_url": {
                                          "url": "data:image/png;base64," + base64.b64encode(sample.image).decode()}},
                                      {"type": "text", "text": sample.question}]}]})
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"].strip()

    with ThreadPoolExecutor(2) as pool:
        served = list(pool.map(ask, samples))
    # On a task left at chance the answer is a near tie of logits, which vLLM's bf16 arithmetic
    # breaks either way: agreement is measured where the model has learned something.
    compared = [(s, a, b) for s, a, b in zip(samples, served, measured["answers"], strict=True)
                if s.task in seeing_model.LEARNED]
    differ = [(s.task, s.answers[0], a, b) for s, a, b in compared if a != b]
    assert len(differ) <= 0.05 * len(compared), differ
    assert sum(seeing_model.correct(s, a) for s, a, _ in compared) >= 0.85 * len(compared)


def test_long_banners_tiled_at_the_default_threshold_are_read_where_squashed_they_are_not(real_engine):
    # Sent as the gateway sends them at the model's canvas: cut into tiles past the default
    # policy's aspect bound, or squashed whole into the cap.
    threshold = ResolutionPolicy._meta.get_field("max_aspect_ratio").default
    strips = seeing_long.held_out("banner", (6, 15), 20)

    def ask(args):
        strip, sent_under = args
        parts = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(
            tile["data"]).decode()}} for tile in seeing_long.as_sent(strip, sent_under)]
        response = httpx.post(f"{real_engine.base_url}/v1/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {real_engine.api_key}"}, json={
                                  "model": REAL_TIER, "max_tokens": 8, "temperature": 0,
                                  "messages": [{"role": "user", "content": [
                                      *parts, {"type": "text", "text": strip.question}]}]})
        response.raise_for_status()
        return seeing_model.correct(strip, response.json()["choices"][0]["message"]["content"])

    with ThreadPoolExecutor(2) as pool:
        tiled = sum(pool.map(ask, [(strip, threshold) for strip in strips]))
        squashed = sum(pool.map(ask, [(strip, None) for strip in strips]))
    assert wilson(squashed, len(strips))[1] < wilson(tiled, len(strips))[0], (tiled, squashed)


def test_the_trained_model_reads_less_as_the_pixel_cap_falls_through_the_gateway(system, real_engine):
    secret = system.manage("create_api_key", "--tenant", "demo").stdout.strip()
    questions = _questions()
    caps = [FULL, FULL // 4, FULL // 8]
    stages = resolution.sweep_specs(questions, caps, max_tokens=8, estimate_tokens=lambda w, h: 0)
    target = loadgen.Target(url=f"{system.base_url}/v1/chat/completions", model=REAL_TIER, api_key=secret)
    samples, stopped = asyncio.run(loadgen.run_fixed(target, stages, concurrency=2))
    assert not stopped
    specs = {spec.index: spec for stage in stages for spec in stage}
    full, quarter, eighth = (resolution.cap_summary(s, specs, cap=cap, rates=None)
                             for s, cap in zip(samples, caps, strict=True))
    assert full["errors"] == quarter["errors"] == eighth["errors"] == 0
    assert full["mean_image_tokens"] > eighth["mean_image_tokens"]
    read_full, read_eighth = full["tasks"]["read"], eighth["tasks"]["read"]
    assert read_full["value"] >= 0.9, full["answers"][:5]
    # Measured apart: the full-size interval lies wholly above the eighth's.
    assert read_eighth["interval"][1] < read_full["interval"][0], (read_full, read_eighth)
    # Asked for at least half the text read, the advisor takes the quarter: the eighth reads
    # almost nothing, and the quarter costs a quarter of the tokens.
    points = [advisor.Point(cap=s["cap"], accuracy=s["overall"]["accuracy"], low=s["overall"]["interval"][0],
                            high=s["overall"]["interval"][1], items=ITEMS) for s in (full, quarter, eighth)]
    assert advisor.advise(points, advisor.Target(advisor.AT_LEAST, 50), current_cap=FULL).chosen.cap == FULL // 4


def _gate_on_reading(system_db) -> ModelTier:
    """The real tier gated on reading 30 held-out numbers, within 5 points."""
    tier = ModelTier.objects.using(system_db).select_related("resolution_policy").get(name=REAL_TIER)
    eval_set, created = EvalSet.objects.using(system_db).get_or_create(
        name="gate-read", defaults={"source": "generated", "generator": "read", "seed": seeing_model.HELD_OUT_SEED})
    if created:
        EvalItem.objects.using(system_db).bulk_create([
            EvalItem(eval_set=eval_set, row=n + 1, task_type="read", question=item.question,
                     answers=list(item.answers), content_type="image/png", width=item.width, height=item.height,
                     data=item.data)
            for n, item in enumerate(_questions())])
    QualityGate.objects.using(system_db).get_or_create(
        tier=tier, defaults={"eval_set": eval_set, "tolerance_points": 5, "max_tokens": 8})
    return tier


def _measured(check: GateCheck, system_db, timeout: float) -> GateCheck:
    # As the policy and tier pages do on save: the system's worker measures it.
    # A client of the system's broker only: not this process's current app, which the tests
    # after this one on the same worker send their tasks with.
    Celery(broker=f"redis://127.0.0.1:6379/{SYSTEM_REDIS_DB}", set_as_current=False).send_task(
        "benchmarks.gate_check", args=[check.pk], queue="default")

    def measured():
        check.refresh_from_db(using=system_db)
        return check.state != "running"

    wait_for(measured, timeout=timeout, interval=1, what="the gate check to finish")
    return check


def test_a_gate_blocks_a_cap_that_makes_the_text_unreadable_before_it_serves(system, real_engine, system_db):
    tier = _gate_on_reading(system_db)
    policy = tier.resolution_policy
    current = gates.policy_fields(policy)
    check = _measured(GateCheck.objects.using(system_db).create(
        policy=policy, current=current,
        proposed={**current, "max_pixels": FULL // 8, "low_detail_max_pixels": FULL // 8}), system_db, timeout=240)
    assert check.state == "blocked", check.log
    figures = check.results[REAL_TIER]
    assert figures["current"]["accuracy"] >= 0.9 and figures["drop_points"] > 5
    policy.refresh_from_db(using=system_db)
    assert policy.max_pixels == current["max_pixels"]  # nothing served changed


def test_a_gate_blocks_a_model_that_cannot_read_on_a_candidate_engine_no_one_is_served_by(
        system, real_engine, system_db, vllm_cpu_python):
    tier = _gate_on_reading(system_db)
    current = gates.tier_fields(tier)
    blind = str(tiny_model.ensure(vllm_cpu_python))  # the same architecture, with random weights
    check = GateCheck.objects.using(system_db).create(tier=tier, current=current,
                                                      proposed={**current, "model_id": blind})
    try:
        # The system's node agent launches a second vLLM for the candidate: a minute or two.
        check = _measured(check, system_db, timeout=600)
        assert check.state == "blocked", check.log
        figures = check.results[REAL_TIER]
        assert figures["current"]["accuracy"] >= 0.9 and figures["proposed"]["accuracy"] < 0.2, figures
        candidate = EngineInstance.objects.using(system_db).get(pk=check.candidate_id)
        assert candidate.pool == "candidate" and blind in candidate.command
        # Meanwhile the gateway served the tier from its own engine only, with the model that reads.
        secret = system.manage("create_api_key", "--tenant", "demo").stdout.strip()
        question = _questions()[0]
        reply = httpx.post(f"{system.base_url}/v1/chat/completions", timeout=60,
                           headers={"Authorization": f"Bearer {secret}"},
                           json={"model": REAL_TIER, "max_tokens": 8, "messages": [{"role": "user", "content": [
                               {"type": "image_url", "image_url": {
                                   "url": "data:image/png;base64," + base64.b64encode(question.data).decode()}},
                               {"type": "text", "text": question.question}]}]}).json()
        assert reply["choices"][0]["message"]["content"].strip() == question.answers[0]
        tier.refresh_from_db(using=system_db)
        assert tier.model_id == current["model_id"]
    finally:  # the candidate's vLLM must not outlive the test
        system.manage("shell", "-c", "from controlplane.benchmarks import gates; "
                      "from controlplane.benchmarks.models import GateCheck; "
                      f"gates.check_discard(check=GateCheck.objects.get(pk={check.pk}), user=None)")
    candidate = EngineInstance.objects.using(system_db).get(pk=check.candidate_id)
    assert candidate.desired_state == "stopped"
