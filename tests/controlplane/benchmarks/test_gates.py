"""A gated tier's resolution policy changes only after the change has been measured on the
gate set, the policy in force against the one proposed, on one of the tier's engines; a drop
past the tolerance blocks it unless an operator overrides the block with a reason."""

from __future__ import annotations

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.benchmarks import gates
from controlplane.benchmarks.models import EvalItem, EvalSet, GateCheck, QualityGate
from controlplane.catalog.models import ResolutionPolicy
from controlplane.metering.models import UsageEvent
from tests.images import image_bytes

pytestmark = pytest.mark.django_db


def _form(policy: ResolutionPolicy, **changes) -> dict:
    data = {name: getattr(policy, name) for name in gates.POLICY_FIELDS}
    data.update(name=policy.name, tile_long_images="on" if policy.tile_long_images else "",
                allowed_formats=list(policy.allowed_formats or []), save="1", **changes)
    return {k: v for k, v in data.items() if v != ""}


@pytest.fixture
def gate(world, instance):
    # The simulator answers "image 1 <W>x<H> <tokens> tokens": what it was sent decides the answer.
    eval_set = EvalSet.objects.create(name="sizes", source="imported", file_name="sizes.jsonl")
    for row in (1, 2):
        EvalItem.objects.create(eval_set=eval_set, row=row, task_type="read", question="What size is this?",
                                answers=["image 1 448x448 258 tokens"], content_type="image/png",
                                width=448, height=448, data=image_bytes(448, 448, "PNG"))
    return QualityGate.objects.create(tier=world.vision, eval_set=eval_set, tolerance_points=2, max_tokens=5)


def _propose(client, world, **changes) -> GateCheck:
    policy = world.vision.resolution_policy
    client.force_login(world.operator)
    response = client.post(f"/policies/{policy.name}/", _form(policy, **changes))
    check = GateCheck.objects.get()
    assert response.status_code == 302 and response.url == f"/benchmarks/gates/checks/{check.pk}/"
    gates.check_execute(check_id=check.pk)  # the worker's part
    check.refresh_from_db()
    return check


def test_saving_a_gated_policy_measures_the_change_instead_of_making_it(client, world, gate):
    policy = world.vision.resolution_policy
    assert policy.max_pixels == 1_003_520
    check = _propose(client, world, max_pixels=50_176, low_detail_max_pixels=50_176)
    policy.refresh_from_db()
    assert policy.max_pixels == 1_003_520  # nothing served changed
    assert check.proposed["max_pixels"] == 50_176 and check.current["max_pixels"] == 1_003_520
    figures = check.results[world.vision.name]
    assert figures["current"]["accuracy"] == 1.0
    assert figures["proposed"]["accuracy"] < 1.0
    assert figures["proposed"]["mean_image_tokens"] < figures["current"]["mean_image_tokens"]
    assert figures["drop_points"] > 2 and not figures["passed"]
    assert check.state == "blocked"
    page = client.get(f"/benchmarks/gates/checks/{check.pk}/").content.decode()
    assert "blocks" in page and "Apply over the block" in page


def test_a_check_goes_straight_to_the_engine_is_metered_nowhere_and_says_so(client, world, gate, instance):
    check = _propose(client, world, max_pixels=401_408)
    assert check.log.count(f"on instance {instance.pk} (straight to the engine: not metered)") == 2  # both sides
    assert not UsageEvent.objects.exists()


def test_a_blocked_change_needs_a_reason_and_is_audited_with_it(client, world, gate):
    check = _propose(client, world, max_pixels=50_176, low_detail_max_pixels=50_176)
    client.post(f"/benchmarks/gates/checks/{check.pk}/apply/", {"reason": ""})
    policy = ResolutionPolicy.objects.get(pk=world.vision.resolution_policy_id)
    assert policy.max_pixels == 1_003_520
    client.post(f"/benchmarks/gates/checks/{check.pk}/apply/", {"reason": "cost cut agreed with the customer"})
    policy.refresh_from_db()
    check.refresh_from_db()
    assert policy.max_pixels == 50_176 and check.state == "overridden" and check.decided_by == world.operator
    entry = AuditEntry.objects.filter(object_type="resolution policy", object_id=str(policy.pk)).latest("id")
    assert entry.changes["max_pixels"] == [1_003_520, 50_176]
    assert "overridden: cost cut agreed with the customer" in entry.changes["quality_check"][1]


