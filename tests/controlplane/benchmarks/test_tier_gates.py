"""A gated tier's model, engine settings or policy change only after the change has been
measured: on a candidate engine the node agent launches as the change would make the tier,
which the gateway never routes to, against an engine serving the tier now. A passed change
applied makes the candidate one of the tier's replicas and replaces the others; a discarded
one stops the candidate."""

from __future__ import annotations

import os
import signal

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.benchmarks import gates
from controlplane.benchmarks.models import EvalItem, EvalSet, GateCheck, QualityGate
from controlplane.catalog.forms import TierForm
from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineInstance
from controlplane.fleet.selectors import routable_instances
from controlplane.fleet.services import instances_place
from tests.factories import ResolutionPolicyFactory
from tests.images import image_bytes
from tests.system.harness import wait_for
from workers import supervision
from workers.engines import process

# The node agent's passes use threads of their own: they must see what the test wrote.
pytestmark = pytest.mark.django_db(transaction=True)

# The simulator answers "image 1 <W>x<H> <tokens> tokens": what it was sent decides the answer.
ANSWER = "image 1 448x448 258 tokens"


@pytest.fixture
def serving(world, settings, tmp_path):
    """The vision tier gated on a two-item set, with one engine serving it, launched by the
    node agent as in production."""
    settings.ENGINE_LOG_DIR = tmp_path / "engines"
    settings.ENGINE_PORT_BASE = 23000 + (os.getpid() % 500) * 8
    settings.ENGINE_HEALTH_TIMEOUT = 0.5
    eval_set = EvalSet.objects.create(name="sizes", source="imported", file_name="sizes.jsonl")
    for row in (1, 2):
        EvalItem.objects.create(eval_set=eval_set, row=row, task_type="read", question="What size is this?",
                                answers=[ANSWER], content_type="image/png", width=448, height=448,
                                data=image_bytes(448, 448, "PNG"))
    QualityGate.objects.create(tier=world.vision, eval_set=eval_set, tolerance_points=2, max_tokens=5)
    node = supervision.this_node()
    instance = EngineInstance.objects.create(tier=world.vision, node=node)
    _reconcile_until(node, lambda: _serving(instance), "the tier's engine to serve")
    yield instance
    for engine in EngineInstance.objects.filter(node=node).exclude(pid=None):
        if process.is_alive(engine.pid):
            os.killpg(engine.pid, signal.SIGCONT)
            process.terminate(engine.pid, grace=2)


def _serving(instance) -> bool:
    instance.refresh_from_db()
    return instance.actual_state == "running" and instance.healthy


def _reconcile_until(node, predicate, what):
    def step():
        instances_place()
        supervision.node_reconcile(node.name)
        return predicate()

    wait_for(step, timeout=30, interval=0.2, what=what)


def _tier_form(tier: ModelTier, **changes) -> dict:
    form = TierForm(instance=tier, engine_kind=tier.engine_kind)
    data = {name: form[name].value() for name in form.fields}
    data.update(changes, engine_kind=tier.engine_kind, save="1")
    return {k: ("on" if v is True else v) for k, v in data.items() if v is not None and v is not False and v != ""}


def _propose(client, world, **changes) -> GateCheck:
    client.force_login(world.operator)
    response = client.post(f"/tiers/{world.vision.name}/", _tier_form(world.vision, **changes))
    check = GateCheck.objects.get()
    assert response.status_code == 302 and response.url == f"/benchmarks/gates/checks/{check.pk}/"
    return check


def _measure(check: GateCheck, serving: EngineInstance) -> GateCheck:
    """The worker's part, with the node agent launching the candidate meanwhile."""
    assert gates.check_execute(check_id=check.pk) is not None  # waits for its candidate
    check.refresh_from_db()
    candidate = check.candidate
    assert candidate.pool == "candidate" and candidate.tier_id == serving.tier_id
    _reconcile_until(serving.node, lambda: _serving(candidate), "the candidate engine to serve")
    # Serving, and still never routed to.
    assert [i.pk for i in routable_instances(tier_id=serving.tier_id)] == [serving.pk]
    assert gates.check_execute(check_id=check.pk) is None
    check.refresh_from_db()
    return check