def test_a_change_within_the_tolerance_passes_and_goes_live_when_applied(client, world, gate):
    check = _propose(client, world, max_pixels=401_408)  # the 448x448 items are sent whole either way
    assert check.state == "passed" and check.results[world.vision.name]["drop_points"] == 0
    client.post(f"/benchmarks/gates/checks/{check.pk}/apply/", {})
    policy = ResolutionPolicy.objects.get(pk=world.vision.resolution_policy_id)
    assert policy.max_pixels == 401_408
    assert GateCheck.objects.get().state == "applied"
    entry = AuditEntry.objects.filter(object_type="resolution policy").latest("id")
    assert entry.actor == world.operator.username and "passed" in entry.changes["quality_check"][1]


def test_a_policy_changed_since_the_check_began_is_not_overwritten(client, world, gate):
    check = _propose(client, world, max_pixels=401_408)
    ResolutionPolicy.objects.filter(pk=world.vision.resolution_policy_id).update(output_quality=70)
    response = client.post(f"/benchmarks/gates/checks/{check.pk}/apply/", {}, follow=True)
    assert "the policy changed after this check began" in response.content.decode()
    assert ResolutionPolicy.objects.get(pk=world.vision.resolution_policy_id).max_pixels == 1_003_520


def test_a_discarded_change_cannot_be_applied(client, world, gate):
    check = _propose(client, world, max_pixels=401_408)
    client.post(f"/benchmarks/gates/checks/{check.pk}/discard/")
    client.post(f"/benchmarks/gates/checks/{check.pk}/apply/", {})
    assert GateCheck.objects.get().state == "discarded"
    assert ResolutionPolicy.objects.get(pk=world.vision.resolution_policy_id).max_pixels == 1_003_520


def test_a_check_without_an_engine_to_measure_on_fails_and_says_why(client, world, gate, instance):
    instance.healthy = False
    instance.save()
    check = _propose(client, world, max_pixels=401_408)
    assert check.state == "failed" and "no healthy engine" in check.log


def test_an_ungated_tier_s_policy_is_saved_at_once(client, world):
    policy = world.vision.resolution_policy
    client.force_login(world.operator)
    client.post(f"/policies/{policy.name}/", _form(policy, max_pixels=401_408))
    policy.refresh_from_db()
    assert policy.max_pixels == 401_408 and not GateCheck.objects.exists()


def test_operators_gate_a_tier_on_a_set_and_others_may_not(client, world):
    eval_set = EvalSet.objects.create(name="receipts", source="imported", file_name="receipts.jsonl")
    client.force_login(world.finance)
    assert client.get("/benchmarks/gates/").status_code == 403
    client.force_login(world.operator)
    response = client.post("/benchmarks/gates/", {"tier": world.vision.pk, "eval_set": eval_set.pk,
                                                  "tolerance_points": 1.5, "max_tokens": 16})
    assert response.status_code == 302
    gate = QualityGate.objects.get(tier=world.vision)
    assert (gate.eval_set, gate.tolerance_points) == (eval_set, 1.5)
    page = client.get(f"/policies/{world.vision.resolution_policy.name}/").content.decode()
    assert "saving a change measures it on the gate set first" in page
    refused = client.post("/benchmarks/gates/", {"tier": world.vision.pk, "eval_set": eval_set.pk,
                                                 "tolerance_points": 101, "max_tokens": 16})
    assert refused.status_code == 200 and QualityGate.objects.get().tolerance_points == 1.5


def test_the_gates_page_lists_each_check_with_the_policy_or_tier_it_changes(client, world):
    GateCheck.objects.create(policy=world.vision.resolution_policy, current={}, proposed={},
                             requested_by=world.operator)
    GateCheck.objects.create(tier=world.vision, current={}, proposed={}, requested_by=world.operator)
    client.force_login(world.operator)
    page = client.get("/benchmarks/gates/").content.decode()
    assert f"<td>policy {world.vision.resolution_policy}</td>" in page
    assert f"<td>tier {world.vision}</td>" in page