def test_a_gated_tier_s_new_policy_is_measured_on_a_candidate_engine_and_blocked(client, world, serving):
    small = ResolutionPolicyFactory(name="small", max_pixels=50_176, low_detail_max_pixels=50_176)
    before = world.vision.resolution_policy_id
    check = _propose(client, world, resolution_policy=small.pk)
    world.vision.refresh_from_db()
    assert world.vision.resolution_policy_id == before  # nothing served changed
    check = _measure(check, serving)
    assert check.state == "blocked", check.log
    figures = check.results[world.vision.name]
    assert figures["current"]["accuracy"] == 1.0 and figures["proposed"]["accuracy"] < 1.0
    assert figures["proposed"]["mean_image_tokens"] < figures["current"]["mean_image_tokens"]
    page = client.get(f"/benchmarks/gates/checks/{check.pk}/").content.decode()
    assert "candidate engine" in page and "small" in page and "Apply over the block" in page

    client.post(f"/benchmarks/gates/checks/{check.pk}/discard/")
    candidate = EngineInstance.objects.get(pk=check.candidate_id)
    assert candidate.desired_state == "stopped"
    _reconcile_until(serving.node, lambda: EngineInstance.objects.get(pk=candidate.pk).actual_state == "stopped",
                     "the candidate to stop")
    world.vision.refresh_from_db()
    assert world.vision.resolution_policy_id == before
    assert _serving(serving) and serving.desired_state == "running"


def test_a_passed_engine_change_applied_makes_the_candidate_a_replica_and_replaces_the_rest(
        client, world, serving):
    check = _propose(client, world, setting_max_num_seqs=8)
    assert world.vision.engine_settings["max_num_seqs"] == 16
    check = _measure(check, serving)
    assert check.state == "passed", check.log
    candidate = check.candidate
    assert "--max-num-seqs" in candidate.command
    assert candidate.command[candidate.command.index("--max-num-seqs") + 1] == "8"

    client.post(f"/benchmarks/gates/checks/{check.pk}/apply/", {"reason": ""})
    world.vision.refresh_from_db()
    assert world.vision.engine_settings["max_num_seqs"] == 8
    candidate.refresh_from_db()
    serving.refresh_from_db()
    assert candidate.pool == "standard" and candidate.overrides == {}
    assert serving.desired_state == "stopped" and serving.drain
    assert [i.pk for i in routable_instances(tier_id=world.vision.pk)] == [candidate.pk]
    entry = AuditEntry.objects.filter(object_type="model tier", object_id=str(world.vision.pk)).latest("id")
    assert entry.changes["engine_settings"][1]["max_num_seqs"] == 8
    assert "quality check" in entry.changes["quality_check"][1] and "passed" in entry.changes["quality_check"][1]


def test_a_candidate_that_cannot_start_fails_the_check_with_its_reason(client, world, serving):
    check = _propose(client, world, setting_max_num_seqs=8)
    gates.check_execute(check_id=check.pk)
    check.refresh_from_db()
    EngineInstance.objects.filter(pk=check.candidate_id).update(actual_state="failed",
                                                                state_reason="cannot launch: no such model")
    assert gates.check_execute(check_id=check.pk) is None
    check.refresh_from_db()
    assert check.state == "failed" and "no such model" in check.log
    assert EngineInstance.objects.get(pk=check.candidate_id).desired_state == "stopped"
    world.vision.refresh_from_db()
    assert world.vision.engine_settings["max_num_seqs"] == 16


def test_a_candidate_that_never_serves_fails_the_check_after_its_start_up_allowance(client, world, serving):
    check = _propose(client, world, setting_max_num_seqs=8)
    gates.check_execute(check_id=check.pk)
    GateCheck.objects.filter(pk=check.pk).update(
        created_at=timezone.now() - timezone.timedelta(seconds=gates.CANDIDATE_START_S + 1))
    assert gates.check_execute(check_id=check.pk) is None
    check.refresh_from_db()
    assert check.state == "failed" and "did not serve within" in check.log


def test_changes_that_do_not_touch_the_engines_are_saved_at_once(client, world, serving):
    client.force_login(world.operator)
    response = client.post(f"/tiers/{world.vision.name}/", _tier_form(world.vision, display_name="Lite"))
    assert response.status_code == 302 and not GateCheck.objects.exists()
    world.vision.refresh_from_db()
    assert world.vision.display_name == "Lite"


def test_an_ungated_tier_s_engine_change_is_saved_at_once(client, world, serving):
    QualityGate.objects.all().delete()
    client.force_login(world.operator)
    client.post(f"/tiers/{world.vision.name}/", _tier_form(world.vision, setting_max_num_seqs=8))
    world.vision.refresh_from_db()
    assert world.vision.engine_settings["max_num_seqs"] == 8 and not GateCheck.objects.exists()
